"""fused_moe on CUDA: picks the regime, sizes the blocks, launches the Triton kernels."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache

import torch

from . import launch_config, mma_moe, mma_prefill
from .align import align_pairs
from .dequant import LayerPlanes
from .launch_config import DECODE_LADDERS, PrefillLater
from .mma_moe import Mma
from .mma_prefill import Prefill
from .padding import skip_padding


@dataclass(frozen=True)
class Pairs:
    """The pairs (GEMV) kernels: BN output rows x BKW words (16 codes each) a step."""

    bn: int
    bkw: int
    warps: int


@dataclass(frozen=True)
class Grouped:
    """The grouped (tensor-core) kernels: BM pairs of one expert x BN output rows, BKW words a step."""

    bm: int
    bn: int
    bkw: int
    warps: int
    stages: int
    v2: bool  # the 2-D, K-permuted kernels (triton_moe.py, version 2)


#: the direct decode blocks: K split in two (SPLIT), K whole, one warp a tile (WHOLE), or split with more
#: warps an SM and one chunk in flight (LEAN); SORTED: lean blocks of pairs sorted by expert (align.py). Every
#: decode block is launched dependent (pdl).
SPLIT = Mma(1, 2, 2, direct=True, pdl=True)
WHOLE = Mma(1, 1, 1, direct=True, pdl=True)
LEAN = dataclasses.replace(SPLIT, lean=True)
SORTED = Mma(1, 2, 2, lean=True, pdl=True)

#: the decode steps of a device without a config file (launch_config.py), one ladder for every layer form:
#: direct blocks, the w2 kernel summing the top-k slots below 12 pairs (T = 1 at top-6), K whole from 12
#: pairs (one wave of CTAs at T = 2), K split in two from 18, sorted lean blocks from 224
SHORT_DECODE: tuple[tuple[int, Mma], ...] = (
    (0, dataclasses.replace(SPLIT, sum_in_w2=True)), (12, WHOLE), (18, SPLIT), (224, SORTED))
#: the prefill steps of a device without a config file: four-warp blocks of about the pairs an expert has
#: (P / 256 at V4-Flash's 256 experts), each within 99 KB of shared memory (sm_86, sm_89, sm_120)
SHORT_PREFILL: tuple[tuple[int, Prefill], ...] = (
    (1536, Prefill(4, 4, 2, pipe=True, ctas=2)),
    (8192, Prefill(8, 4, 2, pipe=True, ctas=2)),
    (17408, Prefill(16, 4, 2, pipe=True, ctas=1)),
)


def _step(steps: tuple[tuple[int, Mma | Prefill], ...], P: int) -> Mma | Prefill:
    """The block of the last of `steps` (from P, block; ascending) that P has reached."""
    return [block for start, block in steps if P >= start][-1]


@dataclass(frozen=True)
class Config:
    """Which kernels and blocks for P = T * top_k pairs. The defaults are the short ones of a device without a
    config file; `config_for` gives a device its measured steps (configs/<device>.json). From the first of
    `prefill`'s steps the prefill tensor-core kernels (mma_prefill.cu) run where they can, each step's block
    from its pair count on.
    Below it, and below `large_from` where the prefill kernels cannot run, the decode tensor-core kernels
    (mma_moe.cu) run where they can, each of `mma`'s steps from its pair count on (`()`: none). The
    Triton kernels run the rest: everything where neither can run (no sm_80, dims that do not split),
    Triton `large` from `large_from`. Layers in the x4 layout take `mma_x4`'s steps in place of `mma`'s,
    or `mma_x4_e4m3`'s where their block scales are e4m3, or `mma_x4_base`'s where they are e8m0 and the
    layer has no tier. A layer's first prefill step comes `prefill_later.of(its form)` pairs later."""

    mma: tuple[tuple[int, Mma], ...] = SHORT_DECODE  # (from P, block), ascending, the first from 0; () for none
    mma_x4: tuple[tuple[int, Mma], ...] = SHORT_DECODE  # the same for x4 layers
    mma_x4_base: tuple[tuple[int, Mma], ...] = SHORT_DECODE  # and for x4 layers without a tier
    mma_x4_e4m3: tuple[tuple[int, Mma], ...] = SHORT_DECODE  # and for x4 layers with e4m3 scales
    tiny_max: int = 12        # P up to this: Triton `tiny`
    pairs_max: int = 96       # then up to this: Triton `pairs`
    large_from: int = 2048    # from this: Triton `large` (and no decode kernels); between: Triton `mid`
    tiny: Pairs = Pairs(32, 16, 2)
    pairs: Pairs = Pairs(64, 8, 2)
    mid: Grouped = Grouped(16, 64, 16, 4, 2, True)
    large: Grouped = Grouped(128, 128, 4, 8, 3, False)
    prefill: tuple[tuple[int, Prefill], ...] = SHORT_PREFILL  # (from P, block), ascending; () for none
    prefill_later: PrefillLater = dataclasses.field(default_factory=PrefillLater)

    def pick(self, P: int, mma_runs: bool = True, prefill_runs: bool = True,
             x4: bool = False, e4m3: bool = False, tier: bool = True) -> Pairs | Grouped | Mma | Prefill:
        """The kernels for P pairs; `mma_runs` / `prefill_runs`: whether the tensor-core decode / prefill
        kernels run this layer here; `x4`: whether its planes are in the x4 layout (`mma_x4`'s steps);
        `e4m3`: whether its block scales are e4m3 (an x4 layer then takes `mma_x4_e4m3`'s); `tier`: whether
        it has a tier (an x4 layer with e8m0 scales and none takes `mma_x4_base`'s)."""
        mma = self.decode_steps(x4, e4m3, tier)
        if prefill_runs and self.prefill and P >= self.prefill[0][0] + self.prefill_later.of(x4, e4m3, tier):
            return _step(self.prefill, P)
        if mma and mma_runs and P < self.large_from:
            return _step(mma, P)
        if P <= self.tiny_max:
            return self.tiny
        if P <= self.pairs_max:
            return self.pairs
        return self.large if P >= self.large_from else self.mid

    def decode_steps(self, x4: bool = False, e4m3: bool = False, tier: bool = True) -> tuple[tuple[int, Mma], ...]:
        """The decode steps of a layer form (`pick`'s arguments)."""
        return (self.mma_x4_e4m3 if e4m3 else self.mma_x4 if tier else self.mma_x4_base) if x4 else self.mma

    @classmethod
    def only(cls, block: Pairs | Grouped | Mma | Prefill) -> Config:
        """Always these kernels and blocks (tests, sweeps); Prefill where it cannot run: Triton `large`."""
        if isinstance(block, Mma):
            return cls(**{n: ((0, block),) for n in DECODE_LADDERS}, large_from=1 << 62, prefill=())
        no_mma = {n: () for n in DECODE_LADDERS}
        if isinstance(block, Prefill):
            return cls(**no_mma, tiny_max=0, pairs_max=0, large_from=0, prefill=((0, block),),
                       prefill_later=PrefillLater())
        if isinstance(block, Pairs):
            return cls(**no_mma, tiny_max=0, pairs_max=1 << 62, pairs=block, prefill=())
        return cls(**no_mma, tiny_max=0, pairs_max=0, large_from=1 << 62, mid=block, prefill=())

    def decode_blocks(self) -> set[Mma]:
        """Every block of every layer form's decode steps."""
        return {block for name in DECODE_LADDERS for _, block in getattr(self, name)}


