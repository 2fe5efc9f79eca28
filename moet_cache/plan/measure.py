"""A footprint measured: exact bytes from a committed cache's manifests, or computed bytes from a checkpoint's
config.json and safetensors headers (the same arithmetic the builder uses)."""

from __future__ import annotations

import os
from pathlib import Path

from ..cache import layout as L
from ..cache.cacheview import CacheView, open_view
from .drafter_vram import BLOCK_WKV, CONTEXT_WKV, DrafterWeights, layout_of
from ..errors import InputError
from ..format.families import PROJECTIONS, Family
from ..cache.manifest import CACHE_MANIFEST, COMMIT_RECORD, LayerKind
from ..format.modelconfig import ModelConfig
from .parallel import is_split
from ..units import parse_budget
from .attention import attention_from_config
from .footprint import Footprint

# The base-plane tensors tensor parallelism splits (codes and block scales); each expert's scalars and tables
# are copied to every rank.
SPLIT_BASE = frozenset((L.W13_BASE, L.W2_BASE, L.W13_SCALE, L.W2_SCALE))


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    from ..stwriter import TensorSpec
    return TensorSpec("", dtype, shape).nbytes


def _layer_of(name: str, family: Family | None = None) -> int | None:
    """The layer a tensor name belongs to (through the checkpoint's naming family when known)."""
    if family is not None:
        return family.layer_of(name)
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isascii() and parts[2].isdigit():
        return int(parts[2])
    return None


def expert_delta_bytes(m: ModelConfig) -> int:
    from ..cache.geometry import LayerGeometry
    return LayerGeometry(m.n_routed_experts, m.hidden_size, m.moe_intermediate_size).expert_delta_bytes


def _mtp_estimate(m: ModelConfig, dense_per_layer: int) -> int:
    """An MTP layer kept at FP4 (it is not planed): its routed experts plus a main layer's dense share."""
    E, H, I = m.n_routed_experts, m.hidden_size, m.moe_intermediate_size
    fp4 = E * 3 * H * I * 9 // 16    # codes (1/2 byte) + block scales (1/16 byte) per weight
    extra = H * 2 * H * 2            # eh_proj, bf16
    return m.num_nextn_predict_layers * (fp4 + extra + dense_per_layer)


def footprint_from_checkpoint(path: str | os.PathLike[str], delta_budget: str | None = None) -> Footprint:
    """Computed bytes of the cache a default build of this checkpoint would give (all main MoE layers).

    Each layer's base planes are counted in the block-scale form the build would store (Checkpoint.scale_forms:
    MXFP4 e8m0 by format; NVFP4 e8m0 only where every scale of the projection group allows it, which reads
    the NVFP4 scales; a scale that is not compact gives the e4m3 form)."""
    from ..source.checkpoint import open_checkpoint
    from ..cache.geometry import LayerGeometry
    from ..cache.tiering import DEFAULT_DELTA_BUDGET
    with open_checkpoint(path) as ck:
        m, fam = ck.model, ck.family
        served = [i for i in fam.moe_layers
                  if any(n in ck.tensors for n in ck.expert_names(i, 0, PROJECTIONS[0]).values())]
        if not served:
            raise InputError(f"{path} has no routed-expert tensors in its MoE layers")
        # V4's drafter blocks get planes too (a build with --include-drafter): counted base-only, apart.
        drafters = [i for i in fam.mtp_layers if fam.name == "deepseek_v4" and i not in served]
        planed = ck.expert_tensor_names(served + drafters)

        def base_of(layers: list[int]) -> tuple[int, int]:
            """The layers' base-plane bytes, and the part of them every tensor-parallel rank copies."""
            n = replicated = 0
            for i in layers:
                fmt = ck.layer_format(i)
                specs = LayerGeometry(m.n_routed_experts, m.hidden_size, m.moe_intermediate_size,
                                      *ck.scale_forms(i, fmt), ck.has_input_scales(i, fmt)).base_specs()
                n += sum(t.nbytes for t in specs)
                replicated += sum(t.nbytes for t in specs if t.name not in SPLIT_BASE)
            return n, replicated
        (base, base_replicated), (drafter_base, _) = base_of(served), base_of(drafters)
        dense = mtp_dense = wkv = dense_split = 0
        for name, info in ck.tensors.items():
            if name in planed:
                continue
            n = _nbytes(info.dtype, info.shape)
            layer = _layer_of(name, fam)
            if (layer is not None and fam.is_mtp(layer)) or CONTEXT_WKV.match(name):
                mtp_dense += n
                wkv += n if BLOCK_WKV.match(name) else 0
            else:
                dense += n
                dense_split += n if is_split(name) else 0
        cfg = dict(ck.config)
        source_format = ck.layer_format(served[0]).name
        names = list(ck.tensors)
    edb = expert_delta_bytes(m)
    total_experts = len(served) * m.n_routed_experts
    budget = parse_budget(delta_budget or DEFAULT_DELTA_BUDGET, total_experts * edb, what="delta budget")
    drafter = None
    if drafters:
        drafter = DrafterWeights(layout_of(names), len(drafters), drafter_base, 0, 0,
                                 len(drafters) * m.n_routed_experts, mtp_dense, wkv,
                                 any(CONTEXT_WKV.match(n) for n in names), True)
    mtp = drafter.stored if drafter is not None else mtp_dense
    fp = Footprint("checkpoint", str(path), False, base, 0, dense, edb, 0, total_experts, len(served), mtp,
                   mtp > 0, attention_from_config(cfg), cfg, source_format, base_replicated, dense_split,
                   drafter=drafter)
    return fp.with_tier(budget)


