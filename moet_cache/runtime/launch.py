"""fused_moe on CUDA: picks the regime, sizes the blocks, launches the Triton kernels."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .align import align_pairs
from .dequant import LayerPlanes
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


#: the prefill blocks by the pairs they take over from (launch.Config.prefill): H200, V4-Flash layer, one
#: process, write harness, four served forms (docs/RUNTIME.md, session 21). A block's pairs are best about
#: the pairs an expert has: 32 (nt 4) up to about 8192 pairs (T = 1280: 2422 us against 2722 for nt 8;
#: T = 1536: 2978 against 2737), 64 (nt 8) up to about 17400 (T = 2560: 3576 against 4564 for nt 16;
#: T = 3072: 4894 against 4692), 128 after. Four warps a CTA: 4-9% faster at T = 1344-2816, 21-25% at 2048
#: than the (2, 8, 4) and (4, 8, 4) blocks before them, which took 8 warps and 88-104 KB of shared memory
#: where these take 35-84.
PREFILL_STEPS: tuple[tuple[int, Prefill], ...] = (
    (1536, Prefill(4, 4, 2, pipe=True, ctas=2)),
    (8192, Prefill(8, 4, 2, pipe=True, ctas=2)),
    (17408, Prefill(16, 4, 2, pipe=True, ctas=1)),
)


#: pairs below which the w2 kernel sums the top-k slots itself (Mma.sum_in_w2), in place of moe_sum (session
#: 15, H200, x4 layers, same process, µs: T = 1 30.7 against 32.5, with a tier 31.1 against 33.0; T = 2 53.1
#: against 53.2, with a tier 58.1 against 56.6; T = 4 with e4m3 scales, direct blocks, 93.5 against 90.9;
#: lean blocks at T = 16 261.7 against 249.6: each w2 block ends in a fence and an atomic)
SUM_IN_W2_BELOW = 12


#: pairs from which the direct blocks split K in two again (`_decode_steps`): from SUM_IN_W2_BELOW up to here
#: they leave K whole, one warp a tile (session 17, H200, V4-Flash layer, same process, µs, stream / write:
#: T = 2 x4 37.1 against 40.4 / 42.9 against 45.9, x4 e4m3 39.9 against 43.3, with a 10% tier 43.8 against
#: 45.1, fitted with a tier 52.9 against 53.9; T = 3 62.6 against 56.8). At 12 pairs the split blocks' w13
#: grid, 12 x 128 CTAs of 4 warps, takes two waves of the 24 warps an SM their registers allow, the unsplit
#: one a single wave; at 6 pairs both fit one and the split one has twice the warps (T = 1: 27.0 against
#: 23.2), and from 18 pairs neither fits one.
WHOLE_K_BELOW = 18


#: the direct decode blocks (docs/RUNTIME.md, session 18): K split in two (SPLIT), K whole, one warp a tile
#: (WHOLE), or split with more warps an SM and one chunk in flight (LEAN)
SPLIT = Mma(1, 2, 2, direct=True, pdl=True)
WHOLE = Mma(1, 1, 1, direct=True, pdl=True)
LEAN = dataclasses.replace(SPLIT, lean=True)


def _decode_steps(*middle: tuple[int, Mma], sorted_from: int = 224) -> tuple[tuple[int, Mma], ...]:
    """The decode blocks by the pairs they take over from (launch.Config.mma), below the prefill steps; the
    layer forms differ only in the `middle` steps, from WHOLE_K_BELOW pairs up to `sorted_from`. Every one
    launched dependent (`pdl`: T = 1: 42.9 us against 45.6). Direct blocks, each expert's decode shared by
    its pairs: K split in two below SUM_IN_W2_BELOW (where the w2 kernel also sums the top-k slots) and from
    WHOLE_K_BELOW, K whole between; then the form's steps; sorted lean blocks from `sorted_from` pairs
    (session 8: T = 40: 724 against 749 direct; T = 32, direct: 522-535 against 573 sorted)."""
    return ((0, dataclasses.replace(SPLIT, sum_in_w2=True)), (SUM_IN_W2_BELOW, WHOLE), (WHOLE_K_BELOW, SPLIT),
            *middle, (sorted_from, Mma(1, 2, 2, lean=True, pdl=True)))


#: fitted tables: K whole from 36 pairs (session 18, H200, V4-Flash layer, one process, two samples each,
#: µs, stream / write, split or lean against K whole: with e4m3 scales and a 10% tier T = 16 328.9 / 320.2
#: against 316.1 / 313.3, T = 24 444.9 / 439.5 against 428.5 / 423.6; e8m0 T = 8 161.8 / 167.9 against
#: 159.9 / 165.5; T = 6 about 1% faster; T = 4 2-3% slower, 88.5 / 93.8 against 90.8 / 96.1: split to 35),
#: sorted from 288 pairs (session 19, stream, two samples, µs, sorted lean against K whole: e8m0 T = 38
#: 600.1 / 596.2 against 550.6 / 550.7, T = 44 636.5 / 634.3 against 606.8 / 603.2; e4m3 with a 10% tier
#: T = 38 636.6 / 636.0 against 608.4 / 608.7, T = 46 698.4 / 712.5 against 699.3 / 689.6; session 18:
#: K whole 0.5-3% slower at T = 48)
MMA_STEPS = _decode_steps((36, WHOLE), sorted_from=288)

#: x4 layers (x4_table.py: chunk-major tiles), e8m0 scales, with a tier (the build's default): lean from 24
#: pairs (session 14, two samples each, direct against lean: T = 4 87.8 us against 86.2, with a 10% tier
#: 96.0 against 94.5; T = 8 155.6 against 143.7; T = 16 278.5 against 247.5). K whole in their place is
#: 1.5-6% slower at T = 4-12 (session 18, stream / write: T = 4 76.5 / 86.9 against 77.8 / 88.8; T = 12
#: 176.0 / 180.4 against 179.8 / 191.4): its tier experts' blocks, a warp a tile over the whole K, end last.
MMA_STEPS_X4 = _decode_steps((24, LEAN))

#: x4 layers with e8m0 scales and no tier: K whole from 24 pairs to 71, lean after (session 18, stream /
#: write, µs, lean against K whole: T = 4 70.8 / 79.5 against 67.4 / 74.2; T = 6 98.8 / 109.0 against 95.8 /
#: 104.2; T = 8 124.9 / 134.1 against 122.8 / 132.1; T = 12 164.9 / 171.2 against 166.4 / 178.2)
MMA_STEPS_X4_BASE = _decode_steps((24, WHOLE), (72, LEAN))

#: x4 layers with e4m3 block scales (NVFP4 whose scales are not powers of two, e.g. the V3 family), whose
#: decode converts a scale every 16 codes: K whole from 24 pairs, with a tier or not (session 18, stream,
#: µs, split or lean against K whole: T = 4 74.6 against 72.3, with a 10% tier 81.0 against 81.2; T = 8
#: 135.2 against 131.9, tier 146.4 against 145.0; T = 16 252.3 against 244.6, tier 276.1 against 269.9;
#: T = 32 422.4 against 399.8, tier 439.9 against 425.3; do_bench's harness 1-3% slower at T = 12: 183.4
#: against 186.0, tier 194.2 against 200.3)
MMA_STEPS_X4_E4M3 = _decode_steps((24, WHOLE))


@dataclass(frozen=True)
class PrefillLater:
    """The pairs by which a layer form's first prefill step comes after `Config.prefill`'s: the prefill
    blocks' time grows more than the sorted lean decode blocks' with the x4 layout, a tier and e4m3 scales."""

    x4: int = 0
    tier: int = 0
    e4m3: int = 0

    def of(self, x4: bool, e4m3: bool, tier: bool) -> int:
        return self.x4 * x4 + self.tier * tier + self.e4m3 * e4m3


#: the crossovers from the sorted lean blocks to the first prefill step, by form (session 21, H200, V4-Flash
#: layer, write harness, µs, lean against Prefill(4, 4, 2)): the lean blocks' time grows about 5.4 us a token
#: from T = 256 to 320 where the prefill block's stays (x4 with a tier: 1539.9 against 1631.8 at T = 256,
#: 1886.4 against 1634.2 at T = 320), so they cross at about 1540 pairs x4 base only (1528.7 / 1534.8 at T =
#: 256), 1640 x4 with a tier, 1660 fitted with a tier, 1810 x4 e4m3 with a tier (1548.2 / 1790.3 at 256, 1893.4
#: / 1794.4 at 320): 1536 + 112 tier + 160 e4m3 within 20 pairs of each. (Session 19, against the slower
#: Prefill(2, 8, 4): 1536 + 64 x4 + 128 tier + 256 e4m3.)
PREFILL_LATER = PrefillLater(x4=0, tier=112, e4m3=160)


def _step(steps: tuple[tuple[int, Mma | Prefill], ...], P: int) -> Mma | Prefill:
    """The block of the last of `steps` (from P, block; ascending) that P has reached."""
    return [block for start, block in steps if P >= start][-1]


#: Config's decode steps, one for each layer form
_LADDERS = ("mma", "mma_x4", "mma_x4_base", "mma_x4_e4m3")


@dataclass(frozen=True)
class Config:
    """Which kernels and blocks for P = T * top_k pairs; the defaults are the H200 measurements' best
    (benchmarks/bench_moe.py --sweep, docs/RUNTIME.md). From the first of `prefill`'s steps the prefill
    tensor-core kernels (mma_prefill.cu) run where they can, each step's block from its pair count on.
    Below it, and below `large_from` where the prefill kernels cannot run, the decode tensor-core kernels
    (mma_moe.cu) run where they can, each of `mma`'s steps from its pair count on (`()`: none). The
    Triton kernels run the rest: everything where neither can run (no sm_80, dims that do not split),
    Triton `large` from `large_from`. Layers in the x4 layout take `mma_x4`'s steps in place of `mma`'s,
    or `mma_x4_e4m3`'s where their block scales are e4m3, or `mma_x4_base`'s where they are e8m0 and the
    layer has no tier. A layer's first prefill step comes `prefill_later.of(its form)` pairs later."""

    mma: tuple[tuple[int, Mma], ...] = MMA_STEPS  # (from P, block), ascending, the first from 0; () for none
    mma_x4: tuple[tuple[int, Mma], ...] = MMA_STEPS_X4  # the same for x4 layers
    mma_x4_base: tuple[tuple[int, Mma], ...] = MMA_STEPS_X4_BASE  # and for x4 layers without a tier
    mma_x4_e4m3: tuple[tuple[int, Mma], ...] = MMA_STEPS_X4_E4M3  # and for x4 layers with e4m3 scales
    tiny_max: int = 12        # P up to this: Triton `tiny`
    pairs_max: int = 96       # then up to this: Triton `pairs`
    large_from: int = 2048    # from this: Triton `large` (and no decode kernels); between: Triton `mid`
    tiny: Pairs = Pairs(32, 16, 2)
    pairs: Pairs = Pairs(64, 8, 2)
    mid: Grouped = Grouped(16, 64, 16, 4, 2, True)
    large: Grouped = Grouped(128, 128, 4, 8, 3, False)
    prefill: tuple[tuple[int, Prefill], ...] = PREFILL_STEPS  # (from P, block), ascending; () for none
    prefill_later: PrefillLater = PREFILL_LATER

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
    def only(cls, block: Pairs | Grouped | Mma | Prefill) -> "Config":
        """Always these kernels and blocks (tests, sweeps); Prefill where it cannot run: Triton `large`."""
        if isinstance(block, Mma):
            return cls(**{n: ((0, block),) for n in _LADDERS}, large_from=1 << 62, prefill=())
        no_mma = {n: () for n in _LADDERS}
        if isinstance(block, Prefill):
            return cls(**no_mma, tiny_max=0, pairs_max=0, large_from=0, prefill=((0, block),),
                       prefill_later=PrefillLater())
        if isinstance(block, Pairs):
            return cls(**no_mma, tiny_max=0, pairs_max=1 << 62, pairs=block, prefill=())
        return cls(**no_mma, tiny_max=0, pairs_max=0, large_from=1 << 62, mid=block, prefill=())

    def decode_blocks(self) -> set[Mma]:
        """Every block of every layer form's decode steps."""
        return {block for name in _LADDERS for _, block in getattr(self, name)}


DEFAULT = Config()


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
                   swiglu_limit: float | None, config: Config = DEFAULT) -> torch.Tensor:
    """[T, H] in x's dtype; works on CUDA tensors (and CPU ones under TRITON_INTERPRET=1)."""
    from . import mma_moe, mma_prefill
    from . import triton_moe as k

    T, H, I, E = x.shape[0], planes.hidden, planes.inter, planes.num_experts
    top_k = topk_ids.shape[1] if topk_ids.dim() == 2 else 0
    if T == 0 or top_k == 0:
        return torch.zeros((T, H), dtype=x.dtype, device=x.device)
    if H % 16 or I % 16:
        raise ValueError(f"hidden {H} and intermediate {I} must be multiples of 16")
    dev = x.device
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
