"""The layout a loaded layer's planes take, once, at load (plane_layout.py names the three):
- X4, for a layer whose tables all have the x4 form and whose block scales fit its decode;
- TILED, for any other layer whose tier experts' scales fit the x4 tier decode;
- NATURAL (nothing moved) where neither fits, and wherever the plane kernels do not take the layer (the
  Triton kernels and the CPU reference read the natural layout).
Each layout hands the tensors on under its own names (PlaneLayout.names)."""

from __future__ import annotations

import torch

from . import tiles, x4_table
from .dequant import LayerPlanes
from .launch import config_for
from .mma_moe import supported
from .plane_layout import NATURAL, TILED, X4, PlaneLayout, moved_rows, plane_tensors, to_layout, to_layout_


def kernels_take(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the plane kernels run this layer on its device at every decode block of every layer form
    (launch.config_for(device).decode_blocks): a tiled layer the Triton kernels would have to read put back
    on every call (slow, and not in a CUDA graph), so a layer is tiled only where they never do."""
    planes = LayerPlanes.from_tensors(tensors)
    device = planes.w13_base.device
    # a layer with mid-tier experts goes to the Triton kernels (the plane kernels do not decode them)
    return not planes.has_mid and all(supported(planes, device, block) for block in config_for(device).decode_blocks())


def layout_for(tensors: dict[str, torch.Tensor]) -> PlaneLayout:
    """The layout a loaded layer in the natural layout takes where the kernels take it: NATURAL where the
    planes do not split into tiles or the tier experts' scales do not fit the x4 tier decode, and where the
    tensors are already in another layout (renamed)."""
    if "w13_base" not in tensors or not (tiles.tiles_fit(tensors) and x4_table.tier_scales_fit(tensors)):
        return NATURAL
    return X4 if x4_table.is_x4(tensors) and x4_table.scales_fit(tensors) else TILED


def _moved_rows_of(tensors: dict[str, torch.Tensor], name: str, layout: PlaneLayout) -> list[int]:
    """moved_rows for a loaded layer's tensor `name` in `layout`."""
    t = tensors[name]
    tier = set(tensors["delta_experts"].tolist()) if "delta_experts" in tensors else set()
    return moved_rows(t, name.endswith("_delta"), list(range(t.shape[0])), tier, layout)


def prepare_in_place(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Move a loaded layer's planes and block scales into its layout, in place, where the plane kernels take
    the layer on its device (kernels_take). Returns the names the caller hands them on under (natural
    name -> the layout's: PlaneLayout.names), or {} where nothing moved (the natural layout, the kernels
    do not take the layer, or its tensors are already in another layout)."""
    layout = layout_for(tensors)
    if layout == NATURAL or not kernels_take(tensors):
        return {}
    for name, delta in plane_tensors(tensors).items():
        to_layout_(tensors[name], _moved_rows_of(tensors, name, layout), delta)
    return layout.names


def prepare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The layer's tensors in its layout as copies, under the layout's names, whether or not the kernels run
    here (tests, benchmarks); the tensors as given where the layout is the natural one."""
    layout = layout_for(tensors)
    if layout == NATURAL:
        return tensors
    planes = plane_tensors(tensors)
    out = {k: v for k, v in tensors.items() if k not in planes}
    for name, delta in planes.items():
        out[layout.names[name]] = to_layout(tensors[name], _moved_rows_of(tensors, name, layout), delta)
    return out
