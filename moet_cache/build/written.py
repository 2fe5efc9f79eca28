"""What a build can prove it wrote: the only files the sweep may ever delete.

A cache folder can hold files that are not the build's: a file a user dropped under `model/` or
`layers/`, or a whole folder of other files given as CACHE. So the sweep (the removal of what an
earlier, killed build or retier left) deletes a file only when a record of the builds names it:

* `.written.json`, the build's own list of the paths it writes: a build adds the paths of its plan that
  are free (nothing there yet) or already proven, before its first cache file; the sweep cuts it down to
  what the new cache lists;
* the records a build leaves in the folder: `cache.json` (its files and layer manifests), every layer
  manifest (itself and its files), every part record (`dense/*.json`, `delta/tier.part.json`: itself and
  its files);
* a temp file of an atomic write, `.NAME.tmp-XXXXXXXX`, when NAME is proven.

A record that does not parse proves nothing (it can only keep more files). The build also refuses a
folder that is not empty and holds none of these records (`is_cache_folder`): it never starts writing
into a folder of someone else's files.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

from ..cache import layout as L
from ..cache.cacheview import read_listed_record
from ..errors import InputError
from ..fsutil import atomic_write_bytes, fsync_dir, read_json_file, safe_relpath
from ..cache.manifest import (CACHE_MANIFEST, COMMIT_RECORD, VERIFIED_STATE, CacheManifest, FileEntry, LayerManifest,
                        ManifestError, PartManifest, load_record)

#: The folders the sweep looks into (model/ recursively: the aux files keep the source's folders).
SWEPT_DIRS = (L.LAYERS_DIR, L.DENSE_DIR, "delta", L.AUX_DIR)
WRITTEN_FORMAT = "moet-cache-written"
#: tempfile.mkstemp's names, as fsutil.create_temp_for makes them: `.NAME.tmp-` and 8 characters.
_TEMP = re.compile(r"^\.(.+)\.tmp-[a-z0-9_]{8}$")


def _ours(rel: object) -> str | None:
    """`rel` if it is a safe relative path inside one of the swept folders, else None."""
    try:
        rel = safe_relpath(rel)
    except InputError:
        return None
    return rel if rel.split("/")[0] in SWEPT_DIRS and "/" in rel else None


def read_written(root: Path) -> set[str]:
    """The paths `.written.json` names (none when it is missing or malformed: that proves nothing)."""
    path = root / L.WRITTEN_RECORD
    if not path.is_file() or path.is_symlink():
        return set()
    try:
        doc = read_json_file(path)
    except InputError:
        return set()
    paths = doc.get("paths") if isinstance(doc, dict) and doc.get("format") == WRITTEN_FORMAT else None
    return {p for p in (_ours(x) for x in paths) if p} if isinstance(paths, list) else set()


def _write_written(root: Path, paths: set[str]) -> None:
    if paths == read_written(root) and (root / L.WRITTEN_RECORD).is_file():
        return
    doc = {"format": WRITTEN_FORMAT, "format_version": 1, "paths": sorted(paths)}
    atomic_write_bytes(root / L.WRITTEN_RECORD, (json.dumps(doc, indent=0) + "\n").encode())


def _record_paths(path: Path, rel: str) -> set[str]:
    """A layer manifest's or part record's own path and the files it lists; nothing when it is neither."""
    for parser in (LayerManifest.parse, PartManifest.parse):
        try:
            record = load_record(path, parser, rel)
        except (ManifestError, InputError, OSError):
            continue
        return {rel, *(f.path for f in record.files)}
    return set()


def recorded_paths(root: Path) -> set[str]:
    """Every path in the swept folders that a record in the cache folder lists (or is)."""
    found: set[str] = set()
    try:
        manifest = load_record(root / CACHE_MANIFEST, CacheManifest.parse, CACHE_MANIFEST)
        found |= {f.path for f in manifest.files} | {r.manifest for r in manifest.layers}
    except (ManifestError, InputError, OSError):
        pass
    for folder in (L.LAYERS_DIR, L.DENSE_DIR, "delta"):
        d = root / folder
        if d.is_dir() and not d.is_symlink():
            for p in sorted(d.glob("*.json")):
                if p.is_file() and not p.is_symlink():
                    found |= _record_paths(p, f"{folder}/{p.name}")
    return {p for p in (_ours(x) for x in found) if p}


def proven_paths(root: Path) -> set[str]:
    """The paths of the swept folders a record of the builds names: the ones the sweep may delete."""
    return read_written(root) | recorded_paths(root)


def note_planned(root: Path, planned: Iterable[str]) -> None:
    """Before a build writes its first cache file: add to `.written.json` the paths of its plan that are free
    or already proven. A path that holds a file no record names stays unproven (the build may replace
    it with its own file, but no sweep will ever delete what is there)."""
    proven = proven_paths(root)
    new = proven | {p for p in (_ours(x) for x in planned) if p and (p in proven or not os.path.lexists(root / p))}
    _write_written(root, new)


def is_cache_folder(root: Path) -> bool:
    """A folder a build may write into: empty (or holding only the lock of a build killed at once), or
    holding a build's record (`COMMIT.json`, `cache.json`, `.written.json`, a layer manifest or part record
    that parses: a build killed before `.written.json` existed)."""
    names = {p.name for p in root.iterdir()}
    return names <= {".lock"} or any((root / n).is_file() and not (root / n).is_symlink()
                                     for n in (COMMIT_RECORD, CACHE_MANIFEST, L.WRITTEN_RECORD)) \
        or bool(recorded_paths(root))


def _proven_temp(rel: str, proven: set[str]) -> bool:
    parent, _, name = rel.rpartition("/")
    m = _TEMP.match(name)
    return m is not None and f"{parent}/{m.group(1)}" in proven


def sweep(root: Path, manifest: CacheManifest) -> None:
    """Remove what an earlier (killed) build or retier left that this cache does not list, and only what a
    record proves it wrote (the caller holds the lock): proven files and their temp files in the swept
    folders, temp files of the top-level records and of `.state/verified.json`. `staging/` and every file
    no record names are left alone."""
    keep = {f.path for f in manifest.files} | {r.manifest for r in manifest.layers}
    for layer in manifest.layers:  # checked against cache.json's entry, as every reader of a cache does
        entry = FileEntry(layer.manifest, layer.size, layer.xxh3, L.Role.LAYER_MANIFEST)
        lm = read_listed_record(root, entry, LayerManifest.parse)
        keep.update(f.path for f in lm.files)
    proven = proven_paths(root) | keep
    for folder in SWEPT_DIRS:
        d = root / folder
        if d.is_dir() and not d.is_symlink():
            for p in (d.rglob("*") if folder == L.AUX_DIR else d.iterdir()):
                rel = p.relative_to(root).as_posix()
                if rel not in keep and (p.is_file() or p.is_symlink()) and (rel in proven or _proven_temp(rel, proven)):
                    p.unlink()
    for name in (CACHE_MANIFEST, COMMIT_RECORD, L.SOURCE_MAP, L.WRITTEN_RECORD):
        for p in root.glob(f".{name}.tmp-*"):
            p.unlink(missing_ok=True)
    state = root / VERIFIED_STATE
    for p in state.parent.glob(f".{state.name}.tmp-*") if state.parent.is_dir() and not state.parent.is_symlink() else ():
        p.unlink(missing_ok=True)
    _write_written(root, {p for p in keep if _ours(p)})
    fsync_dir(root)
