"""CUDA staging: a job's tensors from the files into ONE device buffer through pinned host slots.

Each worker copies on its own CUDA stream; a layer's tensors are laid out 256-byte aligned in one
device allocation and moved window by window, one host-to-device copy and one event per window,
whatever the tensor count (each CUDA call costs tens of microseconds on the virtual machines we
run on). A slot is reused only after its last copy's event has completed, so reading, hashing and
copying overlap. Measurements and the choices they led to: docs/LOADER.md, "How it reads".
"""

from __future__ import annotations

import bisect
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import torch

from ..hashing import new_hasher
from .reads import Files, Stopped, check_digest, storage
from .options import LoadOptions
from .plan import Job, Read

ALIGN = 256                             # a tensor's start in the device buffer (CUDA's allocation alignment)


class Slots:
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
                raise Stopped
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


class PinnedPool:
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


def staging_shape(opts: LoadOptions) -> tuple[int, int]:
    """(slot bytes, slot count): gpu_slots_per_worker slots a worker (at least 2), never more than
    max_inflight bytes in all, no slot under 1 MiB."""
    workers, budget, tuning = opts.workers, opts.max_inflight, opts.tuning
    chunk = max(1 << 20, min(tuning.gpu_slot, budget // (2 * workers)))
    count = max(2 * workers, min(tuning.gpu_slots_per_worker * workers, budget // chunk))
    return chunk, count


class _Layout:
    """Where each of a job's tensors lies in its one device buffer (ALIGN-aligned), and the buffer size."""

    def __init__(self, reads: Sequence[Read]) -> None:
        self.reads = reads
        self.offs: list[int] = []
        self.sizes: list[int] = []
        pos = 0
        for r in reads:
            n = storage(r.dtype, r.shape)[2]
            pos = (pos + ALIGN - 1) // ALIGN * ALIGN
            self.offs.append(pos)
            self.sizes.append(n)
            pos += n
        self.total = pos

    def pieces(self, win: int, wend: int) -> Any:
        """(tensor index, begin, end) of flat[win:wend]'s parts of each tensor, in buffer order."""
        ri = max(0, bisect.bisect_right(self.offs, win) - 1)
        while ri < len(self.reads) and self.offs[ri] < wend:
            a, b = max(win, self.offs[ri]), min(wend, self.offs[ri] + self.sizes[ri])
            if a < b:
                yield ri, a, b
            ri += 1


class CudaStaging:
    """One GPU load's staging: the slots (from the Cache's PinnedPool), each worker thread's stream,
    and, without hashing, a pool that shares each job's windows among all workers."""

    def __init__(self, files: Files, opts: LoadOptions, pinned: PinnedPool) -> None:
        self.files = files
        self.device = opts.device
        self.hash = opts.verify_hash
        self.pinned = pinned
        self.chunk, count = staging_shape(opts)
        self.slots = Slots(pinned.take(count * self.chunk), count, self.chunk)
        self.local = threading.local()
        self.window_pool: ThreadPoolExecutor | None = None

    def share_windows(self, workers: int) -> bool:
        """Without hashing, a job's windows go to every worker at once, so a layer never waits on one
        thread (19 layers on 16 workers had left 13 idle for the second round); with hashing one thread
        reads them in order, since a digest takes its bytes in order. True when shared."""
        if not self.hash:
            self.window_pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moet-window")
        return self.window_pool is not None

    def stream(self) -> torch.cuda.Stream:
        """This thread's copy stream (each worker thread copies on its own)."""
        stream = getattr(self.local, "stream", None)
        if stream is None:
            stream = self.local.stream = torch.cuda.Stream(device=self.device)
        return stream

    def _window(self, lay: _Layout, win: int, wend: int, flat: torch.Tensor, ready: torch.cuda.Event,
                hashers: list[Any] | None = None) -> torch.cuda.Event:
        """flat[win:wend] through one pinned slot to the device, on this thread's stream; returns an
        event that completes with the copy. hashers: the tensors' digests, updated in order (only when
        one thread does a job's windows in order)."""
        stream = self.stream()
        buf, ev = self.slots.take(self.files.stop)
        try:
            ev.synchronize()  # the slot's previous copy to the GPU has finished (releases the GIL)
            arr: np.ndarray = buf.numpy()
            for ri, a, b in lay.pieces(win, wend):
                piece = arr[a - win:b - win]
                self.files.read(lay.reads[ri], a - lay.offs[ri], piece)
                if hashers is not None and hashers[ri] is not None:
                    hashers[ri].update(piece)
            done = torch.cuda.Event()
            with torch.cuda.stream(stream):
                stream.wait_event(ready)  # flat's memory may be in use on the default stream until then
                flat[win:wend].copy_(buf[:wend - win], non_blocking=True)
                ev.record(stream)
                done.record(stream)
        finally:
            self.slots.give(buf, ev)
        return done

    def job(self, job: Job, stream: torch.cuda.Stream) -> dict[str, torch.Tensor]:
        """A job's tensors as views of one device buffer, complete on `stream` when this returns."""
        for r in job.reads:
            self.files.check(r)
        lay = _Layout(job.reads)
        flat = torch.empty(lay.total, dtype=torch.uint8, device=self.device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.default_stream(self.device))
        windows = [(w, min(w + self.chunk, lay.total)) for w in range(0, lay.total, self.chunk)]
        hashers = [new_hasher() if self.hash and r.xxh3 else None for r in job.reads]
        if any(h is not None for h in hashers) or self.window_pool is None:
            events = [self._window(lay, a, b, flat, ready, hashers) for a, b in windows]
        else:
            futs = [self.window_pool.submit(self._window, lay, a, b, flat, ready) for a, b in windows]
            events = [f.result() for f in futs]
        for e in events:
            stream.wait_event(e)
        out: dict[str, torch.Tensor] = {}
        for r, h, o, n in zip(job.reads, hashers, lay.offs, lay.sizes):
            check_digest(r, h)
            tdt, shape, _ = storage(r.dtype, r.shape)
            out[r.name] = flat[o:o + n].view(tdt).reshape(shape)
        return out

    def close(self) -> None:
        """After the workers are gone: stop the window pool, wait for every copy out of staging, and
        give the pinned buffer back to the pool for the next load."""
        if self.window_pool is not None:
            self.window_pool.shutdown(wait=True, cancel_futures=True)
            self.window_pool = None
        self.slots.drain()
        self.pinned.give(self.slots.buffer)


__all__ = ["ALIGN", "CudaStaging", "PinnedPool", "Slots", "staging_shape"]
