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
import stat
import time
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import DiskFullError, InputError, LockHeldError, UnsafePathError

MAX_JSON_BYTES = 64 << 20  # manifests and configs are small; refuse anything absurd before parsing

# --- the read seam ---------------------------------------------------------------------------------
# Every file the library reads (manifests, configs, the lock, the files it hashes) is opened by
# open_regular() and read by pread_into() / read_all(): one place where a read error (EIO from a
# failing disk, EACCES) can happen, and one place where a test injects one (tests/faults/test_io.py
# replaces `_os_open` / `_os_preadv` of this module). No mmap: a mapped page that cannot be read is
# a SIGBUS that kills the process; a pread that cannot be read is an OSError we report.
_os_open = os.open
_os_preadv = os.preadv


class NotRegularFileError(OSError):
    """A path that must name a plain file names a FIFO, a device, a folder or a link."""


def open_regular(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o644,
                 follow: bool = False) -> int:
    """Open a plain file and return its descriptor; never block, never follow a final link.

    O_NONBLOCK makes the open of a FIFO return at once (a blocking open would wait for a writer
    forever); O_NOFOLLOW refuses a final link; fstat then refuses anything but a regular file, and
    O_NONBLOCK is cleared again for the reads of a real file. follow=True (source files only, never
    the cache's): a link to a plain file is read (a Hugging Face hub snapshot's files are links into
    its blobs); what it points at must still be a plain file.
    """
    try:
        fd = _os_open(path, flags | (0 if follow else os.O_NOFOLLOW) | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegularFileError(errno.ELOOP, "a symbolic link, not a plain file", str(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(errno.EINVAL, "not a plain file (a FIFO, device or folder)", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


FileId = tuple[int, int, int]


def file_id(st: os.stat_result) -> FileId:
    """A file's identity for "is it still the file that was checked": (size, mtime_ns, inode). Every write of
    the cache is a rename, so a file replaced or rewritten since has another one."""
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill `buf` from `offset`; returns the bytes read (fewer only at the end of the file)."""
    done = 0
    while done < buf.nbytes:
        n = _os_preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def read_all(path: str | os.PathLike[str], limit: int | None = None, follow: bool = False) -> bytes:
    """The whole of a plain file (through the seam); more than `limit` bytes is an InputError."""
    fd = open_regular(path, follow=follow)
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise InputError(f"{Path(path).name} is {size} bytes, over the {limit}-byte limit")
        buf = bytearray(size)  # what fstat saw; a file that changes while it is read fails its digest
        n = pread_into(fd, memoryview(buf), 0)
        return bytes(buf) if n == size else bytes(buf[:n])
    finally:
        os.close(fd)


def create_temp_for(path: Path, mode: int = 0o644) -> tuple[int, Path]:
    """A new temp file beside `path` for an atomic write: exclusive creation (O_EXCL, so never through a
    link), an unpredictable name `.NAME.tmp-XXXXXXXX`, `mode` (0644 unless a copy keeps its source's).
    Returns (fd, temp path)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd, Path(tmp)


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


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write to a new temp file (permissions `mode`) in the same folder, fsync, rename over `path`, fsync
    the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = create_temp_for(path, mode)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise_if_disk_full(e, len(data), path)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> bytes:
    data = (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode()
    atomic_write_bytes(path, data)
    return data


def raise_if_disk_full(e: OSError, needed: int, path: Path) -> None:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f", {shutil.disk_usage(path.parent).free} free"
        except OSError:
            free = ""
        raise DiskFullError(
            f"the disk is full while writing {path} ({needed} bytes needed for it{free})",
            "free space on that filesystem and run the build again; it resumes",
        ) from None


def read_json_file(path: Path, *, limit: int = MAX_JSON_BYTES, follow: bool = False) -> Any:
    """Read a JSON file with a size cap; any malformation is an InputError naming the file.
    follow=True for a source's files (config.json, the index: links in a hub snapshot)."""
    try:
        data = read_all(path, limit, follow)
        return json.loads(data.decode("utf-8"))
    except InputError:
        raise
    except FileNotFoundError:
        raise InputError(f"{path} does not exist") from None
    except NotRegularFileError as e:
        raise InputError(f"{path} is {e.strerror}", "replace it by a plain file") from None
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


def is_inside(folder: Path, path: Path) -> bool:
    """`path` is `folder` or lies under it, both with every link resolved."""
    try:
        real, inner = folder.resolve(), path.resolve()
    except (OSError, RuntimeError) as e:  # a link loop
        raise InputError(f"cannot resolve {path} or {folder}: {e}", "remove the looping link") from None
    return inner == real or real in inner.parents


def refuse_overlap(a: Path, a_what: str, b: Path, b_what: str) -> None:
    """Refuse two folders that are one, or one inside the other (after links): a command that writes one
    and reads (or sweeps) the other would destroy what it reads."""
    if is_inside(a, b) or is_inside(b, a):
        raise InputError(f"the {a_what} ({a}) and the {b_what} ({b}) overlap: one is the other or lies inside it",
                         f"choose a {b_what} outside the {a_what}, and not containing it")


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
        try:  # a .lock that is a link must not let us truncate a file elsewhere, nor a FIFO block us
            fd = open_regular(self.path, os.O_RDWR | os.O_CREAT)
        except NotRegularFileError as e:
            raise UnsafePathError(f"{self.path} is {e.strerror}", "remove it; the cache must hold plain files") from None
        try:
            self._take(fd)
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

    #: Without --wait, how long a build tries before it says the lock is held. A boot check's probe
    #: (lock_is_held) holds a shared lock for microseconds: a build that met it failed with "another
    #: process is building" although none was (seen under load in tests/faults/test_concurrency.py).
    #: A real build holds the lock for seconds, so a second build still fails at once.
    PROBE_GRACE_S = 0.2

    def _take(self, fd: int) -> None:
        if self.wait:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        deadline = time.monotonic() + self.PROBE_GRACE_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def lock_is_held(root: Path) -> bool:
    """True while a build holds CACHE/.lock (a probe that takes and drops a shared lock)."""
    path = root / ".lock"
    try:
        fd = open_regular(path)
    except OSError:  # none, or not a plain file: no build can hold it
        return False
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
