"""The x4 base table's bit layouts: a layer built with `--base-table x4` (every table a * X4_PATTERN, that is
+a, +4a, -a, -4a) is decoded on the GPU by bit arithmetic instead of a table lookup (docs/RUNTIME.md,
"The x4 base table"), once its planes have been repacked at load (layout.py).

A base code is the FP4 code's sign s (high bit) and high exponent bit e1 (low bit). The kernels make
each bf16 pair of an mma A register from one 32-bit plane word: register r (0..7) holds the codes
j + 8h (low half) and j + 4 + 8h (high half), r = j + 4h, as the natural-order lookup does
(mma_moe.cu). Repacked, register r's e1 and s sit at bits 8 - r and 15 - r of the low half (24 - r and
31 - r of the high one), r = 7 at bits 0, 1 (16, 17); shifted by r they land on the bf16 exponent's bit 1
(x4) and the sign, and the block scale's bf16 bits added as an integer give s x {1, 4} x scale exactly
(mma_bits.cu x4_reg). The factor a rides in the fp32 epilogue with scale_2.

Every expert's base plane takes that layout, the tier experts' too: a tier expert's exact FP4 code is its
base code (s, e1) over its delta code (e0, m), and the delta plane is repacked as well (`delta_bit_moves`),
so that register r's e0 and m sit at bits 7 - 2k and 6 - 2k of the low half (23 - 2k, 22 - 2k of the high
one), k = r >> 1, of the word itself for even r and of the word shifted right by 8 for odd r. With the base
bits moved by r & 1, one OR puts s, e1, e0, m at bits 15 - 2k, 8 - 2k, 7 - 2k, 6 - 2k, and a shift by 2k
puts them on bf16's sign, the exponent's two low bits and the mantissa's top bit: the code's value
E2M1 x 2^-126, bf16 subnormals included (mma_bits.cu x4_tier_reg), which one bf16 multiply by the block
scale x 2^118 makes the weight x 2^-8 exactly (the 2^8 in the epilogue).

This module holds the bit facts and the bit moves (`relayout_rows_`); layout.py repacks a layer: every
row's bits moved, then every plane and block-scale tensor tiled chunk-major, as every layer the kernels
take is (tiles.py): the layout plane_layout.X4, whose tensors go under their own names (`w13_base_x4`, ...).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..codec.planes import has_x4_form
from .nvrtc import compiled, runs_here
from .tiles import EXPERTS_A_STEP


def _register(n: int) -> tuple[int, int]:
    """Code n of a word -> (its mma register r, the half it takes: 0 low, 1 high); see the module doc."""
    return (n & 3) + 4 * (n >> 3), (n >> 2) & 1


@lru_cache(maxsize=None)
def bit_moves() -> tuple[tuple[int, int], ...]:
    """(natural bit, x4 bit) for the 32 bits of a base-plane word (code n: e1 at bit 2n, s at 2n + 1)."""
    moves = []
    for n in range(16):
        r, half = _register(n)
        e1, s = (8 - r, 15 - r) if r < 7 else (0, 1)
        moves += [(2 * n, e1 + 16 * half), (2 * n + 1, s + 16 * half)]
    return tuple(moves)


@lru_cache(maxsize=None)
def delta_bit_moves() -> tuple[tuple[int, int], ...]:
    """(natural bit, x4 bit) for the 32 bits of a delta-plane word (code n: m at bit 2n, e0 at 2n + 1)."""
    moves = []
    for n in range(16):
        r, half = _register(n)
        m = 6 - 2 * (r >> 1) + 8 * (r & 1) + 16 * half
        moves += [(2 * n, m), (2 * n + 1, m + 1)]
    return tuple(moves)


@lru_cache(maxsize=None)
def _groups(delta: bool, inverse: bool) -> tuple[tuple[int, int], ...]:
    """(source mask, left shift) pairs: the bits that move by the same amount, moved by one op each."""
    by_shift: dict[int, int] = {}
    for src, dst in delta_bit_moves() if delta else bit_moves():
        if inverse:
            src, dst = dst, src
        by_shift[dst - src] = by_shift.get(dst - src, 0) | (1 << src)
    return tuple(sorted((m, s) for s, m in by_shift.items()))


def _as_i32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


def _move_bits(words: torch.Tensor, delta: bool, inverse: bool) -> torch.Tensor:
    """int32 words -> int32 words with every bit moved (bit_moves or delta_bit_moves, or back)."""
    out = torch.zeros_like(words)
    for mask, shift in _groups(delta, inverse):
        part = words & _as_i32(mask)
        if shift >= 0:
            out |= part << shift
        else:  # int32 >> is arithmetic: mask again after the shift
            out |= (part >> -shift) & _as_i32(mask >> -shift)
    return out


def _relayout_gpu_(plane: torch.Tensor, delta: bool, inverse: bool) -> None:
    """_relayout_ by one kernel (x4_repack.cu) on a CUDA plane: no temporaries, 22x the torch ops' speed."""
    groups = _groups(delta, inverse)
    dev = plane.device
    masks = torch.tensor([_as_i32(m) for m, _ in groups], dtype=torch.int32, device=dev)
    shifts = torch.tensor([s for _, s in groups], dtype=torch.int32, device=dev)
    words = plane.view(torch.int32)
    with torch.cuda.device(dev):
        compiled("x4_repack.cu", "x4_move_bits", dev.index)(
            grid=(min(4096, (words.numel() + 255) // 256), 1, 1), block=(256, 1, 1),
            args=[words, words.numel(), masks, shifts, len(groups)])


def _relayout_(plane: torch.Tensor, delta: bool, inverse: bool) -> None:
    """Move the bits of every word of uint8 plane [E, rows, K/4] (a base plane, or `delta` one) as the x4
    layout does (inverse: back), in place, a few experts' temporaries at a time (on a GPU the plane
    kernels run on: one kernel). The tiles are `tile`'s."""
    if not plane.numel():
        return
    if runs_here(plane.device) and plane.is_contiguous():
        _relayout_gpu_(plane, delta, inverse)
        return
    words = plane.view(torch.int32)
    for i in range(0, plane.shape[0], EXPERTS_A_STEP):
        words[i : i + EXPERTS_A_STEP] = _move_bits(words[i : i + EXPERTS_A_STEP], delta, inverse)


def is_x4(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether every base table of the layer has the x4 form (planes.has_x4_form, bit for bit)."""
    return all(has_x4_form(tensors[n].detach().float().cpu().numpy()) for n in ("w13_table", "w2_table"))


#: the largest e8m0 block-scale byte the x4 decode takes: 2^125, whose x4 is still a finite bf16
MAX_E8M0_BYTE = 252
#: the largest one of a tier expert: 2^9, whose x 2^118 (mma_bits.cu x4_tier_scale) is still a finite bf16
MAX_TIER_E8M0_BYTE = 136


def _e8m0_scales(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The layer's block-scale bytes where they are e8m0 (e4m3 tops out at 448: always inside)."""
    return [s.view(torch.uint8) for s in (tensors["w13_weight_scale"], tensors["w2_weight_scale"])
            if s.dtype == torch.float8_e8m0fnu and s.numel()]


def tier_scales_fit(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the x4 tier decode (x4_tier_reg: an x4 layer's tier experts, and a tiled one's, tiles.py) stays
    inside bf16's exponent for every tier expert's block scale."""
    tier = tensors.get("delta_experts")
    return tier is None or not tier.numel() or all(int(s[tier].max()) <= MAX_TIER_E8M0_BYTE
                                                   for s in _e8m0_scales(tensors))


def scales_fit(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the x4 decode stays inside bf16's exponent for every block scale, base and tier experts'."""
    return all(int(s.max()) <= MAX_E8M0_BYTE for s in _e8m0_scales(tensors)) and tier_scales_fit(tensors)


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Rows as runs of consecutive ones, [start, stop) each, ascending."""
    runs: list[list[int]] = []
    for r in sorted(set(rows)):
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    return [(a, b) for a, b in runs]


def relayout_rows_(plane: torch.Tensor, rows: list[int], delta: bool, inverse: bool) -> None:
    """Move the bits of rows `rows` (experts, or tier rows) of a plane [n, rows, K/4] (a base plane, or `delta`
    one) as the x4 layout does (inverse: back), in place: each run of consecutive rows at once (every row
    of an x4 layer's planes, one run; a fitted layer's tier experts, layout.py)."""
    for start, stop in _runs(rows):
        _relayout_(plane[start:stop], delta, inverse)
