"""Turn a lossless cache back into an NVFP4 checkpoint in the source's layout: every tensor exact (the
shard files are not byte-identical: moet-cache writes their headers), every byte read checked first."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..cache import layout as L
from .checkpoint import INDEX_NAME
from ..cache.commit import KillHook, Window, kill_point
from ..format.families import Family
from ..format.formats import FORMATS, LAYOUT_FORMAT, ExpertFormat, SourceLayout, TensorKind, source_scales
from ..cache.geometry import names_of
from ..errors import InputError, VerificationError
from ..cache.cacheview import CacheView, ListedFileError, open_view
from ..fsutil import (atomic_write_bytes, atomic_write_json, fsync_dir, open_regular, pread_into, read_json_file,
                     refuse_overlap, resolve_inside)
from ..hashing import xxh3_file_hex, xxh3_hex
from ..cache.manifest import DTYPES, MAX_INT, TensorEntry
from ..codec.planes import join_planes
from ..cancel import CancelToken, check as check_cancel
from ..progress import NullProgress, Progress
from ..stwriter import DTYPE_SIZES, SafetensorsWriter, TensorSpec
from ..verify.against import cache_read_errors


@dataclass(frozen=True)
class ExportResult:
    out: str
    shards: int
    tensors: int
    bytes_written: int


def layer_source_format(lm: Any, layout: str) -> ExpertFormat:
    """The expert format a layer was built from (recorded per layer; older caches: the layout's)."""
    return FORMATS.get(lm.source_format) or LAYOUT_FORMAT.get(layout) or LAYOUT_FORMAT[SourceLayout.MODELOPT]


def _parse_expert_name(name: str, fam: Family, cf: CacheView, layout: str) -> tuple[int, int, str, TensorKind] | None:
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


PROGRESS_RECORD = ".moet-export.json"


class VerifiedTensors:
    """Whole cache tensors read through the read seam (pread, no map), each checked against the xxh3 of
    its manifest entry before any byte of it is used.

    The manifests hold one digest per tensor, and a source shard takes its experts' slices from a layer's
    tensors in name order (expert 0, 1, 10, 100, ...), so a layer's expert tensors are kept while they are
    used: the budget is the largest layer's (its base and lossless delta files' tensors; a DeepSeek-V3
    layer is ~6 GB), least recently used dropped first. Dense tensors are read once and never kept.
    """

    def __init__(self, root: Path, entries: dict[tuple[str, str], TensorEntry], budget: int) -> None:
        self.root = root
        self.entries = entries
        self.budget = budget
        self._kept: dict[tuple[str, str], np.ndarray] = {}
        self._fds: dict[str, int] = {}

    def raw(self, file: str, name: str, keep: bool = True) -> np.ndarray:
        key = (file, name)
        if key in self._kept:
            buf = self._kept.pop(key)
            self._kept[key] = buf  # the most recently used goes last
            return buf
        t = self.entries.get(key)
        if t is None:
            raise VerificationError(f"{file} has no manifest entry for tensor {name}",
                                    "run moet-cache verify --full; rebuild the cache")
        if file not in self._fds:
            self._fds[file] = open_regular(resolve_inside(self.root, file))
        buf = np.empty(t.end - t.begin, dtype=np.uint8)
        try:
            n = pread_into(self._fds[file], memoryview(buf), t.begin)
        except OSError as e:
            raise VerificationError(f"{file} cannot be read ({e.strerror}): nothing of it is exported",
                                    "check the disk; run moet-cache verify --full") from None
        if n != buf.nbytes or xxh3_hex(memoryview(buf)) != t.xxh3:
            raise VerificationError(f"{file}: tensor {name} does not match its digest (the cache is damaged)",
                                    "run moet-cache verify --full; rebuild the cache")
        if keep:
            while self._kept and sum(a.nbytes for a in self._kept.values()) + buf.nbytes > self.budget:
                self._kept.pop(next(iter(self._kept)))
            self._kept[key] = buf
        return buf

    def expert(self, file: str, name: str, e: int) -> np.ndarray:
        """Expert e's bytes of a per-expert tensor [E, ...], shaped as tensor_bytes(t[e]) would be."""
        raw = self.raw(file, name)  # first: a tensor without a manifest entry is a VerificationError there
        t = self.entries[(file, name)]
        size = DTYPE_SIZES[t.dtype]
        if len(t.shape) == 1:
            return raw.reshape(t.shape[0], size)[e]
        return raw.reshape(*t.shape[:-1], t.shape[-1] * size)[e]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._kept.clear()


def _record_progress(out: Path, cache_digest: str, done: dict[str, str]) -> None:
    """OUT/.moet-export.json: the cache this export is of and the shards finished (name -> xxh3). Written
    before the first shard, so that a folder holding any shard also holds the record that resumes it."""
    atomic_write_json(out / PROGRESS_RECORD, {"format": "moet-cache-export-progress", "format_version": 1,
                                              "cache_xxh3": cache_digest, "shards": done})


def _prepare_out(out: Path, cache_digest: str) -> dict[str, str]:
    """A new or empty folder, or one an interrupted export of this same cache left (resumed): returns the
    shards already exported (name -> xxh3), after removing the temp files a kill left."""
    if not out.exists():
        out.mkdir(parents=True)
        return {}
    if not out.is_dir() or out.is_symlink():
        raise InputError(f"{out} exists and is not a folder", "choose a new folder for the export")
    names = [p.name for p in out.iterdir()]
    if not names:
        return {}
    record = out / PROGRESS_RECORD
    doc = None
    if record.is_file() and not record.is_symlink():
        try:
            doc = read_json_file(record)
        except InputError:
            doc = None
    ok = isinstance(doc, dict) and doc.get("cache_xxh3") == cache_digest and isinstance(doc.get("shards"), dict)
    if not ok and not all(n.startswith(".") and ".tmp-" in n for n in names):
        raise InputError(f"{out} exists and is not empty (and holds no unfinished export of this cache)",
                         "choose a new folder for the export")
    for n in names:
        if n.startswith(".") and ".tmp-" in n:
            (out / n).unlink()
    if not ok:
        return {}
    done = {str(k): str(v) for k, v in doc["shards"].items()}
    return {k: v for k, v in done.items() if (out / k).is_file() and not (out / k).is_symlink()
            and _checked_name(k) == k and xxh3_file_hex(out / k) == v}


@cache_read_errors
def export_checkpoint(root: str | os.PathLike[str], out: str | os.PathLike[str],
                      progress: Progress | None = None, cancel: CancelToken | None = None,
                      kill_at: KillHook | None = None) -> ExportResult:
    """Write the source's shards, index and aux files again from a --lossless cache.

    Every tensor comes out exact (its bytes, dtype, shape, shard and the shard's metadata); the shard
    files are written by moet-cache's own writer, so their headers (key order, padding) may differ from
    the source's and the files need not be byte-identical. Every cache byte read is checked against its
    manifest digest first (a damaged cache exports nothing as good: exit 1). Interrupted or killed, the
    same command resumes: shards already exported (recorded in OUT/.moet-export.json with their
    digests, re-hashed) are kept, temp files removed; the record goes once the export is complete.
    """
    root, out = Path(root), Path(out)
    progress = progress or NullProgress()
    refuse_overlap(root, "cache folder", out, "export folder")  # the export would land in the cache, or over it
    cf = open_view(root)
    if not cf.manifest.build.lossless:
        raise InputError("this cache keeps the delta planes of its tier only, so it cannot give back the source",
                         "build it with --lossless to be able to export")
    bad = next((f.path for f, _ in cf.files if not (root / f.path).is_file() or (root / f.path).stat().st_size != f.size), None)
    if bad is not None:  # a missing file is a damaged cache (exit 1), not an environment problem (exit 3)
        raise VerificationError(f"{bad} is missing or has the wrong size", "run moet-cache verify --full; rebuild the cache")
    try:
        smap, parts = cf.source_map, cf.dense_parts
    except ListedFileError as e:  # a damaged cache exports nothing (exit 1)
        raise VerificationError(e.message, "run moet-cache verify --full; rebuild the cache") from None
    layout = cf.manifest.source_layout
    fam = cf.family
    entries: dict[tuple[str, str], TensorEntry] = {}
    dense_at: dict[str, str] = {}
    for part in parts:
        dense_at.update({t.name: t.file for t in part.tensors})
        entries.update({(t.file, t.name): t for t in part.tensors})
    for lm in cf.layers.values():
        entries.update({(t.file, t.name): t for t in lm.tensors})
    shards = smap.get("shards") if isinstance(smap, dict) else None
    if not isinstance(shards, list):
        raise InputError("the cache's source map has no list of shards", "rebuild the cache")
    done = _prepare_out(out, cf.manifest_xxh3)
    _record_progress(out, cf.manifest_xxh3, done)
    weight_map: dict[str, str] = {}
    n_tensors = written_bytes = 0
    progress.start(sum(f.size for f, _ in cf.files if f.role in (L.Role.BASE, L.Role.DELTA_ALL, L.Role.DENSE)), "export")
    per_layer = [sum(t.end - t.begin for t in lm.tensors) for lm in cf.layers.values()]
    reader = VerifiedTensors(root, entries, max(per_layer, default=0))
    try:
        room = sum(f.size for f, _ in cf.files)  # an export gives back at most the bytes the cache holds
        for shard in shards:
            specs = _shard_specs(shard)
            room -= sum(sp.nbytes for sp in specs)
            if room < 0:
                raise InputError("the cache's source map lists more bytes than the cache holds", "rebuild the cache")
            name = _checked_name(shard.get("name"))
            weight_map.update({spec.name: name for spec in specs})
            n_tensors += len(specs)
            if name in done:
                written_bytes += (out / name).stat().st_size
                progress.advance(sum(sp.nbytes for sp in specs))
                continue
            with SafetensorsWriter(out / name, specs, shard.get("metadata")) as w:
                for spec in specs:
                    check_cancel(cancel)  # between tensors: the shard's temp file goes, the done ones stay
                    data = _tensor_bytes(spec.name, layout, cf, dense_at, reader, fam)
                    if data.nbytes != spec.nbytes:
                        raise VerificationError(f"the cache holds {data.nbytes} bytes for {spec.name}, its source map says "
                                                f"{spec.nbytes}", "run moet-cache verify --full; rebuild the cache")
                    w.write(spec.name, data)
                    progress.advance(data.nbytes)
                kill_point(kill_at, Window.EXPORT_SHARD_TEMP)
                written = w.commit()
            done[name] = written.xxh3
            written_bytes += written.size
            _record_progress(out, cf.manifest_xxh3, done)
            kill_point(kill_at, Window.EXPORT_SHARD_WRITTEN)
    finally:
        reader.close()
    if len(shards) > 1 or shards and shards[0].get("name") != "model.safetensors":
        index = {"metadata": smap.get("index_metadata") or {}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write_bytes(out / INDEX_NAME, json.dumps(index, indent=1).encode())
        kill_point(kill_at, Window.EXPORT_INDEX_WRITTEN)
    check_cancel(cancel)  # an interrupt before the end stops with the record in place: the rerun finishes
    source_config = any(f.role == L.Role.SOURCE_CONFIG for f, _ in cf.files)
    for f, _ in cf.files:
        served = source_config and f.role == L.Role.AUX and f.path == f"{L.AUX_DIR}/config.json"
        if f.role in (L.Role.AUX, L.Role.SOURCE_CONFIG) and not served:
            try:
                data = cf.read(f)
            except ListedFileError as e:
                raise VerificationError(e.message, "run moet-cache verify --full; rebuild the cache") from None
            # the source's config.json (model/config.source.json), not the one served to vLLM
            rel = "config.json" if f.role == L.Role.SOURCE_CONFIG else Path(f.path).relative_to(L.AUX_DIR)
            dest = out / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(dest, data, stat.S_IMODE(os.lstat(root / f.path).st_mode))  # the source's, kept by the build
    check_cancel(cancel)
    progress.finish()  # (the CLI's raises a held Ctrl-C here, while the record still resumes the export)
    (out / PROGRESS_RECORD).unlink(missing_ok=True)  # last: from here OUT is a finished checkpoint
    fsync_dir(out)
    return ExportResult(str(out), len(shards), n_tensors, written_bytes)


def _tensor_bytes(name: str, layout: str, cf: CacheView, dense_at: dict[str, str], reader: VerifiedTensors,
                  fam: Family) -> Any:
    """One source tensor's bytes, in the source's own format: a dense copy, or an expert tensor rebuilt
    from its planes (codes), its stored block scales (back to the source's form) or its source scalars."""
    if name in dense_at:
        return reader.raw(dense_at[name], name, keep=False)
    parsed = _parse_expert_name(name, fam, cf, layout)
    if parsed is None:
        raise InputError(f"the cache does not hold {name}", "rebuild the cache with --lossless")
    layer, e, proj, kind = parsed
    lm = cf.layers[layer]
    base_rel = next(f.path for f in lm.files if f.role == L.Role.BASE)
    all_rel = next((f.path for f in lm.files if f.role == L.Role.DELTA_ALL), None)
    if all_rel is None:
        raise InputError(f"layer {layer} has no lossless delta planes", "rebuild the cache with --lossless")
    rows = lm.geometry().rows(proj)
    base_name, delta_name, scale_name = names_of(proj)
    if kind == TensorKind.CODES:
        base = reader.expert(base_rel, base_name, e)[rows]
        delta = reader.expert(all_rel, delta_name, e)[rows]
        return join_planes(base, delta)
    if kind == TensorKind.BLOCK_SCALE:
        stored = reader.expert(base_rel, scale_name, e)[rows]
        return source_scales(stored, lm.scale_form(scale_name), layer_source_format(lm, layout).scale_form)
    return reader.expert(all_rel, L.source_scalar(proj, kind), e)
