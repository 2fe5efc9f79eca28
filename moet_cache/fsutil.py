"""Files that survive a kill: atomic writes, a lock, free-space checks, and safe relative paths."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import functools
import json
import os
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import DiskFullError, InputError, LockHeldError, UnsafePathError

MAX_JSON_BYTES = 64 << 20  # manifests and configs are small; refuse anything absurd before parsing


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of the dirty pages, do not wait for it


@functools.lru_cache(maxsize=1)
def _sync_file_range() -> Any:
    """libc's sync_file_range (Linux), or None where there is none."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing this file's dirty pages now (no wait, pages stay cached).

    A build writes faster than the kernel's dirty thresholds start writeback, so every fsync found
    a whole layer to write while the source reads waited; written back as they come, the writes
    share the disk with the reads instead. A hint: where the call is missing or fails, nothing changes.
    """
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # ctypes releases the GIL around the call


def tmp_path_for(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same folder, fsync, rename over `path`, fsync the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise_if_disk_full(e, len(data), path)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> bytes:
    data = (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode()
    atomic_write_bytes(path, data)
    return data


def raise_if_disk_full(e: OSError, needed: int, path: Path) -> None:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        raise DiskFullError(
            f"the disk is full while writing {path.name} ({needed} more bytes needed at least)",
            "free space on that filesystem and run the build again; it resumes",
        ) from None


def read_json_file(path: Path, *, limit: int = MAX_JSON_BYTES) -> Any:
    """Read a JSON file with a size cap; any malformation is an InputError naming the file."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise InputError(f"{path.name} is {size} bytes, over the {limit}-byte limit for a JSON file")
        with open(path, "rb") as f:
            data = f.read(limit + 1)
        return json.loads(data.decode("utf-8"))
    except InputError:
        raise
    except FileNotFoundError:
        raise InputError(f"{path} does not exist") from None
    except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, an integer of more than 4300 digits
        raise InputError(f"{path.name} is not valid JSON: {str(e)[:200]}", "fix or regenerate the file") from None
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None


def safe_relpath(rel: Any, what: str = "path") -> str:
    """Check a manifest path: relative, POSIX, no '..', no empty or hidden-dot parts."""
    if not isinstance(rel, str) or not rel or len(rel) > 4096 or "\x00" in rel or "\\" in rel:
        raise UnsafePathError(f"{what} {rel!r} is not a valid relative path")
    p = PurePosixPath(rel)
    if p.is_absolute() or any(part in ("", ".", "..") for part in rel.split("/")):
        raise UnsafePathError(f"{what} {rel!r} is absolute or leaves the cache",
                              "a manifest may only name files inside the cache; rebuild the cache")
    return rel


def resolve_inside(root: Path, rel: str, what: str = "path") -> Path:
    """Join a checked relative path to the cache root; refuse links on the way that leave the root."""
    safe_relpath(rel, what)
    path = root / rel
    real_root = root.resolve()
    cur = root
    for part in rel.split("/"):
        cur = cur / part
        if cur.is_symlink():
            raise UnsafePathError(f"{what} {rel!r} passes through a symbolic link",
                                  "the cache must hold plain files; rebuild it")
    try:
        path.resolve().relative_to(real_root)
    except ValueError:
        raise UnsafePathError(f"{what} {rel!r} resolves outside the cache") from None
    return path


def refuse_links(root: Path, names: tuple[str, ...]) -> None:
    """Refuse to write into a cache whose folders are links: writes would land outside the cache."""
    for name in names:
        if (root / name).is_symlink():
            raise UnsafePathError(f"{root / name} is a symbolic link; moet-cache writes only inside the cache",
                                  "replace the link by a real folder (or build a new cache)")


class CacheLock:
    """An exclusive flock on CACHE/.lock; a second build fails at once (or waits with wait=True)."""

    def __init__(self, root: Path, wait: bool = False) -> None:
        self.path = root / ".lock"
        self.wait = wait
        self._fd: int | None = None

    def __enter__(self) -> CacheLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:  # O_NOFOLLOW: a .lock that is a link must not let us truncate a file elsewhere
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise UnsafePathError(f"{self.path} is a symbolic link", "remove it; the cache must hold plain files") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            raise LockHeldError(
                f"another process is building {self.path.parent}",
                "wait for it to finish, or pass --wait",
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def lock_is_held(root: Path) -> bool:
    """True while a build holds CACHE/.lock (a probe that takes and drops a shared lock)."""
    path = root / ".lock"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def check_free_space(root: Path, needed: int) -> None:
    """Fail early (exit 3) when the filesystem under `root` has less than `needed` bytes free."""
    probe = root
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise DiskFullError(
            f"{probe} has {free} bytes free, the build needs {needed} more bytes",
            "free space or choose a cache folder on a larger disk",
        )
