"""The small pieces every step of a build shares: records of files just written, the resume check of a
part, the counters a build reports, and the sweep of what a killed build left behind."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

from .. import layout as L
from ..cancel import CancelToken
from ..fsutil import atomic_write_bytes, fsync_dir
from ..cacheview import file_matches, read_listed_record
from ..hashing import xxh3_hex
from ..manifest import (CACHE_MANIFEST, COMMIT_RECORD, VERIFIED_STATE, CacheManifest, FileEntry, LayerManifest,
                        ManifestError, PartManifest, TensorEntry, load_record, write_record)
from ..progress import Progress
from ..stwriter import WrittenFile


class _Reusable(Protocol):
    build_key: str
    files: tuple[FileEntry, ...]


_R = TypeVar("_R", bound=_Reusable)


def key_of(obj: object) -> str:
    """A build key: the digest of what a part's bytes depend on (JSON, sorted keys)."""
    return xxh3_hex(json.dumps(obj, sort_keys=True).encode())


def file_entry(rel: str, data: bytes, role: str) -> FileEntry:
    """The one way a FileEntry is made from bytes just written (or just read back)."""
    return FileEntry(rel, len(data), xxh3_hex(data), role)


def read_entry(root: Path, rel: str, role: str) -> FileEntry:
    """The entry of a small file already in the cache (a record a resumed build keeps)."""
    return file_entry(rel, (root / rel).read_bytes(), role)


def write_bytes_entry(root: Path, rel: str, data: bytes, role: str) -> FileEntry:
    """Write `data` atomically (skipped when the file already holds exactly it) and return its entry."""
    dest = root / rel
    if not (dest.is_file() and not dest.is_symlink() and dest.read_bytes() == data):
        atomic_write_bytes(dest, data)
    return file_entry(rel, data, role)


def write_record_entry(root: Path, rel: str, record: object, role: str) -> FileEntry:
    """Write a JSON record atomically and return its entry."""
    return file_entry(rel, write_record(root / rel, record), role)


def written_entries(rel: str, written: WrittenFile, role: str) -> tuple[FileEntry, list[TensorEntry]]:
    """The entry of a safetensors file the writer just committed, and its tensors' entries."""
    fe = FileEntry(rel, written.size, written.xxh3, role)
    return fe, [TensorEntry(t.name, rel, t.dtype, t.shape, t.begin, t.end, t.xxh3) for t in written.tensors]


def reusable(root: Path, rel: str, key: str, parser: Callable[[Any, str], _R]) -> _R | None:
    """The record at `rel` (a part record or a layer manifest) if a killed build finished it for this very
    key and every file it lists still matches (size and digest, re-hashed); else None: redo it."""
    path = root / rel
    if not path.is_file():
        return None
    try:
        record = load_record(path, parser, rel)
    except ManifestError:
        return None
    if record.build_key != key or not record.files or not all(file_matches(root, f) for f in record.files):
        return None
    return record


def reusable_part(root: Path, rel: str, key: str) -> PartManifest | None:
    return reusable(root, rel, key, PartManifest.parse)


class Counters:
    """What a build counts from several threads (the layers', the dense copy's, the committer's): source
    bytes read, progress, written bytes hashed (a speed sample). Each report is a unit of work done, so
    it is also where the cancel token is checked."""

    def __init__(self, progress: Progress, cancel: CancelToken | None) -> None:
        self.progress, self.cancel = progress, cancel
        self._stop = CancelToken()  # set by the build itself when one of its threads failed
        self.read_bytes = 0
        self.hashed = (0, 0.0)  # (bytes, seconds) of written files re-read and hashed
        self._lock = threading.Lock()

    def check(self) -> None:
        self._stop.check()
        if self.cancel is not None:
            self.cancel.check()

    @contextmanager
    def stopping_on_error(self) -> Iterator[None]:
        """On an exception in the body, the other threads stop at their next report (their own error,
        an Interrupted, is never seen: the body's exception is the one raised)."""
        try:
            yield
        except BaseException:
            self._stop.cancel("stopped: another part of the build failed")
            raise

    def advance(self, nbytes: int, read: bool = True) -> None:
        """Count source bytes read (or reused: read=False) and report progress."""
        self.check()
        with self._lock:
            if read:
                self.read_bytes += nbytes
            self.progress.advance(nbytes)

    def add_hashed(self, written: WrittenFile) -> None:
        with self._lock:
            self.hashed = (self.hashed[0] + written.size, self.hashed[1] + written.hash_seconds)


def sweep(root: Path, manifest: CacheManifest) -> None:
    """Remove what an earlier (killed) build or retier left that this cache does not list: unlisted files
    in our folders, the staging folder, temp files of atomic writes (the caller holds the lock)."""
    keep = {f.path for f in manifest.files} | {r.manifest for r in manifest.layers}
    for layer in manifest.layers:  # checked against cache.json's entry, as every reader of a cache does
        entry = FileEntry(layer.manifest, layer.size, layer.xxh3, L.Role.LAYER_MANIFEST)
        lm = read_listed_record(root, entry, LayerManifest.parse)
        keep.update(f.path for f in lm.files)
    for folder in (L.LAYERS_DIR, L.DENSE_DIR, "delta", L.AUX_DIR):
        d = root / folder
        if d.is_dir() and not d.is_symlink():
            for p in (d.rglob("*") if folder == L.AUX_DIR else d.iterdir()):
                if p.relative_to(root).as_posix() not in keep and (p.is_file() or p.is_symlink()):
                    p.unlink()
    staging = root / L.STAGING_DIR
    if staging.is_dir():
        shutil.rmtree(staging)
    for name in (CACHE_MANIFEST, COMMIT_RECORD, L.SOURCE_MAP):
        for p in root.glob(f".{name}.tmp-*"):
            p.unlink(missing_ok=True)
    state = root / VERIFIED_STATE
    for p in state.parent.glob(f".{state.name}.tmp-*") if state.parent.is_dir() and not state.parent.is_symlink() else ():
        p.unlink(missing_ok=True)
    fsync_dir(root)
