"""Probe: which way of moving page-cache file bytes into GPU memory is fastest on this machine.

Every figure is GB/s over the same files (page cache warm), beside the pinned host-to-device copy of
the same byte count in the same run. Not a test; run on a CUDA machine:
    python benchmarks/probe_gpu_paths.py --size 4GiB --file 224MiB [--json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly


def _best(fn: Callable[[], Any], reps: int) -> float:
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def _files(work: Path, total: int, per: int) -> list[Path]:
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    paths = []
    for i in range(total // per):
        p = work / f"f{i}"
        with open(p, "wb") as f:
            left = per
            while left:
                k = min(left, len(block))
                f.write(block[:k])
                left -= k
        paths.append(p)
    for p in paths:
        p.read_bytes()
    return paths


class Staged:
    """Workers fill pinned slots (pread or copy from a map) and copy each slot to the GPU on their stream."""

    def __init__(self, paths: list[Path], dev: torch.Tensor, workers: int, slot: int, slots: int,
                 mode: str) -> None:
        self.paths, self.dev, self.workers, self.slot, self.mode = paths, dev, workers, slot, mode
        self.per = paths[0].stat().st_size
        self.pinned = torch.empty(workers * slots * slot, dtype=torch.uint8, pin_memory=True)
        self.slots = [[(self.pinned[(w * slots + k) * slot:(w * slots + k + 1) * slot], torch.cuda.Event())
                       for k in range(slots)] for w in range(workers)]
        self.streams = [torch.cuda.Stream() for _ in range(workers)]
        self.chunks = [(fi, off) for fi in range(len(paths)) for off in range(0, self.per, slot)]

    def _work(self, w: int) -> None:
        stream, mine = self.streams[w], self.slots[w]
        i = 0
        for j in range(w, len(self.chunks), self.workers):
            fi, off = self.chunks[j]
            n = min(self.slot, self.per - off)
            buf, ev = mine[i % len(mine)]
            i += 1
            ev.synchronize()
            if self.mode == "pread":
                mv = memoryview(buf.numpy())[:n]
                done = 0
                while done < n:
                    done += os.preadv(self.fds[fi], [mv[done:]], off + done)
            else:
                buf[:n].copy_(self.arrs[fi][off:off + n])
            dst = fi * self.per + off
            with torch.cuda.stream(stream):
                self.dev[dst:dst + n].copy_(buf[:n], non_blocking=True)
                ev.record(stream)
        stream.synchronize()

    def __call__(self) -> None:
        # files opened and mapped inside the timed call: a real load maps them fresh (page faults count)
        self.fds = [os.open(p, os.O_RDONLY) for p in self.paths]
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if self.mode == "mmap_populate" else 0)
        self.maps = [mmap.mmap(fd, self.per, flags=flags, prot=mmap.PROT_READ) for fd in self.fds] \
            if self.mode != "pread" else []
        self.arrs = [torch.frombuffer(m, dtype=torch.uint8) for m in self.maps]
        try:
            with ThreadPoolExecutor(self.workers) as pool:
                list(pool.map(self._work, range(self.workers)))
        finally:
            self.arrs = []
            for m in self.maps:
                m.close()
            for fd in self.fds:
                os.close(fd)

    def close(self) -> None:
        pass


def _addr(m: mmap.mmap) -> int:
    return np.frombuffer(m, dtype=np.uint8).ctypes.data


class Registered:
    """Map each file, cudaHostRegister the mapping (read-only), DMA it straight from the page cache."""

    def __init__(self, paths: list[Path], dev: torch.Tensor, workers: int, populate: bool, chunk: int) -> None:
        self.paths, self.dev, self.workers, self.chunk = paths, dev, workers, chunk
        self.per = paths[0].stat().st_size
        self.populate = populate
        self.cudart = torch.cuda.cudart()
        self.times = {"map": 0.0, "register": 0.0, "copy": 0.0, "unregister": 0.0}
        self.lock = threading.Lock()

    def _add(self, k: str, t: float) -> None:
        with self.lock:
            self.times[k] += t

    def _file(self, fi: int, stream: torch.cuda.Stream) -> None:
        t0 = time.perf_counter()
        fd = os.open(self.paths[fi], os.O_RDONLY)
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if self.populate else 0)
        m = mmap.mmap(fd, self.per, flags=flags, prot=mmap.PROT_READ)
        os.close(fd)
        t1 = time.perf_counter()
        self._add("map", t1 - t0)
        base = _addr(m)
        regs = []
        for off in range(0, self.per, self.chunk):
            n = min(self.chunk, self.per - off)
            t2 = time.perf_counter()
            rc = self.cudart.cudaHostRegister(base + off, n, REGISTER_READ_ONLY)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {rc}")
            t3 = time.perf_counter()
            self._add("register", t3 - t2)
            src = torch.from_numpy(np.frombuffer(m, dtype=np.uint8, count=n, offset=off))
            with torch.cuda.stream(stream):
                self.dev[fi * self.per + off:fi * self.per + off + n].copy_(src, non_blocking=True)
            regs.append(base + off)
        stream.synchronize()
        t4 = time.perf_counter()
        for a in regs:
            self.cudart.cudaHostUnregister(a)
        self._add("unregister", time.perf_counter() - t4)
        del src
        m.close()

    def __call__(self) -> None:
        streams = [torch.cuda.Stream() for _ in range(self.workers)]
        def w(k: int) -> None:
            for fi in range(k, len(self.paths), self.workers):
                self._file(fi, streams[k])
        with ThreadPoolExecutor(self.workers) as pool:
            list(pool.map(w, range(self.workers)))


def pageable_direct(paths: list[Path], dev: torch.Tensor, workers: int, chunk: int) -> Callable[[], None]:
    per = paths[0].stat().st_size
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    maps = [mmap.mmap(fd, per, prot=mmap.PROT_READ) for fd in fds]
    arrs = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    streams = [torch.cuda.Stream() for _ in range(workers)]
    chunks = [(fi, off) for fi in range(len(paths)) for off in range(0, per, chunk)]
    def w(k: int) -> None:
        for j in range(k, len(chunks), workers):
            fi, off = chunks[j]
            n = min(chunk, per - off)
            with torch.cuda.stream(streams[k]):
                dev[fi * per + off:fi * per + off + n].copy_(arrs[fi][off:off + n], non_blocking=True)
        streams[k].synchronize()
    def go() -> None:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(w, range(workers)))
    return go


def main(argv: list[str] | None = None) -> int:
    from moet_cache.units import parse_size
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="4GiB")
    ap.add_argument("--file", default="224MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", default="4,8,16")
    ap.add_argument("--slots", default="16MiB:3,32MiB:2,64MiB:2")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    total, per = parse_size(a.size), parse_size(a.file)
    total = total // per * per
    workers = [int(x) for x in a.workers.split(",")]
    slots = [(parse_size(x.split(":")[0]), int(x.split(":")[1])) for x in a.slots.split(",")]
    work = Path(tempfile.mkdtemp(prefix="moet-probe-gpu-"))
    out: dict[str, Any] = {"bytes": total, "file_bytes": per, "cpus": os.cpu_count()}
    def note(k: str, v: Any) -> None:
        out[k] = v
        print(f"{k:40s} {v:.3f}" if isinstance(v, float) else f"{k:40s} {v}", file=sys.stderr, flush=True)
    try:
        t0 = time.perf_counter()
        paths = _files(work, total, per)
        note("setup_s", time.perf_counter() - t0)
        dev = torch.empty(total, dtype=torch.uint8, device="cuda")
        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        host.fill_(1)
        note("h2d_pinned_GBps", total / _best(lambda: dev.copy_(host, non_blocking=True), a.reps) / 1e9)
        def chunked() -> None:
            for off in range(0, total, 16 << 20):
                dev[off:off + (16 << 20)].copy_(host[off:off + (16 << 20)], non_blocking=True)
        note("h2d_pinned_16MiB_chunks_GBps", total / _best(chunked, a.reps) / 1e9)
        host = None  # give the pinned memory back before the staged runs (the closures are done with it)
        def plain() -> None:
            for p in paths:
                with open(p, "rb", buffering=0) as f:
                    f.readinto(buf)
        buf = bytearray(per)
        note("plain_read_1thread_GBps", total / _best(plain, a.reps) / 1e9)
        for mode in ("pread", "mmap", "mmap_populate"):
            for slot, k in slots:
                for w in workers:
                    s = Staged(paths, dev, w, slot, k, mode)
                    s()
                    note(f"{mode}_{slot >> 20}MiBx{k}_w{w}_GBps", total / _best(s, a.reps) / 1e9)
                    s.close()
                    del s
        for w in workers:
            go = pageable_direct(paths, dev, w, 16 << 20)
            go()
            note(f"pageable_direct_w{w}_GBps", total / _best(go, a.reps) / 1e9)
        check = torch.empty(per, dtype=torch.uint8)
        for populate in (False, True):
            for chunk in (per,):
                for w in (8,):
                    try:
                        r = Registered(paths, dev, w, populate, chunk)
                        r()
                        r.times = dict.fromkeys(r.times, 0.0)
                        t = _best(r, a.reps)
                        tag = f"register_{'pop' if populate else 'nopop'}_{chunk >> 20}MiB_w{w}"
                        note(f"{tag}_GBps", total / t / 1e9)
                        note(f"{tag}_thread_s", {k: round(v / a.reps, 4) for k, v in r.times.items()})
                    except Exception as e:  # noqa: BLE001
                        note("register_error", repr(e))
        check.copy_(dev[:per].cpu())
        note("bytes_equal_first_file", bool(torch.equal(check, torch.frombuffer(bytearray(paths[0].read_bytes()), dtype=torch.uint8))))
        t0 = time.perf_counter()
        pin = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        note("pin_alloc_1GiB_s", time.perf_counter() - t0)
        del pin
        if a.json:
            print(json.dumps(out, indent=1))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