def is_cache(path: Path) -> bool:
    return (path / CACHE_MANIFEST).is_file() or (path / COMMIT_RECORD).is_file()


def footprint_from_cache(root: str | os.PathLike[str], delta_budget: str | None = None) -> Footprint:
    """Exact bytes from a committed cache's manifests (tensor byte ranges, the delta index)."""
    return footprint_of_view(open_view(root), delta_budget)


def footprint_of_view(cf: CacheView, delta_budget: str | None = None) -> Footprint:
    """Exact bytes from an opened cache: its layer manifests, delta index, dense parts and model config, each
    read through the view (a damaged one is refused, never counted)."""
    m, fam = cf.manifest.model.config, cf.manifest.model.family
    base = mtp_base = base_replicated = 0
    main_layers: list[int] = []
    for layer, lm in cf.layers.items():
        base_files = {f.path for f in lm.files if f.role == L.Role.BASE}
        n = sum(t.end - t.begin for t in lm.tensors if t.file in base_files)
        if lm.kind == LayerKind.MTP:
            mtp_base += n
        else:
            base += n
            base_replicated += sum(t.end - t.begin for t in lm.tensors
                                   if t.file in base_files and t.name not in SPLIT_BASE)
            main_layers.append(layer)
    edb = next((lm.expert_delta_bytes for lm in cf.layers.values()), expert_delta_bytes(m))
    total_experts = sum(cf.layers[i].n_experts for i in main_layers)
    drafter_layers = [i for i, lm in cf.layers.items() if lm.kind == LayerKind.MTP]
    index = cf.delta_index
    tier_layers = tuple((layer, tuple(ex)) for layer, ex in index.layers if layer in main_layers) if index else ()
    tier_experts = sum(len(ex) for _, ex in tier_layers)
    drafter_tier = sum(len(ex) for layer, ex in index.layers if layer in drafter_layers) if index else 0
    mid_layers = [(layer, ex) for layer, ex in (index.mid_layers or ()) if layer in main_layers] \
        if index is not None else []
    # the mid tier is resident weight, as the base planes
    base += sum(cf.layers[layer].geometry().expert_mid_bytes * len(ex) for layer, ex in mid_layers)
    emb = next((cf.layers[i].geometry().expert_mid_bytes for i in main_layers), 0)
    dense = mtp_dense = dense_split = wkv = 0
    names: list[str] = []
    for part in cf.dense_parts:
        for t in part.tensors:
            layer = _layer_of(t.name, fam)
            if (layer is not None and layer >= m.num_hidden_layers) or CONTEXT_WKV.match(t.name):
                mtp_dense += t.end - t.begin
                wkv += t.end - t.begin if BLOCK_WKV.match(t.name) else 0
                names.append(t.name)
            else:
                dense += t.end - t.begin
                dense_split += t.end - t.begin if is_split(t.name) else 0
    served = cf.served_config
    cfg = cf.manifest.model.to_dict() if served is None else served
    # MTP tensors are in the cache with --include-mtp (planes + the rest) or --lossless (all at FP4).
    mtp_exact = bool(mtp_dense)
    mtp = mtp_base + drafter_tier * edb + mtp_dense if mtp_exact else 0
    if not mtp_exact and m.num_nextn_predict_layers:
        mtp = _mtp_estimate(m, dense // max(1, m.num_hidden_layers))
    drafter = None
    if mtp_exact and fam is not None and fam.name == "deepseek_v4":
        blocks = len({_layer_of(n, fam) for n in names} - {None})
        drafter = DrafterWeights(layout_of(names), blocks, mtp_base, drafter_tier * edb, drafter_tier,
                                 sum(cf.layers[i].n_experts for i in drafter_layers), mtp_dense, wkv,
                                 any(CONTEXT_WKV.match(n) for n in names), bool(drafter_layers))
    fp = Footprint("cache", str(cf.root), True, base, tier_experts * edb, dense, edb, tier_experts,
                   total_experts, len(main_layers), mtp, mtp_exact, attention_from_config(cfg), cfg,
                   _source_format(cf, main_layers), base_replicated, dense_split, tier_layers, drafter=drafter,
                   mid_experts=sum(len(ex) for _, ex in mid_layers), expert_mid_bytes=emb)
    if delta_budget is not None:
        fp = fp.with_tier(parse_budget(delta_budget, total_experts * edb, what="delta budget"))
    return fp


def _source_format(cf: CacheView, main_layers: list[int]) -> str:
    """The first served main layer's expert format, or the source layout where its manifest names none."""
    return (cf.layers[main_layers[0]].source_format if main_layers else "") or str(cf.manifest.source_layout)


def read_footprint(path: str | os.PathLike[str], delta_budget: str | None = None) -> Footprint:
    """A cache's exact footprint, or a checkpoint's computed one (whichever the folder holds)."""
    p = Path(path)
    if not p.is_dir():
        raise InputError(f"{p} is not a folder", "give a cache folder or an NVFP4 checkpoint folder")
    if is_cache(p):
        return footprint_from_cache(p, delta_budget)
    return footprint_from_checkpoint(p, delta_budget)
