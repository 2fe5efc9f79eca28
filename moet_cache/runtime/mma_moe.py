"""The tensor-core plane kernels (mma_moe.cu): compiled by NVRTC at first use (or loaded from their kept
images, kernel_cache.py), launched on one block a pair straight from topk_ids, each expert's pairs taken by
the block of its first (`direct`, decode), or on the pairs sorted by expert (align.py). CUDA only, compute
capability 8.0 and up (mma.sync bf16)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .align import align_pairs
from .dequant import LayerPlanes
from .experts import Experts

from .kernel_launch import launch
from .nvrtc import CHUNK_WORDS, compiled, runs_here
from .plane_layout import PlaneLayout



@dataclass(frozen=True)
class Mma:
    """A CTA: blocks of 8 * nt pairs of one expert x 16 output rows (w13: and their 16 up rows); ks13 /
    ks2 warps split K per tile. `direct` (nt 1): a grid of one block a pair, straight from topk_ids;
    the pairs of each expert, 8 at a time in pair order, are taken by the block of the first of them
    and the other blocks leave at once (mma_moe.cu group_pair), so no align kernels run (decode).
    `lean`: 64 registers and one chunk in flight a warp, for more warps an SM, the tile prefetched into
    the L2 (mma_moe.cu MIN_THREADS_SM; nt 1 only). `pdl`: the w13, w2 and sum kernels launched dependent,
    each starting while the one ahead finishes (kernel_launch.py; sm_90+). `sum_in_w2` (direct blocks):
    the w2 kernel sums each token's top-k slots itself (mma_moe.cu sum_when_last), and moe_sum does not
    run."""

    nt: int
    ks13: int
    ks2: int
    direct: bool = False
    lean: bool = False
    pdl: bool = False
    sum_in_w2: bool = False

    def __post_init__(self) -> None:
        if (self.direct or self.lean) and self.nt != 1:
            raise ValueError("direct and lean blocks are one column of 8 pairs: nt must be 1")
        if self.sum_in_w2 and not self.direct:
            raise ValueError("only direct blocks sum the top-k slots in the w2 kernel")


def two_accumulators(block: Mma, layout: PlaneLayout, e8m0: bool) -> bool:
    """Whether a kernel of `block` sums its mma into two accumulator sets (mma_moe.cu k_loop's ACC2): the
    one-column blocks that are not lean, of x4 layers and of tiled fitted layers with e8m0 scales
    (1-3.5% faster at T = 1-24; with e4m3 scales and a tier 3-6% slower at T = 2). Natural-layout
    blocks would spill with it; lean ones spill or lose 1-3%. The sums then
    come in another order than one set's, so the output may differ from the natural layout's by rounding."""
    return block.nt == 1 and not block.lean and (layout.x4 or (layout.tiled and e8m0))


def k_paired(x: torch.Tensor) -> torch.Tensor:
    """bf16 [T, K] with position 4j + 2h + s of each 16 holding element j + 4s + 8h (mma_moe.cu pair_col):
    each 8 bytes are the decode kernels' B registers (b0, b1) of one mma step."""
    T, K = x.shape
    return x.to(torch.bfloat16).view(T, K // 16, 2, 2, 4).permute(0, 1, 4, 2, 3).reshape(T, K).contiguous()


def supported(planes: LayerPlanes, device: torch.device, block: Mma) -> bool:
    """Whether these kernels run this layer here: `runs_here`, and K splits into whole chunks per warp."""
    if not runs_here(device):
        return False
    H, I = planes.hidden, planes.inter
    return H % (16 * CHUNK_WORDS * block.ks13) == 0 and I % (16 * CHUNK_WORDS * block.ks2) == 0


def _kernel(name: str, device: int) -> Any:
    return compiled("mma_moe.cu", name, device)


def kernel_name(block: Mma, tiles: int, e8m0: bool, layout: PlaneLayout) -> str:
    """The moe_mma instantiation of `block` for w13 (tiles 2) or w2 (tiles 1) of a layer whose block scales of
    that projection are e8m0 or not, in `layout` (the kernel's x4 and tiled flags)."""
    flags = (e8m0, block.lean, layout.x4, layout.tiled, two_accumulators(block, layout, e8m0))
    ks = block.ks13 if tiles == 2 else block.ks2
    return f"moe_mma<{tiles}, {block.nt}, {ks}, {', '.join(str(f).lower() for f in flags)}>"


def sum_name(dtype: torch.dtype) -> str | None:
    """The moe_sum instantiation for activations of `dtype`, or None where torch sums instead (sum_slots)."""
    return f"moe_sum<{_SUM_OUT[dtype]}>" if dtype in _SUM_OUT else None


@dataclass(frozen=True)
class Operands:
    """One layer's tensors as the plane kernels take them (mma_moe.cu and mma_prefill.cu: w13 then w2),
    with the routing weights flat in float32. Without a tier the base planes stand in for the delta
    ones: no tier row means they are never read."""

    weights: torch.Tensor   # float32 [P]
    tier: torch.Tensor      # int64 [n]: delta_experts
    base: tuple[torch.Tensor, torch.Tensor]
    delta: tuple[torch.Tensor, torch.Tensor]
    scale: tuple[torch.Tensor, torch.Tensor]    # the block-scale bytes (uint8)
    e8m0: tuple[bool, bool]
    scale_2: tuple[torch.Tensor, torch.Tensor]  # float32
    table: tuple[torch.Tensor, torch.Tensor]    # float32

    @classmethod
    def of(cls, planes: LayerPlanes, topk_weights: torch.Tensor) -> "Operands":
        tier = planes.delta_experts.to(torch.int64).contiguous()
        base = (planes.w13_base.contiguous(), planes.w2_base.contiguous())
        delta = (planes.w13_delta.contiguous(), planes.w2_delta.contiguous()) if tier.numel() else base
        scales = (planes.w13_scale, planes.w2_scale)
        return cls(topk_weights.reshape(-1).float().contiguous(), tier, base, delta,
                   tuple(s.contiguous().view(torch.uint8) for s in scales),
                   planes.e8m0,
                   (planes.w13_scale_2.float().contiguous(), planes.w2_scale_2.float().contiguous()),
                   (planes.w13_table.float().contiguous(), planes.w2_table.float().contiguous()))

    def layer_args(self, i: int) -> list[Any]:
        """The kernel arguments from the tier to the table, of w13 (i 0) or w2 (i 1), then the weights."""
        return [self.tier, self.tier.numel(), self.base[i], self.delta[i], self.scale[i], self.scale_2[i],
                self.table[i], self.weights]


#: moe_sum's output types (mma_moe.cu)
_SUM_OUT = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def sum_slots(part: torch.Tensor, dtype: torch.dtype, dependent: bool = False) -> torch.Tensor:
    """[T, top_k, H] float32 per pair (weighted) -> [T, H] in `dtype`: one kernel (moe_sum) for the sum
    and the cast, where torch takes two (5 us of a 50 us decode layer)."""
    T, top_k, H = part.shape
    if dtype not in _SUM_OUT or H % 4:
        return part.sum(1).to(dtype)
    y = torch.empty((T, H), dtype=dtype, device=part.device)
    with torch.cuda.device(part.device):
        launch(_kernel(sum_name(dtype), part.device.index), ((H // 4 + 127) // 128, T, 1),
               (128, 1, 1), [part.contiguous(), y, top_k, H], dependent)
    return y


def paired_rows(x: torch.Tensor, arrived: torch.Tensor) -> torch.Tensor:
    """k_paired(x) on the GPU by the pair_rows kernel (mma_moe.cu), which also zeroes `arrived` (int32, the
    w2 kernel's arrival counts) and lets the kernel after it start at once (launched plainly itself)."""
    xb = x.to(torch.bfloat16).contiguous()
    out = torch.empty_like(xb)
    groups = xb.numel() // 16
    n = max(groups, arrived.numel())
    with torch.cuda.device(x.device):
        launch(_kernel("pair_rows", x.device.index), ((n + 255) // 256, 1, 1), (256, 1, 1),
               [xb, out, groups, arrived, arrived.numel()])
    return out


def fused_moe_mma(x: torch.Tensor, planes: LayerPlanes, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  swiglu_limit: float | None, block: Mma) -> torch.Tensor:
    """[T, H] in x's dtype, for T > 0. Direct blocks with `sum_in_w2` sum each token's top-k slots in the
    w2 kernel (mma_moe.cu sum_when_last); other blocks leave [T, top_k, H] float32 per pair to moe_sum
    (sum_slots)."""
    T, H, I, E = x.shape[0], planes.hidden, planes.inter, planes.num_experts
    top_k = topk_ids.shape[1]
    P, dev = T * top_k, x.device
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    if block.direct:
        grid_x, sorted_pairs, block_expert = P, ids, ids  # the two are not read
    else:
        blocks = align_pairs(topk_ids, E, 8 * block.nt)
        grid_x, sorted_pairs, block_expert = blocks.max_blocks, blocks.sorted_pairs, blocks.block_expert
    ops = Operands.of(planes, topk_weights)
    fuse_sum = block.sum_in_w2 and x.dtype in _SUM_OUT
    arrived = torch.empty((T * (H // 16) if fuse_sum else 0,), dtype=torch.int32, device=dev)
    xin = paired_rows(x, arrived)  # the B registers' order (mma_moe.cu)
    act = torch.empty((P, I), dtype=torch.bfloat16, device=dev)
    out = torch.empty((P, H), dtype=torch.float32, device=dev)
    y = torch.empty((T, H), dtype=x.dtype, device=dev) if fuse_sum else out
    limit = 0.0 if swiglu_limit is None else float(swiglu_limit)
    with torch.cuda.device(dev):  # the compile loads into, and the launch uses, dev's context
        k13 = _kernel(kernel_name(block, 2, ops.e8m0[0], planes.layout), dev.index)
        launch(k13, (grid_x, I // 16, 1), (64 * block.ks13, 1, 1),
               [xin, ids, sorted_pairs, block_expert, *ops.layer_args(0), act, top_k, H, I, limit,
                int(swiglu_limit is not None), int(block.direct), act, arrived, -1],
               block.pdl)
        k2 = _kernel(kernel_name(block, 1, ops.e8m0[1], planes.layout), dev.index)
        launch(k2, (grid_x, H // 16, 1), (32 * block.ks2, 1, 1),
               [act, ids, sorted_pairs, block_expert, *ops.layer_args(1), out, top_k, I, H, 0.0, 0,
                int(block.direct), y, arrived, _SUM_OUT[x.dtype] if fuse_sum else -1],
               block.pdl)
    return y if fuse_sum else sum_slots(out.view(T, top_k, H), x.dtype, block.pdl)


@dataclass(frozen=True)
class DecodeExperts(Experts):
    """The decode tensor-core kernels with one block (`Mma`) as an Experts: CUDA sm_80+, any pair count, any
    layout, K a whole number of chunks per warp (`supported`)."""

    block: Mma
    devices = frozenset({"cuda"})

    def _unsupported(self, planes: LayerPlanes, x: torch.Tensor, pairs: int) -> str | None:
        if not supported(planes, x.device, self.block):
            return f"the decode kernels of {self.block} do not run hidden {planes.hidden}, width {planes.inter} here"
        return None

    def apply(self, x: torch.Tensor, planes: LayerPlanes, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              swiglu_limit: float | None) -> torch.Tensor:
        return fused_moe_mma(x, planes, topk_weights, topk_ids, swiglu_limit, self.block)
