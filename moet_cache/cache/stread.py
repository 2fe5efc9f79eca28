"""Tensors of one cache safetensors file, read through the read seam (fsutil: pread, never a map).

A file cut or failing while it is read is then a VerificationError that names it (the cache is damaged,
exit 1), never a SIGBUS that kills the process, as a memory map (safetensors' safe_open) would be.
Used by `verify --against`, which reads the whole cache beside the source.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import VerificationError
from ..fsutil import open_regular, pread_into, resolve_inside
from ..stheader import DTYPES, Entry, read_header_fd, storage_shape

REPAIR = "run moet-cache verify --full, then build the cache again"


class TensorFile:
    """One cache safetensors file, open, its header checked; tensors read on demand as raw bytes."""

    def __init__(self, root: Path, rel: str) -> None:
        self.rel = rel
        try:
            self._fd = open_regular(resolve_inside(root, rel))
        except OSError as e:
            raise VerificationError(f"{rel} cannot be opened ({e.strerror or e})", REPAIR) from None
        try:
            self.header = read_header_fd(self._fd, rel, VerificationError, VerificationError)
        except BaseException:
            os.close(self._fd)
            raise

    def keys(self) -> list[str]:
        return list(self.header.tensors)

    def _entry(self, name: str) -> Entry:
        ent = self.header.tensors.get(name)
        if ent is None:
            raise VerificationError(f"{self.rel} has no tensor {name}", REPAIR)
        return ent

    def _read(self, name: str, begin: int, n: int) -> np.ndarray:
        buf = np.empty(n, dtype=np.uint8)
        try:
            got = pread_into(self._fd, memoryview(buf), begin)
        except OSError as e:
            raise VerificationError(f"{self.rel} cannot be read ({e.strerror or e}) at tensor {name}",
                                    "check the disk; " + REPAIR) from None
        if got != n:
            raise VerificationError(f"{self.rel}: the file ends inside tensor {name} (cut while it was read?)",
                                    REPAIR)
        return buf

    def raw(self, name: str) -> np.ndarray:
        """The whole tensor's bytes, shaped (storage shape but the last dim, -1), as Checkpoint.get_raw is."""
        ent = self._entry(name)
        shape = storage_shape(ent.dtype, ent.shape) or (1,)
        return self._read(name, ent.begin, ent.end - ent.begin).reshape(*shape[:-1], -1)

    def row(self, name: str, i: int) -> np.ndarray:
        """The bytes of t[i] of a tensor t [N, ...], shaped as checkpoint.tensor_bytes(t[i]) would be."""
        ent = self._entry(name)
        if not ent.shape or not 0 <= i < ent.shape[0]:
            raise VerificationError(f"{self.rel}: tensor {name} has no row {i}", REPAIR)
        per = (ent.end - ent.begin) // ent.shape[0]
        data = self._read(name, ent.begin + i * per, per)
        return data.reshape(*storage_shape(ent.dtype, ent.shape)[1:-1], -1) if len(ent.shape) > 1 else data

    def array(self, name: str) -> np.ndarray:
        """The whole tensor as a numpy array of its dtype (numeric dtypes numpy has: scales, tables)."""
        ent = self._entry(name)
        np_name = DTYPES[ent.dtype].torch_name
        if ent.dtype == "F4" or not hasattr(np, np_name) or np_name.startswith("float8") or np_name == "bfloat16":
            raise VerificationError(f"{self.rel}: tensor {name} is {ent.dtype}, not a plain numeric tensor", REPAIR)
        return self._read(name, ent.begin, ent.end - ent.begin).view(np.dtype(np_name)).reshape(ent.shape)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["TensorFile"]
