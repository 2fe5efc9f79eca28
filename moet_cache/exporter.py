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
from .checkpoint import INDEX_NAME, PROJECTIONS, TENSOR_SUFFIXES, tensor_bytes
from .errors import InputError
from .fsutil import read_json_file, resolve_inside
from .manifest import PartManifest, load_record
from .planes import join_planes
from .progress import NullProgress, Progress
from .stwriter import SafetensorsWriter, TensorSpec
from .verifier import load_cache_files


@dataclass(frozen=True)
class ExportResult:
    out: str
    shards: int
    tensors: int
    bytes_written: int


def _parse_expert_name(name: str, layout: str) -> tuple[int, int, str, str] | None:
    """(layer, expert, projection, kind) for a routed-expert tensor name."""
    parts = name.split(".")
    if len(parts) != 8 or parts[:2] != ["model", "layers"] or parts[3:5] != ["mlp", "experts"] \
            or not parts[2].isdigit() or not parts[5].isdigit() or parts[6] not in PROJECTIONS:
        return None
    kinds = {suffix: kind for kind, suffix in TENSOR_SUFFIXES[layout].items()}
    kind = kinds.get(parts[7])
    return (int(parts[2]), int(parts[5]), parts[6], kind) if kind else None


def _checked_name(name: Any) -> str:
    if not isinstance(name, str) or not name or "/" in name or name.startswith(".") or "\\" in name:
        raise InputError(f"the source map names an invalid shard {name!r}", "rebuild the cache")
    return name


def export_checkpoint(root: str | os.PathLike[str], out: str | os.PathLike[str],
                      progress: Progress | None = None) -> ExportResult:
    """Write the source's shards, index and aux files again from a --lossless cache."""
    root, out = Path(root), Path(out)
    progress = progress or NullProgress()
    cf = load_cache_files(root)
    if not cf.manifest.build.lossless:
        raise InputError("this cache keeps the delta planes of its tier only, so it cannot give back the source",
                         "build it with --lossless to be able to export")
    if out.exists() and any(out.iterdir()):
        raise InputError(f"{out} exists and is not empty", "choose a new folder for the export")
    smap_fe = cf.manifest.file(L.ROLE_SOURCE_MAP)
    smap = read_json_file(resolve_inside(root, smap_fe.path))
    layout = cf.manifest.source_layout
    dense_at: dict[str, str] = {}
    for f, _ in cf.files:
        if f.role == L.ROLE_PART and f.path.startswith(L.DENSE_DIR + "/"):
            part = load_record(resolve_inside(root, f.path), PartManifest.parse, f.path)
            dense_at.update({t.name: t.file for t in part.tensors})
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    n_tensors = written_bytes = 0
    shards = smap.get("shards", [])
    progress.start(sum(f.size for f, _ in cf.files if f.role in (L.ROLE_BASE, L.ROLE_DELTA_ALL, L.ROLE_DENSE)), "export")
    with ExitStack() as stack:
        handles: dict[str, Any] = {}

        def handle(rel: str) -> Any:
            if rel not in handles:
                handles[rel] = stack.enter_context(safe_open(str(resolve_inside(root, rel)), framework="pt"))
            return handles[rel]

        for shard in shards:
            name = _checked_name(shard.get("name"))
            specs = [TensorSpec(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in shard["tensors"]]
            with SafetensorsWriter(out / name, specs, shard.get("metadata")) as w:
                for spec in specs:
                    data = _tensor_bytes(spec.name, layout, cf, dense_at, handle)
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
            shutil.copyfile(resolve_inside(root, f.path), out / Path(f.path).name)
    progress.finish()
    return ExportResult(str(out), len(shards), n_tensors, written_bytes)


def _tensor_bytes(name: str, layout: str, cf: Any, dense_at: dict[str, str], handle: Any) -> Any:
    if name in dense_at:
        return tensor_bytes(handle(dense_at[name]).get_tensor(name))
    parsed = _parse_expert_name(name, layout)
    if parsed is None or parsed[0] not in cf.layers:
        raise InputError(f"the cache does not hold {name}", "rebuild the cache with --lossless")
    layer, e, proj, kind = parsed
    lm = cf.layers[layer]
    base_rel = next(f.path for f in lm.files if f.role == L.ROLE_BASE)
    all_rel = next((f.path for f in lm.files if f.role == L.ROLE_DELTA_ALL), None)
    if all_rel is None:
        raise InputError(f"layer {layer} has no lossless delta planes", "rebuild the cache with --lossless")
    w13 = proj != "down_proj"
    I = lm.intermediate_size
    rows = slice(0, I) if proj == "gate_proj" else slice(I, 2 * I) if proj == "up_proj" else slice(None)
    if kind == "codes":
        base = tensor_bytes(handle(base_rel).get_slice(L.W13_BASE if w13 else L.W2_BASE)[e])[rows]
        delta = tensor_bytes(handle(all_rel).get_slice(L.W13_DELTA if w13 else L.W2_DELTA)[e])[rows]
        return join_planes(base, delta)
    if kind == "block_scale":
        return tensor_bytes(handle(base_rel).get_slice(L.W13_SCALE if w13 else L.W2_SCALE)[e])[rows]
    return tensor_bytes(handle(all_rel).get_slice(L.source_scalar(proj, kind))[e])
