"""What a cache holds, per layer and in total, from its manifests alone (no tensor data read)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from . import layout as L
from .manifest import BuildParams, DeltaIndex, loads_record
from .verifier import load_cache_files


@dataclass(frozen=True)
class LayerInfo:
    layer: int
    kind: str
    experts: int
    base_bytes: int
    delta_experts: int
    delta_bytes: int
    rel_error_mean: float       # base-only relative error sqrt(sum err^2 / sum w^2), mean over experts
    rel_error_worst: float
    worst_expert: int
    rel_error_served: float     # mean with the tier's experts at full FP4 (error 0)


@dataclass(frozen=True)
class CacheInfo:
    path: str
    source_path: str
    source_layout: str
    tool_version: str
    created: str
    build: BuildParams
    layers: tuple[LayerInfo, ...]
    base_bytes: int
    delta_tier_bytes: int
    delta_all_bytes: int
    dense_bytes: int
    total_bytes: int
    tier_experts: int
    total_experts: int


def inspect_cache(root: str | os.PathLike[str]) -> CacheInfo:
    """Summarise a committed cache; raises ManifestError when it is incomplete or damaged."""
    root = Path(root)
    cf = load_cache_files(root)
    m = cf.manifest
    idx_fe = m.file(L.ROLE_DELTA_INDEX)
    index = DeltaIndex.parse(loads_record((root / idx_fe.path).read_bytes(), idx_fe.path), idx_fe.path) if idx_fe else None
    infos = []
    for layer, lm in sorted(cf.layers.items()):
        rel = [math.sqrt(e / w) if w > 0 else 0.0 for e, w in zip(lm.sq_error, lm.energy)]
        tier = set(index.experts_of(layer) or ()) if index else set()
        worst = max(range(len(rel)), key=rel.__getitem__)
        infos.append(LayerInfo(
            layer, lm.kind, lm.n_experts, sum(f.size for f in lm.files if f.role == L.ROLE_BASE),
            len(tier), len(tier) * lm.expert_delta_bytes, sum(rel) / len(rel), rel[worst], worst,
            sum(r for e, r in enumerate(rel) if e not in tier) / len(rel)))
    sizes = {role: sum(f.size for f, _ in cf.files if f.role == role)
             for role in (L.ROLE_BASE, L.ROLE_PACK, L.ROLE_DELTA_ALL, L.ROLE_DENSE)}
    return CacheInfo(
        str(root), m.source_path, m.source_layout, m.tool_version, m.created, m.build, tuple(infos),
        sizes[L.ROLE_BASE], sizes[L.ROLE_PACK], sizes[L.ROLE_DELTA_ALL], sizes[L.ROLE_DENSE],
        sum(f.size for f, _ in cf.files), sum(i.delta_experts for i in infos), sum(i.experts for i in infos))
