"""The runtime's loader: a verified cache into CPU or GPU memory at disk speed (docs/LOADER.md).

    cache = open_cache(path)                       # refuses an incomplete, stale or corrupt cache
    for layer in cache.load(device="cuda:0"):      # LoadedLayer(index, tensors, nbytes)
        ...
    for name, tensor in cache.load_dense(device="cuda:0"):
        ...

A bounded pipeline, not batches: worker threads read tensor byte ranges (absolute offsets from the
manifests, checked against the file size and dtype x shape) straight into preallocated tensors
(CPU) or into a shared pool of pinned staging slots that each worker copies to the GPU on its own
CUDA stream. Bytes in flight are bounded by `max_inflight`; a layer is yielded as soon as it is
complete; an error, a closed generator or Ctrl-C stops every worker and frees what they hold.
"""

from __future__ import annotations

import bisect
import json
import os
import queue
import threading
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from . import layout as L
from .enums import DeltaMode, VerifyMode
from .errors import InputError, VerificationError
from .expand import expand_projection, expand_scales
from .fsutil import resolve_inside
from .hashing import xxh3_file_hex, xxh3_hex
from .machine import usable_cores
from .manifest import DeltaIndex, FileEntry, LayerManifest, PartManifest, TensorEntry
from .progress import NullProgress, Progress
from .units import parse_size
from .stheader import DTYPES as STDTYPES
from .stheader import nbytes as st_nbytes
from .stheader import read_header, storage_shape, torch_dtype
from .verifier import (CORRUPT, INCOMPLETE, STALE, VERIFIED, CacheFiles, Problem, VerifyReport,
                       boot_check, load_cache_files)

DELTA_MODES = DeltaMode.names()
VERIFY_MODES = VerifyMode.names()
CHUNK = 8 << 20                 # one read on the CPU path: big enough for disk speed, small for the cache
GPU_SLOT = 32 << 20             # one pinned staging slot = one host-to-device copy
GPU_SLOTS_PER_WORKER = 2        # slots a worker may hold at most (staging = workers x this x GPU_SLOT)
GPU_JOBS_IN_FLIGHT = 3          # layers whose windows are queued at once (no hashing): enough to keep
                                # every worker busy across a layer's end, few enough to finish in order
DELTA_EXPERTS = "delta_experts"  # int64 [n]: which experts the w13_delta / w2_delta rows belong to


@dataclass(frozen=True)
class LoadedLayer:
    """One served MoE layer in memory: `index` is the model's layer number (docs/LOADER.md names)."""

    index: int
    tensors: dict[str, torch.Tensor]
    nbytes: int                      # bytes read from the cache for this layer


@dataclass(frozen=True)
class _Read:
    """One tensor's byte range in one cache file, and what it must be."""

    name: str
    path: str
    begin: int
    end: int
    dtype: str
    shape: tuple[int, ...]
    xxh3: str | None                 # None: the file has no per-tensor digest (the tier pack)
    where: str                       # for errors: "layer 7" or "dense"


@dataclass(frozen=True)
class _Job:
    key: int | str
    reads: tuple[_Read, ...]
    nbytes: int
    uses_pack: bool = False


class _Stopped(Exception):
    """A worker saw the stop flag (another worker failed, or the consumer went away)."""


def _storage(dtype: str, shape: tuple[int, ...]) -> tuple[torch.dtype, tuple[int, ...], int]:
    """(torch dtype, storage shape, bytes) of a safetensors dtype and header shape (F4: the packed bytes)."""
    if dtype not in STDTYPES:
        raise InputError(f"the loader cannot read dtype {dtype}")
    try:
        return torch_dtype(dtype), storage_shape(dtype, tuple(shape)), st_nbytes(dtype, tuple(shape))
    except ValueError as e:
        raise InputError(str(e)) from None


