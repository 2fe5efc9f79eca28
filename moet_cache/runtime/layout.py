"""The layout a loaded layer's planes take for the plane kernels, once, at load. Both layouts are the same two
steps, bits moved in some rows (x4_table.relayout_rows_), then tiles (tiles.py); they differ in the rows:
- the x4 layout (x4_table.py), for a layer whose tables all have the x4 form and whose block scales fit its
  decode: every row of every plane;
- the tiled layout (tiles.py), for any other layer whose tier experts' scales fit the x4 tier decode: the
  tier experts' base rows and every delta row, so that the tier experts take the x4 tier decode while the
  base experts keep their natural bits and the table lookup.
Neither where the plane kernels do not take the layer (the Triton kernels and the CPU reference read the
natural layout). Each layout hands the tensors on under its own names (X4_NAMES, TILED_NAMES)."""

from __future__ import annotations

import torch

from . import tiles, x4_table
from .tiles import TILED_NAMES, plane_names, tile, tile_
from .x4_table import X4_NAMES


def moved_rows(t: torch.Tensor, delta: bool, experts: list[int], tier: set[int], x4: bool) -> list[int]:
    """The rows of t whose bits its layout moves: every row of a plane of an `x4` layer and of a `delta` plane
    (its rows are tier rows); of a tiled layer's base plane, the tier experts' rows (its rows are `experts`;
    `tier`: the tier experts); none of a block-scale tensor."""
    if t.dtype != torch.uint8:
        return []
    if x4 or delta:
        return list(range(t.shape[0]))
    return [k for k, e in enumerate(experts) if e in tier]


def to_layout(t: torch.Tensor, rows: list[int], delta: bool) -> torch.Tensor:
    """A plane [n, rows, K/4] (`delta`: a delta plane) or block-scale tensor in a layout (a copy): the bits of
    `rows` moved, then tiles."""
    out = t.contiguous().clone()
    _to_layout_(out, rows, delta)
    return out


def to_natural(t: torch.Tensor, rows: list[int], delta: bool) -> torch.Tensor:
    """to_layout's inverse (a copy): tiles undone, then the bits of `rows` moved back."""
    out = tile(t, inverse=True)
    x4_table.relayout_rows_(out, rows, delta, inverse=True)
    return out


def _to_layout_(t: torch.Tensor, rows: list[int], delta: bool) -> None:
    x4_table.relayout_rows_(t, rows, delta, inverse=False)
    tile_(t)


def _names(tensors: dict[str, torch.Tensor]) -> dict[str, str] | None:
    """The names of the layout a loaded layer takes (natural name -> the layout's), or None where neither fits
    (the planes do not split into tiles, or the tier experts' scales do not fit the x4 tier decode) or the
    tensors are already renamed."""
    if "w13_base" not in tensors or not (tiles.tiles_fit(tensors) and x4_table.tier_scales_fit(tensors)):
        return None
    return X4_NAMES if x4_table.is_x4(tensors) and x4_table.scales_fit(tensors) else TILED_NAMES


def _moved_rows_of(tensors: dict[str, torch.Tensor], name: str, names: dict[str, str]) -> list[int]:
    """moved_rows for a loaded layer's tensor `name` in the layout of `names`."""
    t = tensors[name]
    tier = set(tensors["delta_experts"].tolist()) if "delta_experts" in tensors else set()
    return moved_rows(t, name.endswith("_delta"), list(range(t.shape[0])), tier, names is X4_NAMES)


def prepare_in_place(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Move a loaded layer's planes and block scales into its layout, in place, where the plane kernels take
    the layer on its device (tiles.kernels_take). Returns the names the caller hands them on under (natural
    name -> the layout's: X4_NAMES or TILED_NAMES), or {} where nothing moved (no layout fits, the kernels
    do not take the layer, or its tensors are already renamed)."""
    names = _names(tensors)
    if names is None or not tiles.kernels_take(tensors):
        return {}
    for name, delta in plane_names(tensors).items():
        _to_layout_(tensors[name], _moved_rows_of(tensors, name, names), delta)
    return names


def prepare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The layer's tensors in its layout as copies, under the layout's names, whether or not the kernels run
    here (tests, benchmarks); the tensors as given where no layout fits."""
    names = _names(tensors)
    if names is None:
        return tensors
    planes = plane_names(tensors)
    out = {k: v for k, v in tensors.items() if k not in planes}
    for name, delta in planes.items():
        out[names[name]] = to_layout(tensors[name], _moved_rows_of(tensors, name, names), delta)
    return out
