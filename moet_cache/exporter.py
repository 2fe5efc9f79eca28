"""Turn a lossless cache back into an NVFP4 checkpoint in the source's layout, tensor for tensor."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from . import layout as L
from .checkpoint import INDEX_NAME, LAYOUT_FORMAT, tensor_bytes
from .families import DeepseekV3, Family, family_from_dict
from .formats import FORMATS, ExpertFormat, source_scales
from .geometry import names_of
from .errors import InputError, VerificationError
from .fsutil import read_json_file, resolve_inside
from .manifest import PartManifest, load_record
from .planes import join_planes
from .progress import NullProgress, Progress
from .stwriter import SafetensorsWriter, TensorSpec
from .verifier import cache_read_errors, load_cache_files


@dataclass(frozen=True)
class ExportResult:
    out: str
    shards: int
    tensors: int
    bytes_written: int


def cache_family(cf: Any) -> Family:
    """The naming family a cache was built from (caches from before the record: the V3 family)."""
    model = cf.manifest.model
    n = model.get("num_hidden_layers", 0) if isinstance(model, dict) else 0
    fam = family_from_dict(model.get("family") if isinstance(model, dict) else None, n if isinstance(n, int) else 0)
    return fam or DeepseekV3("deepseek_v3", n if isinstance(n, int) else 0, (), ())


def layer_source_format(lm: Any, layout: str) -> ExpertFormat:
    """The expert format a layer was built from (recorded per layer; older caches: the layout's)."""
    return FORMATS.get(lm.source_format) or LAYOUT_FORMAT.get(layout) or LAYOUT_FORMAT["modelopt"]


def _parse_expert_name(name: str, fam: Family, cf: Any, layout: str) -> tuple[int, int, str, str] | None:
    """(layer, expert, projection, kind) for a routed-expert tensor name of a served layer."""
    parsed = fam.parse_expert(name)
    if parsed is None or parsed[0] not in cf.layers:
        return None
    layer, e, proj, suffix = parsed
    kinds = {sfx: kind for kind, sfx in layer_source_format(cf.layers[layer], layout).suffixes().items()}
    kind = kinds.get(suffix)
    return (layer, e, proj, kind) if kind else None


def _checked_name(name: Any) -> str:
    if not isinstance(name, str) or not name or "/" in name or name.startswith(".") or "\\" in name:
        raise InputError(f"the source map names an invalid shard {name!r}", "rebuild the cache")
    return name


def _shard_specs(shard: Any) -> list[TensorSpec]:
    """The tensors of one shard of the source map, checked (the map is as untrusted as any manifest)."""
    from .manifest import DTYPES, MAX_INT
    tensors = shard.get("tensors") if isinstance(shard, dict) else None
    meta = shard.get("metadata") if isinstance(shard, dict) else None
    ok = isinstance(tensors, list) and (meta is None or isinstance(meta, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()))
    specs = []
    for t in tensors if ok else ():
        if not (isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) and t[1] in DTYPES
                and isinstance(t[2], list) and len(t[2]) <= 8
                and all(type(x) is int and 0 <= x < MAX_INT for x in t[2])):
            ok = False
            break
        specs.append(TensorSpec(t[0], t[1], tuple(t[2])))
    if len({sp.name for sp in specs}) != len(specs):
        ok = False
    if not ok:
        raise InputError("the cache's source map is malformed", "run moet-cache verify --full; rebuild the cache")
    return specs


