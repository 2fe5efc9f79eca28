"""Benchmark of the runtime loader (moet_cache.load) against its baselines, all in the same run.

Figures (throughputs over the same bytes, page cache warm; ratio > 1 means the loader is faster):
  load_vs_read     loader into host memory / a plain read of the same files        (goal >= 0.85)
  load_gpu_vs_h2d  loader into the GPU / a pinned host-to-device copy of the bytes (goal >= 0.7)
  load_vs_source   loader / reading the source's FP4 expert tensors with safetensors
                   and splitting them into planes at boot                          (goal >= 2.5)
  load_vs_batched_scheme  loader / the batched-layer scheme: 4 workers on batches of 12 layers,
                   safetensors tensor by tensor, synchronize + gc.collect + empty_cache per batch,
                   the last layers serially

    python benchmarks/bench_loader.py --size 4GiB [--device cuda:0] [--workers 4,8] [--json]
Importable: run(size_bytes, ...) -> dict.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from moet_cache.cache import layout as L
from moet_cache.build import BuildOptions, build_cache
from moet_cache.source.checkpoint import PROJECTIONS, open_checkpoint
from moet_cache.load import Tuning, open_cache
from moet_cache.codec.planes import split_planes
from moet_cache.source.synthetic import make_checkpoint, spec_for_size
from moet_cache.units import parse_size

BATCH, BATCHED_WORKERS = 12, 4  # the batched-layer scheme: 12 layers a batch on 4 workers


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _best(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def make_cache(work: Path, size_bytes: int, big_layers: bool = True) -> tuple[Path, Path]:
    """A synthetic checkpoint of about `size_bytes` of routed experts and its cache (default tier).

    big_layers: 64 experts of H=2048, I=1024 (~130 MB of cache a layer) so that per-layer fixed
    costs weigh about as little as in a real model (~1.7 GB a layer); else spec_for_size's shape.
    """
    spec = spec_for_size(size_bytes)
    if big_layers:
        H, I, E = 2048, 1024, 64
        per_layer = E * 3 * H * I * (0.5 + 1 / 16)
        spec = replace(spec, hidden_size=H, moe_intermediate_size=I, intermediate_size=2 * I, n_routed_experts=E,
                       num_hidden_layers=max(2, int(round(size_bytes / per_layer))) + spec.first_k_dense_replace)
    served = spec.num_hidden_layers - spec.first_k_dense_replace
    if served >= 20:  # 12k + 8 served layers, as a 44-layer model: 3 batches and a tail of 8
        served = max(20, (served - 8) // 12 * 12 + 8)
        spec = replace(spec, num_hidden_layers=served + spec.first_k_dense_replace)
    src = make_checkpoint(work / "src", spec)
    build_cache(src, work / "cache", BuildOptions())
    return src, work / "cache"


def _plain_read(paths: list[Path]) -> int:
    n = 0
    for p in paths:
        n += len(p.read_bytes())
    return n


def _loader(cache: Any, device: str, workers: int, verify: str = "boot", **kw: Any) -> tuple[int, list[float]]:
    """Load every layer; returns the bytes and the time at which each layer arrived."""
    t0 = time.perf_counter()
    n, arrivals = 0, []
    for layer in cache.load(device=device, verify=verify, workers=workers, **kw):
        n += layer.nbytes
        arrivals.append(time.perf_counter() - t0)
        del layer
    _sync(device)
    return n, arrivals


def _safetensors_layer(root: Path, layer: int, experts: tuple[int, ...], device: str) -> int:
    """One layer as a straightforward cache-backed loader would: safetensors, tensor by tensor."""
    n = 0
    out = {}
    with safe_open(str(root / L.base_file(layer)), framework="pt", device=device) as f:
        for name in f.keys():
            out[name] = f.get_tensor(name)
            n += out[name].numel() * out[name].element_size()
    if experts:
        with safe_open(str(root / L.PACK), framework="pt", device=device) as f:
            for which in (L.W13_DELTA, L.W2_DELTA):
                t = f.get_tensor(L.pack_tensor(layer, which))
                out[which] = t
                n += t.numel()
    return n


def batched_scheme(root: Path, device: str) -> dict[str, float]:
    """The batched-layer loader: 4 workers x batches of 12 layers, per-batch barrier + cleanup,
    and the layers that do not fill a batch loaded one by one at the end."""
    cache = open_cache(root)
    layers = list(cache.layers)
    idx = cache.delta_index
    full = len(layers) // BATCH * BATCH
    t0 = time.perf_counter()
    with ThreadPoolExecutor(BATCHED_WORKERS) as pool:
        for i in range(0, full, BATCH):
            batch = layers[i:i + BATCH]
            list(pool.map(lambda x: _safetensors_layer(root, x, idx.experts_of(x) or (), device), batch))
            _sync(device)
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    t_batches = time.perf_counter() - t0
    for x in layers[full:]:
        _safetensors_layer(root, x, idx.experts_of(x) or (), device)
    _sync(device)
    total = time.perf_counter() - t0
    return {"seconds": total, "batches_seconds": t_batches, "tail_seconds": total - t_batches,
            "tail_layers": len(layers) - full}


def source_split(src: Path, layers: list[int]) -> int:
    """The boot the cache replaces: read the FP4 expert tensors from the source and split them."""
    n = 0
    with open_checkpoint(src) as ck:
        for layer in layers:
            for e in range(ck.model.n_routed_experts):
                for proj in PROJECTIONS:
                    x = ck.read_expert(layer, e, proj)
                    split_planes(x.codes)
                    n += x.codes.nbytes + x.block_scale.numel()
    return n


def diagnose(cache: Any, device: str, workers: int) -> dict[str, float]:
    """Where a load's worker time goes: seconds summed over workers in read syscalls, waiting for a
    staging slot, waiting on copy events, and the load's wall time (a diagnostic, patched in)."""
    from moet_cache.load.staging import Slots
    sums = {"read": 0.0, "slot_wait": 0.0, "event_wait": 0.0}
    lock = __import__("threading").Lock()

    def timed(key: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    sums[key] += time.perf_counter() - t0
        return wrapper
    orig = (os.preadv, Slots.take, torch.cuda.Event.synchronize)
    os.preadv = timed("read", os.preadv)
    Slots.take = timed("slot_wait", Slots.take)
    torch.cuda.Event.synchronize = timed("event_wait", torch.cuda.Event.synchronize)
    try:
        t0 = time.perf_counter()
        nb = _loader(cache, device, workers, "none")[0]
        wall = time.perf_counter() - t0
    finally:
        os.preadv, Slots.take, torch.cuda.Event.synchronize = orig
    return {"wall_s": wall, "GBps": nb / wall / 1e9, **{f"{k}_s_all_workers": v for k, v in sums.items()}}


def _copy_and_sync(dev: torch.Tensor, host: torch.Tensor) -> None:
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()


def _h2d(nbytes: int, device: str, reps: int) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    go = partial(_copy_and_sync, dev, host)
    go()
    t = _best(go, reps)
    del go, host, dev
    torch.cuda.empty_cache()
    return nbytes / t


def run(size_bytes: int, device: str = "cpu", workers: tuple[int, ...] = (4,), reps: int = 3,
        workdir: str | None = None, keep: bool = False, with_source: bool = True,
        big_layers: bool = True, gpu_slots: tuple[tuple[int, int], ...] = ()) -> dict[str, Any]:
    """Build a synthetic cache of about `size_bytes` of experts and measure every figure on it."""
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="moet-bench-loader-"))
    res: dict[str, Any] = {"size_bytes": size_bytes, "device": device, "cpus": os.cpu_count()}
    try:
        t0 = time.perf_counter()
        src, root = make_cache(work, size_bytes, big_layers)
        res["setup_seconds"] = time.perf_counter() - t0
        print(f"[bench] cache built in {res['setup_seconds']:.1f} s", file=sys.stderr, flush=True)
        from moet_cache.verify import boot_check
        res["open_cache_seconds"] = _best(lambda: open_cache(root), reps)
        res["boot_check_seconds"] = _best(lambda: boot_check(root), reps)
        cache = open_cache(root)
        files = [root / L.base_file(x) for x in cache.layers] + [root / L.PACK]
        res["layers"] = len(cache.layers)
        res["file_bytes"] = sum(p.stat().st_size for p in files)
        _plain_read(files)  # the page cache is warm for every figure below
        read_t = _best(lambda: _plain_read(files), reps)
        res["plain_read_GBps"] = res["file_bytes"] / read_t / 1e9
        per_w: dict[str, Any] = {}
        for w in workers:
            for verify in ("none", "boot", "hash"):
                nb = [0]
                t = _best(lambda: nb.__setitem__(0, _loader(cache, "cpu", w, verify)[0]), reps)
                per_w[f"cpu_w{w}_{verify}_GBps"] = nb[0] / t / 1e9
        res.update(per_w)
        res["load_bytes"] = nb[0]
        best_cpu = max(v for k, v in per_w.items() if k.endswith("_boot_GBps"))
        res["load_cpu_GBps"] = best_cpu
        res["load_vs_read"] = best_cpu / res["plain_read_GBps"]
        res["load_cpu_hash_vs_read"] = max(v for k, v in per_w.items() if k.endswith("_hash_GBps")) / res["plain_read_GBps"]
        wbest = max(workers, key=lambda w: per_w[f"cpu_w{w}_boot_GBps"])
        if with_source:
            read_src = [p for p in src.iterdir() if p.suffix == ".safetensors"]
            _plain_read(read_src)
            ts = _best(lambda: source_split(src, list(cache.layers)), 1)
            res["source_split_seconds"] = ts
            res["load_cpu_seconds"] = res["load_bytes"] / best_cpu / 1e9
            res["load_vs_source"] = ts / res["load_cpu_seconds"]
        # The batched-layer scheme, and ours on the same device, with where the time goes at the end.
        dev = device
        print("[bench] cpu figures done", file=sys.stderr, flush=True)
        rep = min((batched_scheme(root, dev) for _ in range(reps)), key=lambda r: r["seconds"])
        res["batched_scheme"] = rep
        if dev.startswith("cuda"):
            fresh = open_cache(root)  # a first load pins its staging buffer: time it apart
            t0 = time.perf_counter()
            nb0 = _loader(fresh, dev, max(workers))[0]
            res["gpu_first_load_GBps"] = nb0 / (time.perf_counter() - t0) / 1e9
            fresh.release()
            for w in workers:
                for verify in ("none", "boot", "hash"):
                    nb = [0]
                    t = _best(lambda: nb.__setitem__(0, _loader(cache, dev, w, verify)[0]), reps)
                    res[f"gpu_w{w}_{verify}_GBps"] = nb[0] / t / 1e9
            wbest = max(workers, key=lambda w: res[f"gpu_w{w}_boot_GBps"])
            res["load_gpu_GBps"] = res[f"gpu_w{wbest}_boot_GBps"]
            for size, per_worker in gpu_slots:  # staging shapes to compare (slot bytes, slots a worker)
                shape = Tuning(gpu_slot=size, gpu_slots_per_worker=per_worker)
                for w in workers:
                    sweep = open_cache(root)
                    _loader(sweep, dev, w, "none", tuning=shape)  # pins this shape's staging once
                    nb = [0]
                    t = _best(lambda: nb.__setitem__(0, _loader(sweep, dev, w, "none", tuning=shape)[0]), reps)
                    res[f"gpu_slot{size >> 20}MiBx{per_worker}_w{w}_none_GBps"] = nb[0] / t / 1e9
                    sweep.release()
            try:  # a diagnostic only: never lose the figures above to it
                res["gpu_diagnosis"] = diagnose(cache, dev, wbest)
            except Exception as e:  # noqa: BLE001
                res["gpu_diagnosis"] = {"error": repr(e)}
            res["h2d_pinned_GBps"] = _h2d(res["load_bytes"], dev, reps) / 1e9
            res["load_gpu_vs_h2d"] = res["load_gpu_GBps"] / res["h2d_pinned_GBps"]
        ours = min((_loader(cache, dev, wbest)[1] for _ in range(reps)), key=lambda a: a[-1])
        k = rep["tail_layers"]
        res["ours_seconds"] = ours[-1]
        res["ours_workers"] = wbest
        res["ours_last_layers_seconds"] = ours[-1] - ours[-k - 1] if 0 < k < len(ours) else 0.0
        res["load_vs_batched_scheme"] = rep["seconds"] / ours[-1]
        return res
    finally:
        if not keep and not workdir:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="2GiB", help="routed-expert bytes of the synthetic checkpoint")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", default="4", help="comma-separated worker counts to try")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--no-source", action="store_true", help="skip the (slow) source-split baseline")
    ap.add_argument("--small-layers", action="store_true", help="spec_for_size's small layers (many per GiB)")
    ap.add_argument("--gpu-slots", default="", help="staging shapes to compare, e.g. 16MiB:3,8MiB:2,4MiB:2")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = run(parse_size(a.size), a.device, tuple(int(x) for x in a.workers.split(",")), a.reps,
              a.workdir, with_source=not a.no_source, big_layers=not a.small_layers,
              gpu_slots=tuple((parse_size(x.split(":")[0]), int(x.split(":")[1])) for x in a.gpu_slots.split(",") if x))
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        for k, v in res.items():
            print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
