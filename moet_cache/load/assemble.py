"""A served layer as it is handed out: the planes read by the engine, plus `delta_experts` and the
tier-shaped names every layer carries, or, with expand=True, stock NVFP4 fused-MoE tensors
(docs/LOADER.md, "Names"). Runs on the worker that read the layer (on its CUDA stream on a GPU).
"""

from __future__ import annotations

from typing import Any

import torch

from ..cache import layout as L
from ..enums import DeltaMode
from ..codec.expand import expand_projection, expand_scales
from ..cache.manifest import LayerManifest

DELTA_EXPERTS = "delta_experts"  # int64 [n]: which experts the w13_delta / w2_delta rows belong to
MID_EXPERTS = "mid_experts"      # int64 [m]: which experts the w13_mid / w2_mid rows (and mid tables) belong to
MID_NAMES = (L.W13_MID, L.W2_MID, L.W13_MID_TABLE, L.W2_MID_TABLE, MID_EXPERTS)  # the mid tier's tensors


def assemble_layer(lm: LayerManifest, t: dict[str, torch.Tensor], delta: DeltaMode, experts: tuple[int, ...],
                   expand: bool, stream: Any, mid: tuple[int, ...] | None = None) -> dict[str, torch.Tensor]:
    """Layer lm's tensors for delta mode `delta`; `experts`: the expert (in the loaded experts' numbering) of
    each delta row read (the plan's Job.delta_experts); `mid`: its mid-tier experts (None: the cache has no
    mid tier), handed out with delta "tier", every layer with the same names (empty where it has none);
    `stream`: the worker's CUDA stream the tensors were made on, None on the CPU path."""
    dev = t[L.W13_BASE].device
    if delta == DeltaMode.TIER:
        if not experts:  # the same names for every layer: empty delta planes, shaped as the base planes
            for name, base in ((L.W13_DELTA, L.W13_BASE), (L.W2_DELTA, L.W2_BASE)):
                t[name] = torch.empty((0, *t[base].shape[1:]), dtype=torch.uint8, device=dev)
    elif delta == DeltaMode.NONE:
        experts = ()
    if delta != DeltaMode.NONE:
        t[DELTA_EXPERTS] = torch.tensor(experts, dtype=torch.int64, device=dev)
    if delta == DeltaMode.TIER and mid is not None:
        if not mid:
            for spec in lm.geometry().mid_specs(0):
                t[spec.name] = torch.empty(spec.shape, dtype=torch.uint8 if spec.dtype == "U8" else torch.float32,
                                           device=dev)
        t[MID_EXPERTS] = torch.tensor(mid, dtype=torch.int64, device=dev)
    if expand:
        t = expand_layer(lm, t, experts, delta != DeltaMode.NONE)
    if stream is not None:  # made on the worker's stream, used on the consumer's
        for v in t.values():
            v.record_stream(torch.cuda.default_stream(dev))
    return t


def expand_layer(lm: LayerManifest, t: dict[str, torch.Tensor], experts: tuple[int, ...],
                 with_delta: bool) -> dict[str, torch.Tensor]:
    """Planes -> the stock fused-MoE names (w13_weight, w2_weight, scales), for `expand=True`."""
    I, H = lm.intermediate_size, lm.hidden_size
    # On a GPU the planes share one buffer with the scales: copy the scales out so it can go.
    # The mid tier has no stock NVFP4 form (its tables are not E2M1 values): its experts go out from their base.
    out = {k: (v.clone() if v.is_cuda else v) for k, v in t.items()
           if k not in (L.W13_BASE, L.W2_BASE, L.W13_DELTA, L.W2_DELTA, L.W13_TABLE, L.W2_TABLE, DELTA_EXPERTS,
                        *MID_NAMES)}
    tables13 = t[L.W13_TABLE].cpu().numpy()
    tables2 = t[L.W2_TABLE].cpu().numpy().reshape(lm.n_experts, 1, 4)
    rows13 = {e: t[L.W13_DELTA][k] for k, e in enumerate(experts)} if with_delta else {}
    rows2 = {e: t[L.W2_DELTA][k] for k, e in enumerate(experts)} if with_delta else {}
    out["w13_weight"] = expand_projection(t[L.W13_BASE], tables13, rows13, I)
    out["w2_weight"] = expand_projection(t[L.W2_BASE], tables2, rows2, H)
    for scale, scale_2, parts in ((L.W13_SCALE, L.W13_SCALE_2, 2), (L.W2_SCALE, L.W2_SCALE_2, 1)):
        if out[scale].dtype != torch.float8_e4m3fn:
            out[scale], out[scale_2] = expand_scales(out[scale], out[scale_2], parts)
    return out


__all__ = ["DELTA_EXPERTS", "MID_EXPERTS", "MID_NAMES", "assemble_layer", "expand_layer"]
