"""The layout of a layer's planes and block scales, as a record (`PlaneLayout`): how its base bits are decoded
(the table form: a fitted table's lookup, or the x4 form's bit arithmetic, x4_table.py) and whether its
tensors are tiled chunk-major (tiles.py). Three layouts exist:
- NATURAL, as the cache stores them: every path reads it (the Triton kernels and the CPU reference no other);
- TILED, a fitted-table layer the plane kernels take: tiles, with the bits of the tier experts' base rows
  and of every delta row moved for the x4 tier decode;
- X4, a `--base-table x4` layer the plane kernels take: tiles, with every row's bits moved for the x4 decode.

In a dict of tensors (what `fused_moe` takes, vLLM's layer parameters) a layout's tensors go under its own
names (`PlaneLayout.names`: `w13_base_tiled`, `w13_base_x4`, ...), so that moved bits are never read as
another layout's; `PlaneLayout.of` reads the layout back from the names, and everything past that reads the
record. This module also moves one tensor into a layout and back (`to_layout`, `to_natural`); layout.py
picks a loaded layer's layout."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..enums import BaseTable
from ..errors import InputError
from . import x4_table
from .tiles import tile, tile_

#: the natural names of the tensors a layout moves: the planes (the delta ones only where the layer has a
#: tier) and the block scales
PLANE_TENSORS = ("w13_base", "w2_base", "w13_delta", "w2_delta", "w13_weight_scale", "w2_weight_scale")


@dataclass(frozen=True)
class PlaneLayout:
    """How a layer's planes and block scales are laid out: `table` the base decode their bits are arranged
    for (FITTED: the natural bits, through the table; X4: moved for the x4 decode), `tiled` whether each
    16-row tile is stored chunk-major. The x4 decode reads tiles only."""

    table: BaseTable = BaseTable.FITTED
    tiled: bool = False

    def __post_init__(self) -> None:
        if self.table == BaseTable.X4 and not self.tiled:
            raise ValueError("the x4 layout is tiled")

    @property
    def x4(self) -> bool:
        return self.table == BaseTable.X4

    @property
    def natural(self) -> bool:
        return not self.tiled

    @property
    def names(self) -> dict[str, str]:
        """The names its tensors go under, by their natural names (the natural layout: the same names)."""
        suffix = "_x4" if self.x4 else "_tiled" if self.tiled else ""
        return {n: n + suffix for n in PLANE_TENSORS}

    @classmethod
    def of(cls, tensors: Mapping[str, object]) -> PlaneLayout:
        """The layout a dict of a layer's tensors is in, read from its base plane's name."""
        found = [layout for layout in LAYOUTS if layout.names["w13_base"] in tensors]
        if len(found) > 1:
            raise InputError(f"the layer's tensors hold the base planes of {len(found)} layouts",
                             "pass what Cache.load(..., expand=False) yields, or what layout.prepare made of it")
        return found[0] if found else NATURAL


NATURAL = PlaneLayout()
TILED = PlaneLayout(BaseTable.FITTED, tiled=True)
X4 = PlaneLayout(BaseTable.X4, tiled=True)
LAYOUTS = (NATURAL, TILED, X4)


def plane_tensors(tensors: Mapping[str, object]) -> dict[str, bool]:
    """The natural names of the layer's tensors that a layout moves -> whether each is a delta plane (a layer
    loaded with delta="none" has none)."""
    return {n: n.endswith("_delta") for n in PLANE_TENSORS if n in tensors}


def moved_rows(t: torch.Tensor, delta: bool, experts: list[int], tier: set[int], layout: PlaneLayout) -> list[int]:
    """The rows of t whose bits `layout` moves: every row of a plane of an X4 layer and of a `delta` plane
    of a tiled one (its rows are tier rows); of a TILED layer's base plane, the tier experts' rows (its rows
    are `experts`; `tier`: the tier experts); none of a block-scale tensor, nor of the natural layout."""
    if t.dtype != torch.uint8 or not layout.tiled:
        return []
    if layout.x4 or delta:
        return list(range(t.shape[0]))
    return [k for k, e in enumerate(experts) if e in tier]


def to_layout(t: torch.Tensor, rows: list[int], delta: bool) -> torch.Tensor:
    """A plane [n, rows, K/4] (`delta`: a delta plane) or block-scale tensor in a tiled layout (a copy): the
    bits of `rows` moved, then tiles."""
    out = t.contiguous().clone()
    to_layout_(out, rows, delta)
    return out


def to_layout_(t: torch.Tensor, rows: list[int], delta: bool) -> None:
    """to_layout in place."""
    x4_table.relayout_rows_(t, rows, delta, inverse=False)
    tile_(t)


def to_natural(t: torch.Tensor, rows: list[int], delta: bool) -> torch.Tensor:
    """to_layout's inverse (a copy): tiles undone, then the bits of `rows` moved back."""
    out = tile(t, inverse=True)
    x4_table.relayout_rows_(out, rows, delta, inverse=True)
    return out
