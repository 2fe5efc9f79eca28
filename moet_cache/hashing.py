"""xxh3-128 digests of buffers and files; the one hash the cache format uses."""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

ALGORITHM = "xxh3-128"
CHUNK = 16 << 20


def xxh3_hex(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def new_hasher() -> xxhash.xxh3_128:
    return xxhash.xxh3_128()


def xxh3_file_hex(path: str | os.PathLike[str], chunk: int = CHUNK) -> str:
    """Digest of a whole file, read in large chunks into one reused buffer."""
    h = xxhash.xxh3_128()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(Path(path), "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()
