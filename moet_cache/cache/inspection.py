"""What a cache holds, per layer and in total, from its manifests alone (no tensor data read)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from . import layout as L
from .cacheview import CacheView, open_view
from ..format.families import Family
from .manifest import BuildParams, LayerKind
from .quality_curve import TierKl, packaged_curve, tier_kl


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
    rel_error_served: float     # mean with the tier's experts at full FP4 (error 0), the mid tier's at 3 bits
    source_format: str = ""     # the source's expert format (formats.FORMATS)
    scale_form: str = ""        # the block-scale forms, w13/w2 (e4m3-16 or e8m0-32)
    base_bytes_per_weight: float = 0.0
    mid_experts: int = 0        # the mid tier's experts (3 bits a weight)
    mid_bytes: int = 0          # their mid planes and tables


@dataclass(frozen=True)
class DrafterInfo:
    """The speculative-decoding drafter a cache holds: its blocks' planes, dense tensors and tier share."""

    layout: str                 # families.DRAFTER_LAYOUTS: dspark (one head stack) or mtp
    blocks: tuple[str, ...]     # the source's names of its blocks (mtp.0, ...)
    layers: tuple[int, ...]     # their cache layer numbers
    base_bytes: int             # the blocks' base-plane files
    dense_bytes: int            # its dense tensors in the dense shards (attention, norms, shared experts, heads)
    tier_bytes: int             # its experts' delta planes in the tier
    tier_experts: int


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
    delta_tier_bytes: int   # the tier's delta planes, as the budget counts them (the pack file adds its header)
    delta_all_bytes: int
    dense_bytes: int
    total_bytes: int
    tier_experts: int
    total_experts: int
    family: str = ""
    served_blocks: str = ""     # how the served layers relate to the model's blocks (main, drafters)
    reference_kl: TierKl | None = None  # the quality ladder's reference model at the main layers' tier mix
    drafter: DrafterInfo | None = None  # None when the cache serves no drafter block
    mid_tier_bytes: int = 0     # the mid tier's planes and tables, as --mid-budget counts them
    mid_experts: int = 0


def inspect_cache(root: str | os.PathLike[str]) -> CacheInfo:
    """Summarise a committed cache; raises ManifestError when it is incomplete or damaged (a listed file that
    does not match its digest, the delta index included, is never trusted)."""
    return inspect_view(open_view(root))


def inspect_view(cf: CacheView) -> CacheInfo:
    """Summarise an opened cache (the view a boot check read: `moet-cache inspect` checks the files first)."""
    root = cf.root
    m = cf.manifest
    infos = []
    for layer, lm in sorted(cf.layers.items()):
        rel = [math.sqrt(e / w) if w > 0 else 0.0 for e, w in zip(lm.sq_error, lm.energy)]
        tier, mid = set(cf.tier_experts(layer)), set(cf.mid_experts(layer))
        mid_rel = [math.sqrt(e / w) if w > 0 else 0.0 for e, w in zip(lm.mid_sq_error, lm.energy)]
        served = [0.0 if e in tier else mid_rel[e] if e in mid and mid_rel else r for e, r in enumerate(rel)]
        worst = max(range(len(rel)), key=rel.__getitem__)
        geo = lm.geometry()
        base = sum(f.size for f in lm.files if f.role == L.Role.BASE)
        infos.append(LayerInfo(
            layer, lm.kind, lm.n_experts, base,
            len(tier), len(tier) * lm.expert_delta_bytes, sum(rel) / len(rel), rel[worst], worst,
            sum(served) / len(rel), lm.source_format or m.source_layout, f"{geo.w13_form}/{geo.w2_form}",
            base / geo.weights, len(mid), len(mid) * geo.expert_mid_bytes))
    fam = cf.family
    main = [i for i in infos if i.kind != LayerKind.MTP]
    ref_kl = tier_kl(packaged_curve(), sum(i.delta_experts for i in main), sum(i.experts for i in main),
                     main[0].source_format, sum(i.mid_experts for i in main)) if main else None
    return CacheInfo(
        str(root), m.source_path, m.source_layout, m.tool_version, m.created, m.build, tuple(infos),
        cf.bytes_of(L.Role.BASE), sum(i.delta_bytes for i in infos), cf.bytes_of(L.Role.DELTA_ALL),
        cf.bytes_of(L.Role.DENSE), cf.bytes_of(), sum(i.delta_experts for i in infos), sum(i.experts for i in infos),
        fam.name, served_blocks(fam, m.build.layers), ref_kl, drafter_of(cf, infos),
        sum(i.mid_bytes for i in infos), sum(i.mid_experts for i in infos))


def drafter_of(cf: CacheView, infos: list[LayerInfo]) -> DrafterInfo | None:
    """The drafter's share of the cache, from the layer manifests and the dense shards' part records."""
    fam = cf.family
    mine = [i for i in infos if fam.is_mtp(i.layer)]
    if not mine:
        return None
    layers = {i.layer for i in mine}
    tensors = [t for part in cf.dense_parts for t in part.tensors if fam.layer_of(t.name) in layers]
    return DrafterInfo(fam.drafter_layout(t.name for t in tensors),
                       tuple(fam.layer_prefix(i.layer) for i in mine), tuple(sorted(layers)),
                       sum(i.base_bytes for i in mine), sum(t.end - t.begin for t in tensors),
                       sum(i.delta_bytes for i in mine), sum(i.delta_experts for i in mine))


def served_blocks(fam: Family, served: tuple[int, ...]) -> str:
    """One line: how the served layers relate to the model's expert-bearing blocks.

    DeepSeek-V4-Flash has 43 main layers and drafter (MTP) blocks mtp.K = cache layer 43 + K. vLLM loads the
    main model without mtp.* and the drafter as its own model, num_nextn_predict_layers blocks from mtp.0
    (vllm/models/deepseek_v4 mtp: layers num_hidden_layers .. + num_nextn_predict_layers): V4-Flash built with
    --include-drafter serves 44 layers, the 43 main ones and mtp.0.
    """
    main = [x for x in served if not fam.is_mtp(x)]
    mtp = [x for x in served if fam.is_mtp(x)]
    n = fam.num_hidden_layers
    text = f"{len(main)} main MoE layer{'s' if len(main) != 1 else ''}"
    if mtp:
        names = ", ".join(f"mtp.{x - n}" if fam.name == "deepseek_v4" else f"layer {x}" for x in mtp)
        text += f" + {len(mtp)} drafter block{'s' if len(mtp) != 1 else ''} ({names}) = {len(served)} served layers"
    else:
        have = len(fam.mtp_layers)
        text += (f"; the {have} drafter block{'s' if have != 1 else ''} of the source "
                 "not served (add --include-drafter for speculative decoding)") if have else ""
    return text
