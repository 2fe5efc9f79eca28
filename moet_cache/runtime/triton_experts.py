"""The Triton kernels (triton_moe.py) as an Experts: the path where the plane kernels do not run (no sm_80,
dims that do not split into their chunks), on CUDA, or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1, set before Triton is first imported). They read the natural layout only: a tiled layer
is put back on every call (layout.py tiles a layer only where the plane kernels always take it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .align import align_pairs
from .dequant import LayerPlanes
from .experts import Experts
from .plane_layout import NATURAL


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


def _fit(n: int, want: int) -> int:
    """The largest power of two <= want that divides n."""
    b = want
    while b > 1 and n % b:
        b //= 2
    return b


def _words(t: torch.Tensor) -> torch.Tensor:
    """uint8 plane [..., n/4] as int32 words [..., n/16] (16 codes a word, same bytes)."""
    return t.contiguous().view(torch.int32)


def _mid_args(planes: LayerPlanes, E: int, like: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The kernels' mid-tier arguments: expert -> mid row (-1: none), the mid planes as int16 words (16 bits for
    the 16 codes of a base word) and the tables; without a mid tier, stand-ins the kernels never decode from
    (the tables are read before the branch: 16 zeros)."""
    dev = like.device
    mids = torch.full((E,), -1, dtype=torch.int32, device=dev)
    if not planes.has_mid:
        words = torch.zeros((1, 1, 1), dtype=torch.int16, device=dev)
        zeros = torch.zeros(16, dtype=torch.float32, device=dev)
        return mids, (words, words, zeros, zeros)
    m = planes.mid
    mids[m.mid_experts] = torch.arange(m.mid_experts.numel(), dtype=torch.int32, device=dev)
    return mids, (m.w13_mid.contiguous().view(torch.int16), m.w2_mid.contiguous().view(torch.int16),
                  m.w13_mid_table.contiguous(), m.w2_mid_table.contiguous())


@dataclass(frozen=True)
class TritonExperts(Experts):
    """The Triton kernels with one block: the pairs kernels (`Pairs`, decode) or the grouped ones (`Grouped`,
    prefill). Hidden size and width multiples of 16."""

    block: Pairs | Grouped
    devices = frozenset({"cuda", "cpu"})
    layouts = frozenset({NATURAL})
    decodes_mid = True

    def _unsupported(self, planes: LayerPlanes, x: torch.Tensor, pairs: int) -> str | None:
        if planes.hidden % 16 or planes.inter % 16:
            return f"hidden {planes.hidden} and intermediate {planes.inter} must be multiples of 16"
        return None

    def apply(self, x: torch.Tensor, planes: LayerPlanes, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              swiglu_limit: float | None) -> torch.Tensor:
        from . import triton_moe as k  # triton is optional: only where its kernels run

        T, H, I, E = x.shape[0], planes.hidden, planes.inter, planes.num_experts
        top_k = topk_ids.shape[1]
        P, dev, c = T * top_k, x.device, self.block
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
        mids, (m13, m2, mt13, mt2) = _mid_args(planes, E, b13)
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
                mids, m13, mt13, m13.stride(0), m13.stride(1),
                GROUP=g13, E8M0=e8_13, HAS_LIMIT=swiglu_limit is not None, BN=bn13, BKW=bkw13,
                num_warps=c.warps)
            bn2, bkw2 = _fit(H, c.bn), _fit(I // 16, c.bkw)
            k.w2_pairs_kernel[(P, H // bn2)](
                act, ids, wts, tier, b2, d2, s2, s2_2, t2, out, H, I,
                b2.stride(0), b2.stride(1), s2.stride(0), s2.stride(1),
                mids, m2, mt2, m2.stride(0), m2.stride(1),
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
                mids, m13, mt13, m13.stride(0), m13.stride(1),
                GROUP=g13, E8M0=e8_13, HAS_LIMIT=swiglu_limit is not None, BM=c.bm, BN=bn13, BKW=bkw13,
                BKW2=bkw2, DOT_F32=not x.is_cuda, V2=c.v2, num_warps=c.warps, num_stages=c.stages)
            k.w2_grouped_kernel[(blocks.max_blocks, H // bn2)](
                act, blocks.sorted_pairs, blocks.block_expert, wts, tier, b2, d2, s2, s2_2, t2, out, H, I,
                b2.stride(0), b2.stride(1), s2.stride(0), s2.stride(1),
                mids, m2, mt2, m2.stride(0), m2.stride(1),
                GROUP=g2, E8M0=e8_2, BM=c.bm, BN=bn2, BKW=bkw2, DOT_F32=not x.is_cuda, V2=c.v2,
                num_warps=c.warps, num_stages=c.stages)
        return out.view(T, top_k, H).sum(1).to(x.dtype)
