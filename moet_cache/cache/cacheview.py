"""The opened-cache view: a cache's manifests read and checked once, with typed accessors (docs/FORMAT.md).

    view = open_view(root)           # COMMIT.json -> cache.json -> every layer manifest, each checked
    view.delta_index                 # delta/tier.json, read once, size and digest checked, parsed
    view.dense_parts                 # the dense part manifests, likewise
    view.served_config               # model/config.json, the config vLLM reads, likewise

Every small file a cache lists is read through `read_listed`, which checks its size and xxh3-128 against
the entry that lists it before a byte is parsed; whether a big file still matches its entry is
`file_matches` (`entry_digest`). Inspection, the plan, serving, the loader, the exporter, the verifier and
the builder's resume all start here, so no reader trusts a file that nothing checked. This module sits
just above the records (manifest.py) and the file seam (fsutil.py) and imports nothing higher.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from . import layout as L
from ..errors import InputError, UnsafePathError, VerificationError
from ..format.families import DeepseekV3, Family
from .folders import require_cache_folder
from ..fsutil import read_all, read_json_file, resolve_inside
from ..hashing import xxh3_file_hex, xxh3_hex
from .manifest import (CACHE_MANIFEST, COMMIT_RECORD, CacheManifest, CommitRecord, DeltaIndex, FileEntry,
                       LayerManifest, ManifestError, PartManifest, loads_record)
from ..format.modelconfig import ModelConfig

#: The most a listed small file (a manifest, the source map, a model-folder file) may hold.
SMALL_LIMIT = 64 << 20
REBUILD = "run moet-cache build again"


class DamagedCacheError(ManifestError, VerificationError):
    """The cache's own files say it is damaged (a commit record that cannot be read, a file that is not what
    its record names): a verification problem (exit 1) to every command, never bad input; still a
    ManifestError to the callers that treat every unusable manifest alike. (A folder without a commit
    record stays a ManifestError, exit 2 outside `verify`: it may be no cache at all.)"""


class ListedFileError(DamagedCacheError):
    """A file a manifest lists is missing, unreadable, or not the bytes its entry names (size or digest)."""

    def __init__(self, message: str, hint: str | None = None, path: str = "") -> None:
        super().__init__(message, hint)
        self.path = path  # the listed file's path inside the cache


def read_listed(root: Path, entry: FileEntry, listed_in: str = CACHE_MANIFEST, limit: int = SMALL_LIMIT) -> bytes:
    """The bytes of a small file a manifest lists, after checking them against the entry's size and digest.

    The one place a listed file is read whole: a file that is missing, unreadable, a link, over `limit`, or
    not the bytes the entry names is a ListedFileError (the cache is damaged), never parsed."""
    mismatch = ListedFileError(f"{entry.path} does not match {listed_in} (size or xxh3-128 digest)", REBUILD,
                               entry.path)
    try:
        # never more than the entry's size: a longer file fails without being read
        data = read_all(resolve_inside(root, entry.path), min(entry.size, limit))
    except UnsafePathError as e:
        raise ListedFileError(e.message, "the cache must hold plain files; rebuild it", entry.path) from None
    except InputError:  # longer than listed
        raise mismatch from None
    except OSError as e:  # missing, unreadable, a link or not a plain file
        raise ListedFileError(f"{entry.path}, listed in {listed_in}, cannot be read ({e.strerror or e})",
                              REBUILD, entry.path) from None
    if len(data) != entry.size or xxh3_hex(data) != entry.xxh3:
        raise mismatch
    return data


def read_listed_record(root: Path, entry: FileEntry, parser: Any, listed_in: str = CACHE_MANIFEST) -> Any:
    """A listed JSON record: its bytes checked by `read_listed`, then parsed strictly by `parser`."""
    return parser(loads_record(read_listed(root, entry, listed_in), entry.path), entry.path)


def read_delta_index(root: Path, manifest: CacheManifest) -> DeltaIndex | None:
    """delta/tier.json as `manifest` lists it, checked and parsed (None when it lists no delta index): the one
    reader of the delta index (CacheView.delta_index; the build's summary of what it just committed)."""
    fe = manifest.file(L.Role.DELTA_INDEX)
    return read_listed_record(root, fe, DeltaIndex.parse) if fe is not None else None


def entry_digest(root: Path, entry: FileEntry) -> str | None:
    """The xxh3-128 of a listed (big) file re-hashed from disk; None when it is missing, a link, not a plain
    file or not the entry's size (no hashing then). A read error is the caller's OSError to report."""
    p = root / entry.path
    try:
        if p.is_symlink() or not p.is_file() or p.stat().st_size != entry.size:
            return None
    except OSError:
        return None
    return xxh3_file_hex(p)


def file_matches(root: Path, entry: FileEntry) -> bool:
    """The file still exists with the entry's size and digest (re-hashed): the one test of "still the same"."""
    try:
        return entry_digest(root, entry) == entry.xxh3
    except OSError:
        return False


def read_commit(root: Path) -> tuple[CacheManifest, str]:
    """The manifest COMMIT.json names, checked against the size and digest it records; and that digest."""
    try:
        doc = read_json_file(root / COMMIT_RECORD)
    except InputError as e:
        raise DamagedCacheError(e.message, REBUILD) from None
    try:
        commit = CommitRecord.parse(doc, COMMIT_RECORD)
    except ManifestError as e:
        raise DamagedCacheError(e.message, e.hint) from None
    mpath = resolve_inside(root, commit.manifest, "commit record manifest")
    try:
        data = read_all(mpath, commit.manifest_size)
    except (OSError, InputError):
        data = b""
    if len(data) != commit.manifest_size or xxh3_hex(data) != commit.manifest_xxh3:
        raise ListedFileError(f"{commit.manifest} does not match the commit record (edited or replaced after the build)",
                              REBUILD, commit.manifest)
    return CacheManifest.parse(loads_record(data, commit.manifest), commit.manifest), commit.manifest_xxh3


def read_committed_manifest(root: Path) -> CacheManifest | None:
    """The manifest named by the commit record, or None when there is no commit record."""
    if not (root / COMMIT_RECORD).is_file():
        return None
    return read_commit(root)[0]


@dataclass(frozen=True)
class CacheView:
    """One cache as its manifests describe it, checked once: cache.json (against COMMIT.json when committed),
    every layer manifest (against cache.json), and every folder on the way to a listed file (no links).
    The other small files are read and checked on first use and kept (`delta_index`, `dense_parts`, ...)."""

    root: Path
    manifest: CacheManifest
    manifest_xxh3: str
    layers: dict[int, LayerManifest]
    files: tuple[tuple[FileEntry, int | None], ...]  # every listed file: (entry, its layer or None)

    # the small listed files, each read through read_listed on first use ------------------------------
    def read(self, entry: FileEntry) -> bytes:
        """A small file cache.json lists, its size and digest checked."""
        return read_listed(self.root, entry)

    def listed(self, role: str, path: str | None = None) -> FileEntry | None:
        """cache.json's entry of that role (and path), or None."""
        return next((f for f in self.manifest.files if f.role == role and (path is None or f.path == path)), None)

    @cached_property
    def delta_index(self) -> DeltaIndex | None:
        """delta/tier.json: which (layer, expert) delta planes the tier pack holds; None if the cache lists none."""
        return read_delta_index(self.root, self.manifest)

    def tier_experts(self, layer: int) -> tuple[int, ...]:
        """The experts of `layer` whose delta planes the tier holds (none without a delta index)."""
        index = self.delta_index
        return (index.experts_of(layer) or ()) if index is not None else ()

    def mid_experts(self, layer: int) -> tuple[int, ...]:
        """The experts of `layer` whose mid planes and tables the pack holds (none without a mid tier)."""
        index = self.delta_index
        return index.mid_experts_of(layer) if index is not None else ()

    @cached_property
    def dense_parts(self) -> tuple[PartManifest, ...]:
        """The dense shards' part manifests (dense/*.json), which name every dense tensor's byte range."""
        return tuple(read_listed_record(self.root, fe, PartManifest.parse) for fe in self.manifest.files
                     if fe.role == L.Role.PART and fe.path.startswith(L.DENSE_DIR + "/"))

    @cached_property
    def served_config(self) -> dict[str, Any] | None:
        """model/config.json, the model config vLLM reads (quant_method moet); None if the cache lists none."""
        fe = self.listed(L.Role.AUX, f"{L.AUX_DIR}/config.json")
        if fe is None:
            return None
        doc = loads_record(self.read(fe), fe.path)
        if not isinstance(doc, dict):
            raise ManifestError(f"{fe.path} is not a JSON object", REBUILD)
        return doc

    @cached_property
    def source_map(self) -> Any:
        """source-map.json (the source's shards and tensors, for export and --against); None if not listed."""
        fe = self.manifest.file(L.Role.SOURCE_MAP)
        return loads_record(self.read(fe), fe.path) if fe is not None else None

    # what the manifests say --------------------------------------------------------------------------------
    @property
    def model(self) -> ModelConfig:
        """The model config recorded in cache.json."""
        return self.manifest.model.config

    @cached_property
    def family(self) -> Family:
        """The naming family the cache was built from (caches from before the record: the V3 family)."""
        model = self.manifest.model
        return model.family or DeepseekV3("deepseek_v3", model.config.num_hidden_layers, (), ())

    def bytes_of(self, *roles: str) -> int:
        """The listed bytes of files of these roles (all files when none is named)."""
        return sum(f.size for f, _ in self.files if not roles or f.role in roles)


def view_of(root: Path, manifest: CacheManifest, manifest_xxh3: str) -> CacheView:
    """The view of this manifest: its layer manifests read and checked against it, its folders checked."""
    layers: dict[int, LayerManifest] = {}
    files: list[tuple[FileEntry, int | None]] = [(f, None) for f in manifest.files]
    for ref in manifest.layers:
        entry = FileEntry(ref.manifest, ref.size, ref.xxh3, L.Role.LAYER_MANIFEST)
        lm = read_listed_record(root, entry, LayerManifest.parse)
        if lm.layer != ref.layer:
            raise ManifestError(f"{ref.manifest} describes layer {lm.layer}, cache.json says {ref.layer}")
        layers[ref.layer] = lm
        files.append((entry, ref.layer))
        files.extend((f, ref.layer) for f in lm.files)
    # Never read through a linked folder (a linked file itself is reported as a "link" problem).
    for folder in sorted({f.path.rsplit("/", 1)[0] for f, _ in files if "/" in f.path}):
        try:
            resolve_inside(root, folder)
        except UnsafePathError as e:
            raise ManifestError(e.message, "the cache must hold plain files; rebuild it") from None
    return CacheView(root, manifest, manifest_xxh3, layers, tuple(files))


def open_view(root: str | os.PathLike[str]) -> CacheView:
    """The view of a committed cache; a ManifestError when it is incomplete or its manifests are damaged."""
    root = Path(root)
    if not (root / COMMIT_RECORD).is_file():
        require_cache_folder(root)  # a typo, a file, a checkpoint: named as what it is (exit 2)
        raise ManifestError(f"{root} has no commit record: the cache is incomplete",
                            "run moet-cache build to finish it")
    return view_of(root, *read_commit(root))


def open_uncommitted_view(root: str | os.PathLike[str]) -> CacheView:
    """What an uncommitted cache's cache.json lists (a command killed inside its commit window left it): the
    manifests are checked as in a committed cache; the big files are not (the caller re-hashes them)."""
    root = Path(root)
    try:
        data = read_all(root / CACHE_MANIFEST, SMALL_LIMIT)
    except (OSError, InputError):
        raise ManifestError(f"{root} has neither a commit record nor a readable {CACHE_MANIFEST}",
                            "run moet-cache build SRC CACHE to finish it") from None
    manifest = CacheManifest.parse(loads_record(data, CACHE_MANIFEST), CACHE_MANIFEST)
    return view_of(root, manifest, xxh3_hex(data))


__all__ = ["CacheView", "DamagedCacheError", "ListedFileError", "open_view", "open_uncommitted_view", "view_of", "read_listed",
           "read_listed_record", "read_delta_index", "entry_digest", "file_matches", "read_commit", "read_committed_manifest"]
