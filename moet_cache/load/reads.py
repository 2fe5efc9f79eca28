"""The engine's reads: a job's byte ranges, checked against the file and dtype x shape, read with
`os.preadv` (the GIL is released; pread is safe from many threads on one descriptor) and hashed as
they arrive when verifying. Every read checks the load's stop flag.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ..errors import InputError, VerificationError
from ..fsutil import FileId, file_id, resolve_inside
from ..hashing import new_hasher
from ..stheader import DTYPES as STDTYPES
from ..stheader import nbytes as st_nbytes
from ..stheader import storage_shape, torch_dtype
from ..verify.report import Problem, ProblemKind
from .plan import Job, Read, changed_since_opened
from .shard import windows

try:  # the optional C extension (setup.py builds it where a C compiler is present)
    from .. import _preads
except ImportError:  # pragma: no cover - depends on the install
    _preads = None


class Stopped(Exception):
    """A worker saw the stop flag (another worker failed, or the consumer went away)."""


def storage(dtype: str, shape: tuple[int, ...]) -> tuple[torch.dtype, tuple[int, ...], int]:
    """(torch dtype, storage shape, bytes) of a safetensors dtype and header shape (F4: the packed bytes)."""
    if dtype not in STDTYPES:
        raise InputError(f"the loader cannot read dtype {dtype}")
    try:
        return torch_dtype(dtype), storage_shape(dtype, tuple(shape)), st_nbytes(dtype, tuple(shape))
    except ValueError as e:
        raise InputError(str(e)) from None


def check_read(r: Read, file_size: int) -> None:
    """The range spans exactly dtype x shape and lies inside the file (the manifest may be damaged)."""
    _, _, n = storage(r.dtype, r.shape)
    if r.nbytes != n:
        raise VerificationError(f"{r.path}: tensor {r.name} ({r.where}) spans {r.nbytes} bytes, "
                                f"its dtype {r.dtype} and shape {list(r.shape)} need {n}",
                                "the manifest is damaged; run moet-cache build again")
    if r.runs and max(run.end for run in r.runs) > r.end - r.begin:
        raise VerificationError(f"{r.path}: tensor {r.name} ({r.where}): a share reaches past the tensor's bytes",
                                "the manifest is damaged; run moet-cache build again")
    if r.end > file_size:
        raise VerificationError(f"{r.path}: tensor {r.name} ({r.where}) ends at byte {r.end}, "
                                f"the file has {file_size}", "the file is truncated; run moet-cache build again")


def mismatch(r: Read) -> VerificationError:
    return VerificationError(
        f"{r.path}: tensor {r.name} ({r.where}) does not match its xxh3-128 digest",
        "the cache is corrupt: run moet-cache verify --full, then moet-cache build to repair it",
        [Problem(ProblemKind.DIGEST, r.path, "contents differ from the manifest (xxh3-128 mismatch)", r.layer, r.name)])


def check_digest(r: Read, hasher: Any) -> None:
    """hasher (None: not verifying this tensor) has taken all of r's bytes: they must match its digest."""
    if hasher is not None and hasher.hexdigest() != r.xxh3:
        raise mismatch(r)


class Files:
    """Open file descriptors of one load (pread is safe from many threads on one descriptor), and the
    load's stop flag: every read checks it, so a stop ends every worker at its next read."""

    def __init__(self, root: Path, opened: Mapping[str, FileId] | None = None) -> None:
        self.root = root
        self.opened = opened  # each listed file as the cache was opened: what every descriptor must be
        self.stop = threading.Event()
        self._fds: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def _open(self, rel: str) -> tuple[int, int]:
        with self._lock:
            got = self._fds.get(rel)
            if got is None:
                fd = os.open(resolve_inside(self.root, rel), os.O_RDONLY)
                st = os.fstat(fd)
                if self.opened is not None and self.opened.get(rel) != file_id(st):
                    os.close(fd)
                    raise changed_since_opened(rel)
                got = (fd, st.st_size)
                self._fds[rel] = got
            return got

    def check(self, r: Read) -> None:
        check_read(r, self._open(r.path)[1])

    def read(self, r: Read, pos: int, dst: np.ndarray) -> None:
        """Bytes [pos, pos + len(dst)) of tensor r into dst (a part of a pinned slot, or of a host tensor);
        of a share (r.runs), its pieces one after another: only the share's bytes are read."""
        if self.stop.is_set():
            raise Stopped
        fd = self._open(r.path)[0]
        mv = memoryview(dst)
        if not r.runs:
            self._pread(fd, r, r.begin + pos, mv)
            return
        at = 0
        for run, k, skip, take in windows(r.runs, pos, len(dst)):
            self._pread_run(fd, r, r.begin + run.first + k * run.stride, run.piece, run.stride, skip,
                            mv[at:at + take])
            at += take
            if self.stop.is_set():
                raise Stopped

    def _pread_run(self, fd: int, r: Read, offset: int, piece: int, stride: int, skip: int,
                   mv: memoryview) -> None:
        """mv from pieces of `piece` bytes every `stride` from offset, the first `skip` bytes left out: one
        call of the C extension (a piece can be a few hundred bytes: one pread each, without the GIL), or
        a pread a piece in Python where it is not built."""
        if _preads is not None:
            if _preads.pread_runs(fd, mv, offset, piece, stride, skip) != len(mv):
                raise VerificationError(f"{r.path}: file ended inside tensor {r.name} ({r.where})",
                                        "the file was truncated while loading; run moet-cache build again")
            return
        at, begin = 0, offset + skip
        while at < len(mv):
            n = min(piece - skip, len(mv) - at)
            self._pread(fd, r, begin, mv[at:at + n])
            at += n
            begin += stride - skip
            skip = 0

    def _pread(self, fd: int, r: Read, begin: int, mv: memoryview) -> None:
        done = 0
        while done < len(mv):
            got = os.preadv(fd, [mv[done:]], begin + done)
            if got <= 0:
                raise VerificationError(f"{r.path}: file ended inside tensor {r.name} ({r.where})",
                                        "the file was truncated while loading; run moet-cache build again")
            done += got
            if self.stop.is_set():
                raise Stopped

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


def read_host(files: Files, job: Job, chunk: int, verify_hash: bool) -> dict[str, torch.Tensor]:
    """A job's tensors into host memory, each into its own preallocated tensor, a chunk at a time,
    hashed as it arrives when verifying (xxhash releases the GIL on large buffers)."""
    out: dict[str, torch.Tensor] = {}
    for r in job.reads:
        files.check(r)
        tdt, shape, n = storage(r.dtype, r.shape)
        flat = torch.empty(n, dtype=torch.uint8)
        dst = flat.numpy()
        h = new_hasher() if verify_hash and r.xxh3 else None
        for pos in range(0, n, chunk):
            piece = dst[pos:pos + chunk]
            files.read(r, pos, piece)
            if h is not None:
                h.update(piece)
        check_digest(r, h)
        out[r.name] = flat.view(tdt).reshape(shape)
    return out


__all__ = ["Files", "Stopped", "check_digest", "check_read", "mismatch", "read_host", "storage"]