def _check_read(r: _Read, file_size: int) -> None:
    _, _, n = _storage(r.dtype, r.shape)
    if r.end - r.begin != n:
        raise VerificationError(f"{r.path}: tensor {r.name} ({r.where}) spans {r.end - r.begin} bytes, "
                                f"its dtype {r.dtype} and shape {list(r.shape)} need {n}",
                                "the manifest is damaged; run moet-cache build again")
    if r.end > file_size:
        raise VerificationError(f"{r.path}: tensor {r.name} ({r.where}) ends at byte {r.end}, "
                                f"the file has {file_size}", "the file is truncated; run moet-cache build again")


def parse_header(path: Path, rel: str) -> tuple[int, dict[str, tuple[str, tuple[int, ...], int, int]]]:
    """A cache safetensors file's tensors as name -> (dtype, shape, absolute begin, end), strictly checked
    (stheader.read_header; a bad file is a VerificationError)."""
    head = read_header(path, rel, VerificationError, VerificationError)
    return head.size, {n: (e.dtype, e.shape, e.begin, e.end) for n, e in head.tensors.items()}


# --- the pipeline --------------------------------------------------------------------------------
class _Files:
    """Open file descriptors of one load (pread is safe from many threads on one descriptor)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fds: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def fd(self, rel: str) -> tuple[int, int]:
        with self._lock:
            got = self._fds.get(rel)
            if got is None:
                fd = os.open(resolve_inside(self.root, rel), os.O_RDONLY)
                got = (fd, os.fstat(fd).st_size)
                self._fds[rel] = got
            return got

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


class _Slots:
    """Pinned staging slots shared by a GPU load's workers: one pinned buffer cut into `count` slots.

    Each slot carries the event of its last copy to the GPU; a worker waits on it only when it
    takes the slot again (FIFO, so the oldest copy), so reading, hashing and copying overlap.
    """

    def __init__(self, buffer: torch.Tensor, count: int, size: int) -> None:
        self.buffer = buffer
        self.q: queue.Queue[tuple[torch.Tensor, torch.cuda.Event]] = queue.Queue()
        for i in range(count):
            self.q.put((buffer[i * size:(i + 1) * size], torch.cuda.Event()))

    def take(self, stop: threading.Event) -> tuple[torch.Tensor, torch.cuda.Event]:
        while True:
            if stop.is_set():
                raise _Stopped
            try:
                return self.q.get(timeout=0.05)
            except queue.Empty:
                continue

    def give(self, buf: torch.Tensor, event: torch.cuda.Event) -> None:
        self.q.put((buf, event))

    def drain(self) -> None:
        """Wait for every copy still reading a slot, so the pinned buffer can be reused or freed."""
        while True:
            try:
                _, ev = self.q.get_nowait()
            except queue.Empty:
                return
            ev.synchronize()


class _PinnedPool:
    """Pinned host buffers kept by one Cache between its loads: pinning is slow (~0.5 s per GiB
    measured on the H200 machine), so a second load reuses the first one's staging buffer."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for i, b in enumerate(self._free):
                if b.numel() == nbytes:
                    return self._free.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free = [buf]  # keep one: the most recent size

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def _mismatch(r: _Read) -> VerificationError:
    return VerificationError(
        f"{r.path}: tensor {r.name} ({r.where}) does not match its xxh3-128 digest",
        "the cache is corrupt: run moet-cache verify --full, then moet-cache build to repair it",
        [Problem("digest", r.path, "contents differ from the manifest (xxh3-128 mismatch)",
                 int(r.where.split()[1]) if r.where.startswith("layer ") else None, r.name)])


def _short(r: _Read) -> VerificationError:
    return VerificationError(f"{r.path}: file ended inside tensor {r.name} ({r.where})",
                             "the file was truncated while loading; run moet-cache build again")


