"""The layout a loaded layer's planes take for the plane kernels, once, at load: the x4 layout (x4_table.py:
every plane's bits moved, and tiles) for a layer whose tables all have the x4 form and whose scales fit
it; else the tiled layout (tiles.py: tiles, and the x4 tier decode's bits in the tier experts' base rows
and the delta planes) where the tier experts' scales fit that decode; and neither where the plane kernels
do not take the layer (the Triton kernels and the CPU reference read the natural layout). Each layout
hands the tensors on under its own names."""

from __future__ import annotations

import torch

from . import tiles, x4_table
from .tiles import TILED_NAMES, plane_names, tile, tile_


def x4_rows_of(t: torch.Tensor, delta: bool, experts: list[int], tier: set[int]) -> list[int]:
    """The rows of t whose bits the tiled layout moves: every row of a `delta` plane (its rows are tier rows),
    the tier experts' rows of a base plane (its rows are `experts`; `tier`: the tier experts), none of a
    block-scale tensor."""
    if t.dtype != torch.uint8:
        return []
    return list(range(t.shape[0])) if delta else [k for k, e in enumerate(experts) if e in tier]


def _x4_rows(tensors: dict[str, torch.Tensor], name: str) -> list[int]:
    """x4_rows_of for a loaded layer's tensor `name`."""
    t = tensors[name]
    tier = set(tensors["delta_experts"].tolist()) if "delta_experts" in tensors else set()
    return x4_rows_of(t, name.endswith("_delta"), list(range(t.shape[0])), tier)


def untiled(t: torch.Tensor, rows: list[int], delta: bool) -> torch.Tensor:
    """A tensor of the tiled layout put back in the natural one (a copy): tiles undone, then the bits of
    `rows` moved back."""
    out = tile(t, inverse=True)
    x4_table.relayout_rows_(out, rows, delta, inverse=True)
    return out


def _to_tiled_(tensors: dict[str, torch.Tensor], name: str, t: torch.Tensor, delta: bool) -> None:
    """t, the layer's tensor `name` or a copy of it, into the tiled layout in place: the bits of its x4 rows
    moved, then tiles (`untiled`'s inverse)."""
    x4_table.relayout_rows_(t, _x4_rows(tensors, name), delta, inverse=False)
    tile_(t)


def _tiled_fits(tensors: dict[str, torch.Tensor]) -> bool:
    return tiles.tiles_fit(tensors) and x4_table.tier_scales_fit(tensors)


def prepare_in_place(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Move a loaded layer's planes and block scales into its layout, in place. Returns the names the caller
    hands them on under (natural name -> the layout's: x4_table.X4_NAMES or tiles.TILED_NAMES), or {} where
    nothing moved (the kernels do not take the layer, or its tensors are already renamed)."""
    if x4_table.prepare_in_place(tensors):
        return x4_table.X4_NAMES
    if "w13_base" not in tensors or not (_tiled_fits(tensors) and tiles.kernels_take(tensors)):
        return {}
    for name, delta in plane_names(tensors).items():
        _to_tiled_(tensors, name, tensors[name], delta)
    return TILED_NAMES


def prepare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The layer's tensors in its layout as copies, under the layout's names, whether or not the kernels run
    here (tests, benchmarks); the tensors as given where neither layout fits."""
    x4 = x4_table.prepare(tensors)
    if x4 is not tensors or not _tiled_fits(tensors):
        return x4
    planes = plane_names(tensors)
    out = {k: v for k, v in tensors.items() if k not in planes}
    for name, delta in planes.items():
        t = tensors[name].contiguous().clone()
        _to_tiled_(tensors, name, t, delta)
        out[TILED_NAMES[name]] = t
    return out