@cache
def config_named(device_name: str) -> Config:
    """The Config of a CUDA device named `device_name`: its measured steps (configs/<device>.json), or the
    short defaults where there is no file for it. A malformed file is an InputError."""
    steps = launch_config.for_device(device_name)
    return Config(**steps.fields()) if steps is not None else Config()


def config_for(device: torch.device) -> Config:
    """The Config fused_moe runs with on `device` (the short defaults off CUDA)."""
    if device.type != "cuda":
        return Config()
    return _config_of_index(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _config_of_index(index: int) -> Config:
    # once a process and device: fused_moe_cuda asks on every call
    return config_named(torch.cuda.get_device_name(index))


#: the steps measured on the H200 (configs/NVIDIA_H200.json): the reference ladder of the tests and sweeps
DEFAULT = config_named("NVIDIA H200")


def layer_form(planes: LayerPlanes) -> dict[str, bool]:
    """Config.pick's `x4`, `e4m3` and `tier` for a layer: its planes' layout, its block scales' form and
    whether it has a tier."""
    return {"x4": planes.x4_layout, "e4m3": not planes.e8m0[0],
            "tier": planes.delta_experts.numel() > 0}


def _fit(n: int, want: int) -> int:
    """The largest power of two <= want that divides n."""
    b = want
    while b > 1 and n % b:
        b //= 2
    return b


def _words(t: torch.Tensor) -> torch.Tensor:
    """uint8 plane [..., n/4] as int32 words [..., n/16] (16 codes a word, same bytes)."""
    return t.contiguous().view(torch.int32)


def fused_moe_cuda(x: torch.Tensor, planes: LayerPlanes, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   swiglu_limit: float | None, config: Config | None = None) -> torch.Tensor:
    """[T, H] in x's dtype; works on CUDA tensors (and CPU ones under TRITON_INTERPRET=1); `config`: the
    device's (config_for) unless given."""
    from . import triton_moe as k  # triton is optional: only where its kernels run

    T, H, I, E = x.shape[0], planes.hidden, planes.inter, planes.num_experts
    top_k = topk_ids.shape[1] if topk_ids.dim() == 2 else 0
    if T == 0 or top_k == 0:
        return torch.zeros((T, H), dtype=x.dtype, device=x.device)
    if H % 16 or I % 16:
        raise ValueError(f"hidden {H} and intermediate {I} must be multiples of 16")
    dev = x.device
    config = config_for(dev) if config is None else config
    # vLLM's padding rows (expert id -1): no -1 reaches a kernel (padding.py)
    x, topk_weights, topk_ids = skip_padding(x, topk_weights, topk_ids)
    x = x.contiguous()
    P = T * top_k
    form = layer_form(planes)
    c = config.pick(P, **form)
    if isinstance(c, Prefill):
        # fewer stages where the device's shared memory is smaller than the H200's (mma_prefill.within)
        fit = mma_prefill.within(c, mma_prefill.smem_limit(dev)) if mma_moe.runs_here(dev) else None
        if fit is not None and mma_prefill.supported(planes, x, P, fit):
            return mma_moe.sum_slots(
                mma_prefill.fused_moe_prefill(x, planes, topk_weights, topk_ids, swiglu_limit, fit), x.dtype)
        c = config.pick(P, prefill_runs=False, **form)
    if isinstance(c, Mma):
        if mma_moe.supported(planes, dev, c):
            return mma_moe.fused_moe_mma(x, planes, topk_weights, topk_ids, swiglu_limit, c)
        c = config.pick(P, mma_runs=False, prefill_runs=False)
    planes = planes.natural()  # the Triton kernels read the natural layout only
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    wts = topk_weights.reshape(-1).contiguous()
    tier = torch.full((E,), -1, dtype=torch.int32, device=dev)
    n = planes.delta_experts.numel()
    if n:
        tier[planes.delta_experts] = torch.arange(n, dtype=torch.int32, device=dev)
    b13, b2 = _words(planes.w13_base), _words(planes.w2_base)
    d13 = _words(planes.w13_delta) if n else b13  # never read without a tier row
    d2 = _words(planes.w2_delta) if n else b2
    s13, s2 = planes.w13_scale.contiguous().view(torch.uint8), planes.w2_scale.contiguous().view(torch.uint8)
    g13, g2 = H // s13.shape[-1], I // s2.shape[-1]
    e8_13, e8_2 = planes.e8m0
    s2_13 = planes.w13_scale_2.contiguous()
    s2_2 = planes.w2_scale_2.contiguous()
    t13, t2 = planes.w13_table.contiguous(), planes.w2_table.contiguous()
    limit = 0.0 if swiglu_limit is None else float(swiglu_limit)
    act = torch.empty((P, I), dtype=x.dtype, device=dev)
    out = torch.empty((P, H), dtype=torch.float32, device=dev)
    if isinstance(c, Pairs):
        bn13, bkw13 = _fit(I, c.bn), _fit(H // 16, c.bkw)
        k.w13_pairs_kernel[(P, I // bn13)](
            x, ids, tier, b13, d13, s13, s2_13, t13, act, top_k, H, I, limit,
            b13.stride(0), b13.stride(1), s13.stride(0), s13.stride(1),
            GROUP=g13, E8M0=e8_13, HAS_LIMIT=swiglu_limit is not None, BN=bn13, BKW=bkw13,
            num_warps=c.warps)
        bn2, bkw2 = _fit(H, c.bn), _fit(I // 16, c.bkw)
        k.w2_pairs_kernel[(P, H // bn2)](
            act, ids, wts, tier, b2, d2, s2, s2_2, t2, out, H, I,
            b2.stride(0), b2.stride(1), s2.stride(0), s2.stride(1),
            GROUP=g2, E8M0=e8_2, BN=bn2, BKW=bkw2, num_warps=c.warps)
    else:
        blocks = align_pairs(topk_ids, E, c.bm)
        bn13, bkw13 = _fit(I, c.bn), _fit(H // 16, c.bkw)
        bn2, bkw2 = _fit(H, c.bn), _fit(I // 16, c.bkw)
        # v2 reads x K-permuted: position j * BKW + w of each step holds element w * 16 + j
        xk = x.view(T, H // (16 * bkw13), bkw13, 16).transpose(2, 3).contiguous() if c.v2 else x
        k.w13_grouped_kernel[(blocks.max_blocks, I // bn13)](
            xk, blocks.sorted_pairs, blocks.block_expert, tier, b13, d13, s13, s2_13, t13, act, top_k, H, I,
            limit, b13.stride(0), b13.stride(1), s13.stride(0), s13.stride(1),
            GROUP=g13, E8M0=e8_13, HAS_LIMIT=swiglu_limit is not None, BM=c.bm, BN=bn13, BKW=bkw13,
            BKW2=bkw2, DOT_F32=not x.is_cuda, V2=c.v2, num_warps=c.warps, num_stages=c.stages)
        k.w2_grouped_kernel[(blocks.max_blocks, H // bn2)](
            act, blocks.sorted_pairs, blocks.block_expert, wts, tier, b2, d2, s2, s2_2, t2, out, H, I,
            b2.stride(0), b2.stride(1), s2.stride(0), s2.stride(1),
            GROUP=g2, E8M0=e8_2, BM=c.bm, BN=bn2, BKW=bkw2, DOT_F32=not x.is_cuda, V2=c.v2,
            num_warps=c.warps, num_stages=c.stages)
    return out.view(T, top_k, H).sum(1).to(x.dtype)