@cache_read_errors
def export_checkpoint(root: str | os.PathLike[str], out: str | os.PathLike[str],
                      progress: Progress | None = None) -> ExportResult:
    """Write the source's shards, index and aux files again from a --lossless cache."""
    root, out = Path(root), Path(out)
    progress = progress or NullProgress()
    cf = load_cache_files(root)
    if not cf.manifest.build.lossless:
        raise InputError("this cache keeps the delta planes of its tier only, so it cannot give back the source",
                         "build it with --lossless to be able to export")
    bad = next((f.path for f, _ in cf.files if not (root / f.path).is_file() or (root / f.path).stat().st_size != f.size), None)
    if bad is not None:  # a missing file is a damaged cache (exit 1), not an environment problem (exit 3)
        raise VerificationError(f"{bad} is missing or has the wrong size", "run moet-cache verify --full; rebuild the cache")
    if out.exists() and any(out.iterdir()):
        raise InputError(f"{out} exists and is not empty", "choose a new folder for the export")
    smap_fe = cf.manifest.file(L.ROLE_SOURCE_MAP)
    smap = read_json_file(resolve_inside(root, smap_fe.path))
    layout = cf.manifest.source_layout
    fam = cache_family(cf)
    dense_at: dict[str, str] = {}
    for f, _ in cf.files:
        if f.role == L.ROLE_PART and f.path.startswith(L.DENSE_DIR + "/"):
            part = load_record(resolve_inside(root, f.path), PartManifest.parse, f.path)
            dense_at.update({t.name: t.file for t in part.tensors})
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    n_tensors = written_bytes = 0
    shards = smap.get("shards") if isinstance(smap, dict) else None
    if not isinstance(shards, list):
        raise InputError("the cache's source map has no list of shards", "rebuild the cache")
    progress.start(sum(f.size for f, _ in cf.files if f.role in (L.ROLE_BASE, L.ROLE_DELTA_ALL, L.ROLE_DENSE)), "export")
    with ExitStack() as stack:
        handles: dict[str, Any] = {}

        def handle(rel: str) -> Any:
            if rel not in handles:
                handles[rel] = stack.enter_context(safe_open(str(resolve_inside(root, rel)), framework="pt"))
            return handles[rel]

        room = sum(f.size for f, _ in cf.files)  # an export gives back at most the bytes the cache holds
        for shard in shards:
            specs = _shard_specs(shard)
            room -= sum(sp.nbytes for sp in specs)
            if room < 0:
                raise InputError("the cache's source map lists more bytes than the cache holds", "rebuild the cache")
            name = _checked_name(shard.get("name"))
            with SafetensorsWriter(out / name, specs, shard.get("metadata")) as w:
                for spec in specs:
                    data = _tensor_bytes(spec.name, layout, cf, dense_at, handle, fam)
                    if data.nbytes != spec.nbytes:
                        raise VerificationError(f"the cache holds {data.nbytes} bytes for {spec.name}, its source map says "
                                                f"{spec.nbytes}", "run moet-cache verify --full; rebuild the cache")
                    w.write(spec.name, data)
                    weight_map[spec.name] = name
                    progress.advance(data.nbytes)
                written = w.commit()
            n_tensors += len(specs)
            written_bytes += written.size
    if len(shards) > 1 or shards and shards[0].get("name") != "model.safetensors":
        index = {"metadata": smap.get("index_metadata") or {}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=1))
    for f, _ in cf.files:
        if f.role == L.ROLE_AUX:
            dest = out / Path(f.path).relative_to(L.AUX_DIR)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(resolve_inside(root, f.path), dest)
    progress.finish()
    return ExportResult(str(out), len(shards), n_tensors, written_bytes)


def _tensor_bytes(name: str, layout: str, cf: Any, dense_at: dict[str, str], handle: Any, fam: Family) -> Any:
    """One source tensor's bytes, in the source's own format: a dense copy, or an expert tensor rebuilt
    from its planes (codes), its stored block scales (back to the source's form) or its source scalars."""
    if name in dense_at:
        return tensor_bytes(handle(dense_at[name]).get_tensor(name))
    parsed = _parse_expert_name(name, fam, cf, layout)
    if parsed is None:
        raise InputError(f"the cache does not hold {name}", "rebuild the cache with --lossless")
    layer, e, proj, kind = parsed
    lm = cf.layers[layer]
    base_rel = next(f.path for f in lm.files if f.role == L.ROLE_BASE)
    all_rel = next((f.path for f in lm.files if f.role == L.ROLE_DELTA_ALL), None)
    if all_rel is None:
        raise InputError(f"layer {layer} has no lossless delta planes", "rebuild the cache with --lossless")
    rows = lm.geometry().rows(proj)
    base_name, delta_name, scale_name = names_of(proj)
    if kind == "codes":
        base = tensor_bytes(handle(base_rel).get_slice(base_name)[e])[rows]
        delta = tensor_bytes(handle(all_rel).get_slice(delta_name)[e])[rows]
        return join_planes(base, delta)
    if kind == "block_scale":
        stored = tensor_bytes(handle(base_rel).get_slice(scale_name)[e])[rows]
        return source_scales(stored, lm.scale_form(scale_name), layer_source_format(lm, layout).scale_form)
    return tensor_bytes(handle(all_rel).get_slice(L.source_scalar(proj, kind))[e])
