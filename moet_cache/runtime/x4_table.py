"""The x4 base table's bit layout: a layer built with `--base-table x4` (every table a * X4_PATTERN, that is
+a, +4a, -a, -4a) is decoded on the GPU by bit arithmetic instead of a table lookup (docs/RUNTIME.md,
"The x4 base table"), once its base experts' planes have been repacked at load (`prepare`).

A base code is the FP4 code's sign s (high bit) and high exponent bit e1 (low bit). The kernels make
each bf16 pair of an mma A register from one 32-bit plane word: register r (0..7) holds the codes
j + 8h (low half) and j + 4 + 8h (high half), r = j + 4h, as the natural-order lookup does
(mma_moe.cu). Repacked, register r's e1 and s sit at bits 8 - r and 15 - r of the low half (24 - r and
31 - r of the high one), r = 7 at bits 0, 1 (16, 17); shifted by r they land on the bf16 exponent's bit 1
(x4) and the sign, and the block scale's bf16 bits added as an integer give s x {1, 4} x scale exactly
(mma_bits.cu x4_reg). The factor a rides in the fp32 epilogue with scale_2. Tier experts keep the
natural layout: their exact FP4 path reads the base and delta planes together.

Prepared tensors carry the repacked planes as `w13_base_x4` / `w2_base_x4` in place of `w13_base` /
`w2_base`, so a layout can never be mistaken for the other.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..planes import has_x4_form

#: the names of the base planes in the x4 layout (prepared tensors), by their natural-layout names
X4_NAMES = {"w13_base": "w13_base_x4", "w2_base": "w2_base_x4"}

#: experts repacked per torch call: bounds the temporaries (a V4-Flash w13 expert is 4 MiB of planes)
_EXPERTS_A_STEP = 16


@lru_cache(maxsize=None)
def bit_moves() -> tuple[tuple[int, int], ...]:
    """(natural bit, x4 bit) for the 32 bits of a plane word (code n: e1 at bit 2n, s at 2n + 1)."""
    moves = []
    for n in range(16):
        h, half, j = n >> 3, (n >> 2) & 1, n & 3
        r = j + 4 * h
        e1, s = (8 - r, 15 - r) if r < 7 else (0, 1)
        moves += [(2 * n, e1 + 16 * half), (2 * n + 1, s + 16 * half)]
    return tuple(moves)


@lru_cache(maxsize=None)
def _groups(inverse: bool) -> tuple[tuple[int, int], ...]:
    """(source mask, left shift) pairs: the bits that move by the same amount, moved by one op each."""
    by_shift: dict[int, int] = {}
    for src, dst in bit_moves():
        if inverse:
            src, dst = dst, src
        by_shift[dst - src] = by_shift.get(dst - src, 0) | (1 << src)
    return tuple(sorted((m, s) for s, m in by_shift.items()))


def _as_i32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


def _move_bits(words: torch.Tensor, inverse: bool) -> torch.Tensor:
    """int32 words -> int32 words with every bit moved (bit_moves, or back)."""
    out = torch.zeros_like(words)
    for mask, shift in _groups(inverse):
        part = words & _as_i32(mask)
        if shift >= 0:
            out |= part << shift
        else:  # int32 >> is arithmetic: mask again after the shift
            out |= (part >> -shift) & _as_i32(mask >> -shift)
    return out


def _relayout_gpu_(plane: torch.Tensor, experts: list[int], inverse: bool) -> None:
    """_relayout_ by one kernel (x4_repack.cu) on a CUDA plane: no temporaries, 22x the torch ops' speed."""
    from .mma_moe import compiled
    groups = _groups(inverse)
    dev = plane.device
    masks = torch.tensor([_as_i32(m) for m, _ in groups], dtype=torch.int32, device=dev)
    shifts = torch.tensor([s for _, s in groups], dtype=torch.int32, device=dev)
    idx = torch.tensor(experts, dtype=torch.int64, device=dev)
    words = plane.view(torch.int32)
    per_expert = words[0].numel()
    with torch.cuda.device(dev):
        compiled("x4_repack.cu", "x4_move_bits", dev.index)(
            grid=(min(1024, (per_expert + 255) // 256), len(experts), 1), block=(256, 1, 1),
            args=[words, idx, per_expert, masks, shifts, len(groups)])


def _relayout_(plane: torch.Tensor, experts: list[int], inverse: bool) -> None:
    """Move `experts`' rows of uint8 plane [E, rows, K/4] to (inverse: back from) the x4 layout, in place,
    a few experts' temporaries at a time (on a GPU the plane kernels run on: one kernel)."""
    from .mma_moe import runs_here
    if not experts:
        return
    if runs_here(plane.device) and plane.is_contiguous():
        _relayout_gpu_(plane, experts, inverse)
        return
    words = plane.view(torch.int32)
    for i in range(0, len(experts), _EXPERTS_A_STEP):
        idx = torch.tensor(experts[i : i + _EXPERTS_A_STEP], dtype=torch.long, device=plane.device)
        words[idx] = _move_bits(words[idx], inverse)


def base_experts(num_experts: int, delta_experts: torch.Tensor) -> list[int]:
    """The experts decoded from their tables: those not in the tier."""
    tier = set(delta_experts.tolist())
    return [e for e in range(num_experts) if e not in tier]


def _base_experts_of(tensors: dict[str, torch.Tensor]) -> list[int]:
    """base_experts of a layer's tensors (a layer loaded with delta="none" has no delta_experts)."""
    return base_experts(tensors["w13_base"].shape[0], tensors.get("delta_experts", torch.empty(0, dtype=torch.long)))


def to_x4(plane: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """uint8 plane [E, rows, K/4] with the rows of `experts` in the x4 layout (a copy)."""
    out = plane.contiguous().clone()
    _relayout_(out, experts, inverse=False)
    return out


def to_natural(plane: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """The inverse of to_x4 (a copy)."""
    out = plane.contiguous().clone()
    _relayout_(out, experts, inverse=True)
    return out


def is_x4(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether every base table of the layer has the x4 form (planes.has_x4_form, bit for bit)."""
    return all(has_x4_form(tensors[n].detach().float().cpu().numpy()) for n in ("w13_table", "w2_table"))


#: the largest e8m0 block-scale byte the x4 decode takes: 2^125, whose x4 is still a finite bf16
MAX_E8M0_BYTE = 252


def scales_fit(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether x4 stays inside bf16's exponent for every block scale (e4m3 tops out at 448)."""
    for name in ("w13_weight_scale", "w2_weight_scale"):
        s = tensors[name]
        if s.dtype == torch.float8_e8m0fnu and s.numel() and int(s.view(torch.uint8).max()) > MAX_E8M0_BYTE:
            return False
    return True


def kernels_take(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the plane kernels run this layer on its device at every decode block (launch.MMA_STEPS_X4):
    an x4 layer the Triton kernels would have to read put back on every call (slow, and not in a CUDA
    graph), so it is repacked only where they never do."""
    from .dequant import LayerPlanes
    from .launch import MMA_STEPS_X4
    from .mma_moe import supported
    planes = LayerPlanes.from_tensors(tensors)
    return all(supported(planes, planes.w13_base.device, block) for _, block in MMA_STEPS_X4)


def prepare_in_place(tensors: dict[str, torch.Tensor]) -> bool:
    """Repack the base experts' planes of a loaded layer in place when the x4 decode applies to it: every
    table has the x4 form, the plane kernels take the layer on its device and its block scales fit. The
    caller then hands the planes on under X4_NAMES (the vLLM method renames its parameters). Returns
    whether it did; planes already under X4_NAMES (a second call) are left as they are."""
    if "w13_base" not in tensors or not (is_x4(tensors) and scales_fit(tensors) and kernels_take(tensors)):
        return False
    experts = _base_experts_of(tensors)
    for natural in X4_NAMES:
        _relayout_(tensors[natural], experts, inverse=False)
    return True


def prepare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The layer's tensors with its base experts' planes in the x4 layout, named w13_base_x4 / w2_base_x4,
    when every table has the x4 form; else the tensors as given. A copy of the planes: for tests and
    benchmarks (the vLLM method repacks its parameters in place, `prepare_in_place`)."""
    if not (is_x4(tensors) and scales_fit(tensors)):
        return tensors
    experts = _base_experts_of(tensors)
    out = {k: v for k, v in tensors.items() if k not in X4_NAMES}
    for natural, x4 in X4_NAMES.items():
        out[x4] = to_x4(tensors[natural], experts)
    return out
