"""Which Experts (experts.py) computes a layer: the CPU reference off CUDA; on CUDA, by the pair count and the
layer form, the prefill or decode tensor-core kernels where they run, else the Triton kernels. `Config` holds
the pair-count ladders (a device's measured ones from configs/<device>.json, launch_config.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache

import torch

from . import launch_config, mma_prefill
from .dequant import LayerPlanes
from .experts import Experts
from .launch_config import DECODE_LADDERS, PrefillLater
from .mma_moe import DecodeExperts, Mma
from .mma_prefill import Prefill, PrefillExperts
from .nvrtc import runs_here
from .padding import skip_padding
from .reference import ReferenceExperts
from .triton_experts import Grouped, Pairs, TritonExperts


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
    return {"x4": planes.layout.x4, "e4m3": not planes.e8m0[0],
            "tier": planes.delta_experts.numel() > 0}


def cuda_experts(x: torch.Tensor, planes: LayerPlanes, pairs: int, config: Config) -> Experts:
    """The Experts `config` picks for `pairs` routed pairs of this layer on x's device: from the first prefill
    step the prefill kernels where they run, below it (and where they do not) the decode kernels where
    they run, else the Triton kernels with `config`'s block for the pair count where they run (a layer with
    a mid tier, which the plane kernels do not decode, comes here), else the torch reference."""
    form = layer_form(planes)
    c = config.pick(pairs, **form)
    if isinstance(c, Prefill):
        # fewer stages where the device's shared memory is smaller than the H200's (mma_prefill.within)
        fit = mma_prefill.within(c, mma_prefill.smem_limit(x.device)) if runs_here(x.device) else None
        if fit is not None and (prefill := PrefillExperts(fit)).supports(planes, x, pairs):
            return prefill
        c = config.pick(pairs, prefill_runs=False, **form)
    if isinstance(c, Mma):
        if (decode := DecodeExperts(c)).supports(planes, x, pairs):
            return decode
        c = config.pick(pairs, mma_runs=False, prefill_runs=False)
    triton = TritonExperts(c)
    return triton if triton.supports(planes, x, pairs) else ReferenceExperts()


def fused_moe_cuda(x: torch.Tensor, planes: LayerPlanes, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   swiglu_limit: float | None, config: Config | None = None) -> torch.Tensor:
    """[T, H] in x's dtype by the CUDA paths (`cuda_experts`); works on CUDA tensors (and CPU ones under
    TRITON_INTERPRET=1, where the Triton kernels run); `config`: the device's (config_for) unless given."""
    T, H, I = x.shape[0], planes.hidden, planes.inter
    top_k = topk_ids.shape[1] if topk_ids.dim() == 2 else 0
    if T == 0 or top_k == 0:
        return torch.zeros((T, H), dtype=x.dtype, device=x.device)
    if H % 16 or I % 16:
        raise ValueError(f"hidden {H} and intermediate {I} must be multiples of 16")
    config = config_for(x.device) if config is None else config
    # vLLM's padding rows (expert id -1): no -1 reaches a kernel (padding.py)
    x, topk_weights, topk_ids = skip_padding(x, topk_weights, topk_ids)
    x = x.contiguous()
    experts = cuda_experts(x, planes, T * top_k, config)
    return experts.apply(x, planes, topk_weights, topk_ids, swiglu_limit)


def fused_moe_on_device(x: torch.Tensor, planes: LayerPlanes, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        swiglu_limit: float | None) -> torch.Tensor:
    """[T, H] in x's dtype by the path for x's device: the CUDA paths on CUDA (fused_moe_cuda), the CPU
    reference elsewhere (ReferenceExperts)."""
    if x.is_cuda:
        return fused_moe_cuda(x, planes, topk_weights, topk_ids, swiglu_limit)
    return ReferenceExperts().apply(x, planes, topk_weights, topk_ids, swiglu_limit)