class _Pipeline:
    """Runs jobs on `workers` threads with at most `max_inflight` bytes read but not yet handed over."""

    def __init__(self, root: Path, device: torch.device, verify_hash: bool, workers: int,
                 max_inflight: int, finish: Callable[[_Job, dict[str, torch.Tensor], Any], dict[str, torch.Tensor]],
                 pinned: _PinnedPool | None = None) -> None:
        self.files = _Files(root)
        self.device = device
        self.hash = verify_hash
        self.workers = workers
        self.max_inflight = max_inflight
        self.finish = finish
        self.stop = threading.Event()
        self.local = threading.local()
        self.slots: _Slots | None = None
        self.window_pool: ThreadPoolExecutor | None = None
        self.pinned = pinned or _PinnedPool()
        if device.type == "cuda":
            # Staging = bytes in flight: GPU_SLOTS_PER_WORKER slots a worker (at least 2), never more than max_inflight.
            chunk = max(1 << 20, min(GPU_SLOT, max_inflight // (2 * workers)))
            count = max(2 * workers, min(GPU_SLOTS_PER_WORKER * workers, max_inflight // chunk))
            self.chunk = chunk
            self.slots = _Slots(self.pinned.take(count * chunk), count, chunk)
        else:
            self.chunk = CHUNK

    # each worker ---------------------------------------------------------------------------
    def _read_cpu(self, r: _Read, dst: np.ndarray) -> None:
        """Tensor r into dst, a chunk at a time, hashed as it arrives when verifying."""
        h = xxh3_128() if self.hash and r.xxh3 else None
        for pos in range(0, len(dst), self.chunk):
            piece = dst[pos:pos + self.chunk]
            self._read_piece(r, pos, piece)
            if h is not None:
                h.update(piece)  # xxhash releases the GIL on large buffers
        if h is not None and h.hexdigest() != r.xxh3:
            raise _mismatch(r)

    def _stream(self) -> torch.cuda.Stream:
        """This thread's copy stream (each worker thread copies on its own)."""
        stream = getattr(self.local, "stream", None)
        if stream is None:
            stream = self.local.stream = torch.cuda.Stream(device=self.device)
        return stream

    def _read_piece(self, r: _Read, pos: int, dst: np.ndarray) -> None:
        """Bytes [pos, pos + len(dst)) of tensor r into dst (a part of a pinned slot, or of a host tensor)."""
        if self.stop.is_set():
            raise _Stopped
        begin = r.begin + pos
        fd = self.files.fd(r.path)[0]
        mv, done = memoryview(dst), 0
        while done < len(dst):
            got = os.preadv(fd, [mv[done:]], begin + done)
            if got <= 0:
                raise _short(r)
            done += got
            if self.stop.is_set():
                raise _Stopped

    def _window(self, reads: Sequence[_Read], offs: list[int], sizes: list[int], win: int, wend: int,
                flat: torch.Tensor, ready: torch.cuda.Event, hashers: list[Any] | None = None) -> torch.cuda.Event:
        """flat[win:wend] (its pieces of the tensors laid out at offs) through one pinned slot to the
        device, on this thread's stream; returns an event that completes with the copy. hashers: the
        tensors' digests, updated in order (only when one thread does a job's windows in order)."""
        assert self.slots is not None
        stream = self._stream()
        buf, ev = self.slots.take(self.stop)
        try:
            ev.synchronize()  # the slot's previous copy to the GPU has finished (releases the GIL)
            arr = buf.numpy()
            ri = max(0, bisect.bisect_right(offs, win) - 1)
            while ri < len(reads) and offs[ri] < wend:
                a, b = max(win, offs[ri]), min(wend, offs[ri] + sizes[ri])
                if a < b:
                    piece = arr[a - win:b - win]
                    self._read_piece(reads[ri], a - offs[ri], piece)
                    if hashers is not None and hashers[ri] is not None:
                        hashers[ri].update(piece)
                ri += 1
            done = torch.cuda.Event()
            with torch.cuda.stream(stream):
                stream.wait_event(ready)  # flat's memory may be in use on the default stream until then
                flat[win:wend].copy_(buf[:wend - win], non_blocking=True)
                ev.record(stream)
                done.record(stream)
        finally:
            self.slots.give(buf, ev)
        return done

    def _gpu_job(self, job: _Job, stream: torch.cuda.Stream) -> dict[str, torch.Tensor]:
        """A job's tensors laid out (256-byte aligned) in ONE device buffer, moved window by window
        through the pinned slots: one copy and one event per window, whatever the tensor count (each
        CUDA call costs tens of microseconds on the virtual machines we run on). Without hashing the
        windows go to every worker at once, so a layer never waits on one thread; with hashing one
        thread reads them in order (a digest takes its bytes in order)."""
        reads, offs, sizes, pos = job.reads, [], [], 0
        for r in reads:
            _check_read(r, self.files.fd(r.path)[1])
            n = _storage(r.dtype, r.shape)[2]
            pos = (pos + 255) // 256 * 256
            offs.append(pos)
            sizes.append(n)
            pos += n
        flat = torch.empty(pos, dtype=torch.uint8, device=self.device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.default_stream(self.device))
        windows = [(w, min(w + self.chunk, pos)) for w in range(0, pos, self.chunk)]
        hashers = [xxh3_128() if self.hash and r.xxh3 else None for r in reads]
        if any(h is not None for h in hashers) or self.window_pool is None:
            events = [self._window(reads, offs, sizes, a, b, flat, ready, hashers) for a, b in windows]
        else:
            futs = [self.window_pool.submit(self._window, reads, offs, sizes, a, b, flat, ready) for a, b in windows]
            events = [f.result() for f in futs]
        for e in events:
            stream.wait_event(e)
        out: dict[str, torch.Tensor] = {}
        for r, h, o, n in zip(reads, hashers, offs, sizes):
            if h is not None and h.hexdigest() != r.xxh3:
                raise _mismatch(r)
            tdt, shape, _ = _storage(r.dtype, r.shape)
            out[r.name] = flat[o:o + n].view(tdt).reshape(shape)
        return out

    def run_job(self, job: _Job) -> dict[str, torch.Tensor]:
        if self.device.type == "cuda":
            stream = self._stream()
            out = self._gpu_job(job, stream)
            with torch.cuda.stream(stream):
                result = self.finish(job, out, stream)
            stream.synchronize()
            return result
        out = {}
        for r in job.reads:
            _check_read(r, self.files.fd(r.path)[1])
            tdt, shape, n = _storage(r.dtype, r.shape)
            flat = torch.empty(n, dtype=torch.uint8)
            self._read_cpu(r, flat.numpy())
            out[r.name] = flat.view(tdt).reshape(shape)
        return self.finish(job, out, None)

    # the consumer side -----------------------------------------------------------------------
    def run(self, jobs: Sequence[_Job], progress: Progress, what: str,
            before_yield: Callable[[_Job], None] | None = None) -> Iterator[tuple[_Job, dict[str, torch.Tensor]]]:
        pending = deque(jobs)
        running: dict[Future[dict[str, torch.Tensor]], _Job] = {}
        inflight = 0
        # CPU: the budget bounds bytes read but not yet yielded. GPU: the pinned slots bound
        # the staging bytes; jobs on the device are bounded by the workers.
        budget = self.max_inflight if self.slots is None else 1 << 62
        pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="moet-load")
        max_jobs = 2 * self.workers
        if self.slots is not None and not self.hash:
            # GPU without hashing: the workers share each job's windows (_gpu_job); the job threads only wait
            self.window_pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="moet-window")
            max_jobs = GPU_JOBS_IN_FLIGHT
        progress.start(sum(j.nbytes for j in jobs), what)
        try:
            while pending or running:
                while pending and len(running) < max_jobs and \
                        (not running or inflight + pending[0].nbytes <= budget):
                    job = pending.popleft()
                    inflight += job.nbytes
                    running[pool.submit(self.run_job, job)] = job
                done, _ = wait(list(running), timeout=0.25, return_when=FIRST_COMPLETED)
                for fut in done:
                    job = running.pop(fut)
                    tensors = fut.result()  # a worker's error ends the load here
                    inflight -= job.nbytes
                    if before_yield is not None:
                        before_yield(job)
                    progress.advance(job.nbytes)
                    if isinstance(job.key, int):
                        progress.layer_done(job.key)
                    yield job, tensors
        finally:
            # Error, Ctrl-C or an abandoned generator: stop every worker, drop what they hold.
            self.stop.set()
            for fut in running:
                fut.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            if self.window_pool is not None:
                self.window_pool.shutdown(wait=True, cancel_futures=True)
                self.window_pool = None
            running.clear()
            if self.slots is not None:
                self.slots.drain()  # the workers are gone and every copy from staging is done
                self.pinned.give(self.slots.buffer)
                self.slots = None
            self.files.close()
            progress.finish()


def xxh3_128() -> Any:
    import xxhash
    return xxhash.xxh3_128()


# --- the cache --------------------------------------------------------------------------------
def _refuse(report: VerifyReport, root: Path) -> VerificationError:
    first = "; ".join(p.describe() for p in report.problems[:3])
    more = f" (and {len(report.problems) - 3} more)" if len(report.problems) > 3 else ""
    return VerificationError(f"the cache at {root} is {report.state_text}: {first}{more}",
                             "run moet-cache verify for the details, then moet-cache build to repair it",
                             list(report.problems))


def _check_small(root: Path, fe: FileEntry) -> bytes:
    """A small file listed in cache.json, read and checked against its size and digest."""
    data = resolve_inside(root, fe.path).read_bytes()
    if len(data) != fe.size or xxh3_hex(data) != fe.xxh3:
        raise VerificationError(f"{fe.path} does not match cache.json", "run moet-cache build again")
    return data


class Cache:
    """An opened cache: its checked manifests; `load` and `load_dense` read it into memory."""

    def __init__(self, root: Path, files: CacheFiles, report: VerifyReport, index: DeltaIndex | None) -> None:
        self.root = root
        self.files = files
        self.report = report
        self.delta_index = index
        self._pinned = _PinnedPool()  # staging reused by this cache's GPU loads

    def release(self) -> None:
        """Free the pinned staging memory kept for the next GPU load."""
        self._pinned.clear()

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.files.layers))

    @property
    def lossless(self) -> bool:
        return self.files.manifest.build.lossless

    # planning --------------------------------------------------------------------------------
    def _layer_job(self, lm: LayerManifest, delta: DeltaMode, pack: dict[str, tuple[str, tuple[int, ...], int, int]]) -> _Job:
        where = f"layer {lm.layer}"
        roles = {f.path: f.role for f in lm.files}
        reads = [_Read(t.name, t.file, t.begin, t.end, t.dtype, t.shape, t.xxh3, where)
                 for t in lm.tensors if roles[t.file] == L.Role.BASE]
        geo = lm.geometry()
        have = {r.name: (r.dtype, r.shape) for r in reads}
        for name, (dtype, shape) in geo.required_shapes().items():
            if have.get(name) != (dtype, shape):
                got = have.get(name)
                raise VerificationError(f"layer {lm.layer}: tensor {name} is {got[0] + ' ' + str(list(got[1])) if got else 'missing'}, "
                                        f"the layer needs {dtype} {list(shape)}", "run moet-cache build again")
        uses_pack = False
        if delta == DeltaMode.ALL:
            reads += [_Read(t.name, t.file, t.begin, t.end, t.dtype, t.shape, t.xxh3, where)
                      for t in lm.tensors if roles[t.file] == L.Role.DELTA_ALL and t.name in (L.W13_DELTA, L.W2_DELTA)]
            if sum(r.name in (L.W13_DELTA, L.W2_DELTA) for r in reads) != 2:
                raise VerificationError(f"layer {lm.layer} lists no delta planes", "run moet-cache build again")
        elif delta == DeltaMode.TIER:
            experts = (self.delta_index.experts_of(lm.layer) if self.delta_index else None) or ()
            for spec in geo.delta_specs(len(experts)):
                if not experts:
                    continue
                which, shape = spec.name, spec.shape
                name = L.pack_tensor(lm.layer, which)
                got = pack.get(name)
                if got is None or got[0] != "U8" or got[1] != shape:
                    raise VerificationError(f"{L.PACK}: tensor {name} is missing or has the wrong shape "
                                            f"(the index names {len(experts)} experts)", "run moet-cache build again")
                reads.append(_Read(which, L.PACK, got[2], got[3], "U8", shape, None, where))
                uses_pack = True
        nbytes = sum(r.end - r.begin for r in reads)
        return _Job(lm.layer, tuple(reads), nbytes, uses_pack)

    def _finish_layer(self, delta: DeltaMode, expand: bool) -> Callable[[_Job, dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]:
        def finish(job: _Job, t: dict[str, torch.Tensor], stream: Any) -> dict[str, torch.Tensor]:
            lm = self.files.layers[int(job.key)]
            dev = t[L.W13_BASE].device
            if delta == DeltaMode.ALL:
                experts: tuple[int, ...] = tuple(range(lm.n_experts))
            elif delta == DeltaMode.TIER:
                experts = (self.delta_index.experts_of(lm.layer) if self.delta_index else None) or ()
                if not experts:  # the same names for every layer: empty delta planes
                    for spec in lm.geometry().delta_specs(0):
                        t[spec.name] = torch.empty(spec.shape, dtype=torch.uint8, device=dev)
            else:
                experts = ()
            if delta != DeltaMode.NONE:
                t[DELTA_EXPERTS] = torch.tensor(experts, dtype=torch.int64, device=dev)
            if expand:
                t = _expand_layer(lm, t, experts, delta != DeltaMode.NONE)
            if stream is not None:  # made on the worker's stream, used on the consumer's
                for v in t.values():
                    v.record_stream(torch.cuda.default_stream(dev))
            return t
        return finish

    # the API ---------------------------------------------------------------------------------
    def _check_verify(self, verify: VerifyMode | str) -> VerifyMode:
        return VerifyMode.of(verify, "verify")

    def _boot_gate(self) -> None:
        """verify='boot': the boot check must pass before anything is handed out."""
        report = boot_check(self.root)
        if report.state != VERIFIED:
            if report.state in (CORRUPT, INCOMPLETE, STALE):
                raise _refuse(report, self.root)
            raise VerificationError(
                f"the cache at {self.root} changed since its last verification "
                f"({report.problems[0].describe() if report.problems else 'no verification recorded'})",
                "run moet-cache verify --full once, or load with verify='hash'", list(report.problems))

    def load(self, device: str | torch.device = "cpu", delta: DeltaMode | str = DeltaMode.TIER,
             verify: VerifyMode | str = VerifyMode.BOOT, workers: int | None = None,
             max_inflight: str | int = "2GiB", progress: Progress | None = None,
             expand: bool = False, layers: Sequence[int] | None = None) -> Iterator[LoadedLayer]:
        """Yield every served layer (or those in `layers`) as it completes; see docs/LOADER.md."""
        dev = _device(device)
        workers = default_workers(dev) if workers is None else workers
        delta = DeltaMode.of(delta, "delta")
        if delta == DeltaMode.ALL and not self.lossless:
            raise InputError("delta='all' needs a --lossless cache (this one keeps only the tier's planes)",
                             "use delta='tier', or build with --lossless")
        if workers < 1:
            raise InputError(f"workers must be at least 1, got {workers}")
        budget = parse_size(max_inflight, what="max_inflight")
        if budget < 64 << 10:
            raise InputError(f"max_inflight must be at least 64 KiB, got {budget} bytes")
        verify = self._check_verify(verify)
        sel = self.layers if layers is None else tuple(layers)
        missing = [x for x in sel if x not in self.files.layers]
        if missing:
            raise InputError(f"the cache has no layer {missing[0]}", f"its layers are {list(self.layers)}")
        pack: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        pack_fe = self.files.manifest.file(L.Role.PACK)
        need_pack = delta == DeltaMode.TIER and any(self.delta_index and self.delta_index.experts_of(x) for x in sel)
        if need_pack:
            assert pack_fe is not None
            size, pack = parse_header(resolve_inside(self.root, pack_fe.path), pack_fe.path)
            if size != pack_fe.size:
                raise VerificationError(f"{pack_fe.path} is {size} bytes, cache.json says {pack_fe.size}",
                                        "run moet-cache build again")
        jobs = [self._layer_job(self.files.layers[x], delta, pack) for x in sel]
        return self._run_layers(jobs, dev, delta, verify, workers, budget, progress, expand, pack_fe if need_pack else None)

    def _run_layers(self, jobs: list[_Job], dev: torch.device, delta: DeltaMode, verify: VerifyMode, workers: int,
                    budget: int, progress: Progress | None, expand: bool, pack_fe: FileEntry | None) -> Iterator[LoadedLayer]:
        pipe = _Pipeline(self.root, dev, verify == VerifyMode.HASH, workers, budget, self._finish_layer(delta, expand),
                         self._pinned)
        pack_check: list[Future[str]] = []
        gate: list[Future[None]] = []
        side = ThreadPoolExecutor(max_workers=2, thread_name_prefix="moet-check") \
            if verify == VerifyMode.BOOT or (verify == VerifyMode.HASH and pack_fe) else None
        try:
            if side is not None and verify == VerifyMode.BOOT:
                # The boot check (stats and manifests) runs beside the first reads; no layer is
                # handed out before it passed.
                gate.append(side.submit(self._boot_gate))
            if side is not None and verify == VerifyMode.HASH and pack_fe is not None:
                # The pack has one digest for the whole file: hash it beside the loads, and let no
                # layer that uses it out before that digest matched.
                pack_check.append(side.submit(xxh3_file_hex, resolve_inside(self.root, pack_fe.path)))

            def before_yield(job: _Job) -> None:
                if gate:
                    gate[0].result()
                if job.uses_pack and pack_check and pack_fe is not None:
                    if pack_check[0].result() != pack_fe.xxh3:
                        raise VerificationError(f"{pack_fe.path} does not match its xxh3-128 digest",
                                                "the delta pack is corrupt: run moet-cache build again",
                                                [Problem("digest", pack_fe.path, "contents differ from cache.json")])
            for job, tensors in pipe.run(jobs, progress or NullProgress(), "load", before_yield):
                yield LoadedLayer(int(job.key), tensors, job.nbytes)
        finally:
            if side is not None:
                side.shutdown(wait=True, cancel_futures=True)

    def dense_entries(self) -> list[TensorEntry]:
        """Every dense tensor the cache holds (from the dense part manifests, digests checked)."""
        out: list[TensorEntry] = []
        dense_files = {f.path for f in self.files.manifest.files if f.role == L.Role.DENSE}
        for fe in self.files.manifest.files:
            if fe.role != L.Role.PART or not fe.path.startswith(L.DENSE_DIR + "/"):
                continue
            try:
                part = PartManifest.parse(json.loads(_check_small(self.root, fe)), fe.path)
            except ValueError:
                raise VerificationError(f"{fe.path} is not valid JSON", "run moet-cache build again") from None
            for t in part.tensors:
                if t.file not in dense_files:
                    raise VerificationError(f"{fe.path}: tensor {t.name} is in {t.file}, which cache.json does not list")
                out.append(t)
        return out

    def load_dense(self, device: str | torch.device = "cpu", verify: VerifyMode | str = VerifyMode.BOOT, workers: int | None = None,
                   max_inflight: str | int = "2GiB", progress: Progress | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (source name, tensor) for every dense tensor, with the checks of `load`."""
        dev = _device(device)
        workers = default_workers(dev) if workers is None else workers
        budget = parse_size(max_inflight, what="max_inflight")
        verify = self._check_verify(verify)
        if verify == VerifyMode.BOOT:
            self._boot_gate()
        entries = self.dense_entries()
        jobs: list[_Job] = []
        group: list[_Read] = []
        for t in entries:  # group small tensors: one job is ~64 MiB or one big tensor
            group.append(_Read(t.name, t.file, t.begin, t.end, t.dtype, t.shape, t.xxh3, "dense"))
            if sum(r.end - r.begin for r in group) >= 64 << 20:
                jobs.append(_Job(f"dense-{len(jobs)}", tuple(group), sum(r.end - r.begin for r in group)))
                group = []
        if group:
            jobs.append(_Job(f"dense-{len(jobs)}", tuple(group), sum(r.end - r.begin for r in group)))
        pipe = _Pipeline(self.root, dev, verify == VerifyMode.HASH, workers, max(budget, 1 << 20), lambda j, t, s: t,
                         self._pinned)
        for _, tensors in pipe.run(jobs, progress or NullProgress(), "load dense"):
            yield from tensors.items()


def default_workers(device: torch.device) -> int:
    """Reader threads when the caller names none: 4 into host memory; into a GPU, 12 (the fastest on
    the 16-core H200 machine, docs/LOADER.md), never more than the cores this process may use."""
    return 4 if device.type != "cuda" else min(12, usable_cores())


def _device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device must be 'cpu' or a CUDA device, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device {device!r} asked for, but this machine has no CUDA device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _expand_layer(lm: LayerManifest, t: dict[str, torch.Tensor], experts: tuple[int, ...],
                  with_delta: bool) -> dict[str, torch.Tensor]:
    """Planes -> the stock fused-MoE names (w13_weight, w2_weight, scales), for `expand=True`."""
    I, H = lm.intermediate_size, lm.hidden_size
    # On a GPU the planes share one buffer with the scales: copy the scales out so it can go.
    out = {k: (v.clone() if v.is_cuda else v) for k, v in t.items()
           if k not in (L.W13_BASE, L.W2_BASE, L.W13_DELTA, L.W2_DELTA, L.W13_TABLE, L.W2_TABLE, DELTA_EXPERTS)}
    tables13 = t[L.W13_TABLE].cpu().numpy()
    tables2 = t[L.W2_TABLE].cpu().numpy().reshape(lm.n_experts, 1, 4)
    rows13 = {e: t[L.W13_DELTA][k] for k, e in enumerate(experts)} if with_delta else {}
    rows2 = {e: t[L.W2_DELTA][k] for k, e in enumerate(experts)} if with_delta else {}
    out["w13_weight"] = expand_projection(t[L.W13_BASE], tables13, rows13, I)
    out["w2_weight"] = expand_projection(t[L.W2_BASE], tables2, rows2, H)
    for scale, scale_2, parts in ((L.W13_SCALE, L.W13_SCALE_2, 2), (L.W2_SCALE, L.W2_SCALE_2, 1)):
        if out[scale].dtype != torch.float8_e4m3fn:
            out[scale], out[scale_2] = expand_scales(out[scale], out[scale_2], parts)
    return out


def open_cache(path: str | os.PathLike[str], check_source: bool = True) -> Cache:
    """Open a cache for loading: manifests read and checked; incomplete, stale or corrupt is refused."""
    root = Path(path)
    report = boot_check(root, check_source=check_source)
    if report.state in (CORRUPT, INCOMPLETE, STALE):
        raise _refuse(report, root)
    files = load_cache_files(root)
    index = None
    idx_fe = files.manifest.file(L.Role.DELTA_INDEX)
    if idx_fe is not None:
        try:
            index = DeltaIndex.parse(json.loads(_check_small(root, idx_fe)), idx_fe.path)
        except ValueError:
            raise VerificationError(f"{idx_fe.path} is not valid JSON", "run moet-cache build again") from None
    return Cache(root, files, report, index)


__all__ = ["open_cache", "Cache", "LoadedLayer", "DELTA_EXPERTS", "DELTA_MODES", "VERIFY_MODES", "parse_header"]
