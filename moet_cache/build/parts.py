"""The small pieces every step of a build shares: records of files just written, the resume check of a
part, the counters a build reports (the sweep of what a killed build left behind is written.py's)."""

from __future__ import annotations

import json
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..cancel import CancelToken
from ..fsutil import atomic_write_bytes
from ..cache.cacheview import file_matches
from ..hashing import xxh3_hex
from ..cache.manifest import FileEntry, ManifestError, PartManifest, TensorEntry, load_record, write_record
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


def write_bytes_entry(root: Path, rel: str, data: bytes, role: str, mode: int = 0o644) -> FileEntry:
    """Write `data` atomically with permissions `mode` (skipped when the file already holds exactly it, with
    those permissions) and return its entry."""
    dest = root / rel
    if not (dest.is_file() and not dest.is_symlink() and stat.S_IMODE(dest.stat().st_mode) == mode
            and dest.read_bytes() == data):
        atomic_write_bytes(dest, data, mode)
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
