"""A streaming safetensors writer: the header first, then each tensor's bytes in order, in bounded memory.

The safetensors library writes whole dicts from memory; a layer of base planes is gigabytes, so we
lay out the header ourselves (the format is a u64 length, a JSON header, a flat buffer) and every
test reads our files back with the safetensors library.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .fsutil import create_temp_for, fsync_dir, raise_if_disk_full, start_writeback
from .hashing import new_hasher, xxh3_file_hex
from .stheader import DTYPES, nbytes

WRITEBACK_BYTES = 16 << 20  # start the writeback of a file every this many bytes written (fsutil.start_writeback)

# bytes an element of each dtype with whole-byte elements (F4, two a byte, is handled by stheader.nbytes)
DTYPE_SIZES = {d.name: d.itemsize for d in DTYPES.values() if d.itemsize}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class WrittenTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int
    xxh3: str


@dataclass(frozen=True)
class WrittenFile:
    size: int
    xxh3: str
    tensors: tuple[WrittenTensor, ...]
    hash_seconds: float = 0.0  # how long re-reading and hashing the written file took (a speed sample)


def header_bytes(specs: list[TensorSpec], metadata: dict[str, str] | None) -> tuple[bytes, list[int]]:
    """The length-prefixed, space-padded JSON header and each tensor's data offset."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offsets, pos = [], 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        offsets.append(pos)
        pos += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return len(raw).to_bytes(8, "little") + raw, offsets


class SafetensorsWriter:
    """Writes one safetensors file to a temp name; commit() fsyncs, hashes and renames it into place.

    Each tensor's bytes must arrive in order (chunks appended), tensors in any interleaving.
    """

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None, *,
                 writeback_bytes: int = WRITEBACK_BYTES) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names")
        self.path = path
        self.specs = {s.name: s for s in specs}
        self._order = names
        head, offsets = header_bytes(specs, metadata)
        self._data_start = len(head)
        self._begin = {s.name: self._data_start + o for s, o in zip(specs, offsets)}
        self._filled = {n: 0 for n in names}
        self._hashers = {n: new_hasher() for n in names}
        self._unsynced = 0  # bytes written since the last start_writeback
        self._writeback_bytes = writeback_bytes
        self.size = self._data_start + sum(s.nbytes for s in specs)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd, self._tmp = create_temp_for(path)
        try:
            if hasattr(os, "posix_fallocate") and self.size:
                os.posix_fallocate(self._fd, 0, self.size)  # fail now, not half-way, when the disk is short
            self._pwrite(head, 0)
        except OSError as e:
            self.abort()
            raise_if_disk_full(e, self.size, path)
            raise

    def _pwrite(self, data: bytes | memoryview, pos: int) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = os.pwrite(self._fd, view, pos)
            view, pos = view[n:], pos + n

    def write(self, name: str, data: np.ndarray | bytes | memoryview) -> None:
        """Append the next chunk of tensor `name`."""
        buf = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)) \
            if isinstance(data, np.ndarray) else memoryview(data).cast("B")
        spec = self.specs[name]
        filled = self._filled[name]
        if filled + buf.nbytes > spec.nbytes:
            raise ValueError(f"too many bytes for tensor {name}")
        try:
            self._pwrite(buf, self._begin[name] + filled)
        except OSError as e:
            self.abort()
            raise_if_disk_full(e, self.size, self.path)
            raise
        self._hashers[name].update(buf)
        self._filled[name] = filled + buf.nbytes
        self._unsynced += buf.nbytes
        if self._unsynced >= self._writeback_bytes:
            start_writeback(self._fd)
            self._unsynced = 0

    def check_full(self) -> None:
        """Raise (and abort) unless every tensor has all its bytes."""
        short = [n for n in self._order if self._filled[n] != self.specs[n].nbytes]
        if short:
            self.abort()
            raise ValueError(f"tensors not fully written: {short[:3]}")

    def commit(self) -> WrittenFile:
        """Check every tensor is full, fsync, hash the file as written, rename it into place.

        May run on another thread than the writes (the build commits a layer while it reads the next).
        """
        self.check_full()
        try:
            os.fsync(self._fd)
        except OSError as e:
            self.abort()
            raise_if_disk_full(e, self.size, self.path)
            raise
        os.close(self._fd)
        self._fd = -1
        t0 = time.perf_counter()
        digest = xxh3_file_hex(self._tmp)
        hash_seconds = time.perf_counter() - t0
        os.replace(self._tmp, self.path)
        fsync_dir(self.path.parent)
        tensors = []
        for n in self._order:
            s = self.specs[n]
            b = self._begin[n]
            tensors.append(WrittenTensor(n, s.dtype, s.shape, b, b + s.nbytes, self._hashers[n].hexdigest()))
        return WrittenFile(self.size, digest, tuple(tensors), hash_seconds)

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.abort()
