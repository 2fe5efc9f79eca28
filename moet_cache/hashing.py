"""xxh3-128 digests of buffers and files; the one hash the cache format uses."""

from __future__ import annotations

import os

import xxhash

from .fsutil import open_regular, pread_into

ALGORITHM = "xxh3-128"
CHUNK = 16 << 20


def xxh3_hex(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def new_hasher() -> xxhash.xxh3_128:
    return xxhash.xxh3_128()


def xxh3_file_hex(path: str | os.PathLike[str], chunk: int = CHUNK, follow: bool = False) -> str:
    """Digest of a whole plain file, read with pread in large chunks into one reused buffer.

    Through fsutil's read seam, and never through a map: a page that cannot be read (a failing disk,
    a file truncated meanwhile) must be an OSError that the caller reports, not a SIGBUS that kills
    the process. The reads release the GIL, so several files hash in parallel threads.
    """
    h = xxhash.xxh3_128()
    fd = open_regular(path, follow=follow)  # follow: a source's file (hub snapshots are links)
    try:
        size = os.fstat(fd).st_size
        # A buffer no larger than the file: zero-filling 16 MiB for each small manifest cost ~7 ms.
        buf = memoryview(bytearray(max(1, min(chunk, size + 1))))
        pos = 0
        while True:
            n = pread_into(fd, buf, pos)
            if not n:
                break
            h.update(buf[:n])
            pos += n
            if n < buf.nbytes:
                break
    finally:
        os.close(fd)
    return h.hexdigest()
