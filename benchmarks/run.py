"""The moet-cache speed benchmark: build, verify and boot against the disk, in one run.

    python benchmarks/run.py [--size 4GiB] [--json] [--workdir DIR] [--keep]

Makes a synthetic checkpoint of the given size and measures each figure beside its baseline on the
same bytes, in the same run (so a loaded or slow machine moves both): the build against a direct
(page-cache-bypassing) read of the source, the full verify against a plain cached read of the cache,
the plane split against the lookup-table split it replaced, the boot check of a 44 x 256-expert cache
against the same check on a cache 100x larger, the build's peak RSS at two sizes, zstd on planes and
scales, and on a CUDA device the GPU split against a pinned host-to-device copy.

This is a script, not a test: tests run it at a tiny size only to keep it working.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

from moet_cache.units import fmt_gib, parse_size

READ_CHUNK = 8 << 20
MIN_SECONDS = 0.5  # each kernel figure is the best of repeated runs lasting at least this long
BOOT_RUNS = 5

# --- the checkpoints -----------------------------------------------------------------------------


def bench_spec(total_bytes: int, seed: int = 0) -> Any:
    """Routed-expert bytes near total_bytes: DeepSeek-like shapes (32 experts), scaled down for small sizes."""
    from moet_cache.source.synthetic import SyntheticSpec
    # From 1 GiB, DeepSeek-sized rows (1-2 MiB tensors: what the GPU path is for); below, smaller ones.
    H, I, E = (2048, 1024, 32) if total_bytes >= 1 << 30 else (1024, 512, 32) if total_bytes >= 256 << 20 \
        else (256, 128, 16)
    per_layer = E * 3 * H * I * (0.5 + 1 / 16)
    layers = max(2, int(round(total_bytes / per_layer)))
    return SyntheticSpec(hidden_size=H, moe_intermediate_size=I, intermediate_size=2 * I, n_routed_experts=E,
                         num_experts_per_tok=4, num_hidden_layers=layers + 1, first_k_dense_replace=1,
                         num_nextn_predict_layers=0, shard_bytes=512 << 20, seed=seed, fast_codes=True,
                         vocab_size=1024)


def boot_spec(layers: int, experts: int, scale: int) -> Any:
    """A manifest-shaped cache: `layers` MoE layers of `experts` experts, tiny tensors (x scale per side)."""
    from moet_cache.source.synthetic import SyntheticSpec
    return SyntheticSpec(hidden_size=32 * scale, moe_intermediate_size=16 * scale, intermediate_size=32,
                         n_routed_experts=experts, n_shared_experts=0, num_experts_per_tok=2,
                         num_hidden_layers=layers + 1, first_k_dense_replace=1, num_nextn_predict_layers=0,
                         vocab_size=64, shard_bytes=512 << 20, fast_codes=True)


def tree_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in tree_files(root))


# --- reading -------------------------------------------------------------------------------------


def drop_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to forget these files' cached pages (clean pages only: fsync first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_direct(paths: list[Path]) -> tuple[float, int, str]:
    """Seconds and bytes to read the files past the page cache: O_DIRECT, else a dropped-cache read."""
    buf = mmap.mmap(-1, READ_CHUNK)  # page-aligned, as O_DIRECT wants
    total, method = 0, "O_DIRECT"
    t0 = time.perf_counter()
    for p in paths:
        total_before = total
        try:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
            try:
                while (n := os.readv(fd, [buf])) > 0:
                    total += n
            finally:
                os.close(fd)
        except (OSError, AttributeError):  # no O_DIRECT here (tmpfs, macOS): drop the pages, read plainly
            total, method = total_before, "fadvise-dropped"
            drop_page_cache([p])
            with open(p, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
    return time.perf_counter() - t0, total, method


def read_and_write(paths: list[Path], write_bytes: int, dest: Path, sync_every: int | None = 64 << 20) -> float:
    """Seconds to read the files (cold, buffered) while writing write_bytes to dest, at once.

    The build's own disk work with no computing: its floor on this disk (reads and writes share it).
    The writes go out as the build's do: writeback started every 16 MiB (fsutil.start_writeback) and
    an fsync every `sync_every` bytes (a layer), not one burst at the end, which a real build cannot
    do (its writes are many times the dirty-page limit). sync_every=None: the burst (one fsync at the
    end, no writeback hints), kept as a second figure.
    """
    import threading

    from moet_cache.fsutil import start_writeback
    drop_page_cache(paths)
    block = os.urandom(16 << 20)

    def read() -> None:
        buf = bytearray(READ_CHUNK)
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass

    def write() -> None:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left, unsynced = write_bytes, 0
            while left > 0:
                n = os.write(fd, block[: min(left, len(block))])
                left, unsynced = left - n, unsynced + n
                if sync_every is None:
                    continue
                start_writeback(fd)
                if unsynced >= sync_every:
                    os.fsync(fd)
                    unsynced = 0
            os.fsync(fd)
        finally:
            os.close(fd)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=read), threading.Thread(target=write)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.perf_counter() - t0
    dest.unlink()
    return secs


def read_cached(paths: list[Path]) -> tuple[float, int]:
    """Seconds and bytes for a plain read of the files into one reused buffer (from the page cache)."""
    buf = bytearray(16 << 20)
    total = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return time.perf_counter() - t0, total


# --- the build in a child process (its peak RSS is the child's alone) ------------------------------

_BUILD_CHILD = """
import json, sys, time
from moet_cache import BuildOptions, build_cache
from moet_cache.build.options import BuildTuning
from moet_cache.cli.build import host_kernel_from_env, split_device_from_env
t0 = time.perf_counter()
# the environment as `moet-cache build` reads it (MOET_CACHE_SPLIT_DEVICE, MOET_CACHE_KERNELS: A/B runs)
tuning = BuildTuning(split_device=split_device_from_env(), host_kernel=host_kernel_from_env())
r = build_cache(sys.argv[1], sys.argv[2], BuildOptions(delta_budget=sys.argv[3], tuning=tuning))
print(json.dumps({"seconds": time.perf_counter() - t0, "source_bytes": r.source_bytes,
                  "cache_bytes": r.cache_bytes}))
"""


def build_in_child(src: Path, cache: Path, budget: str = "10%") -> dict[str, Any]:
    """Run build_cache in a fresh interpreter; return its figures and its own peak RSS (from wait4)."""
    if cache.exists():
        shutil.rmtree(cache)
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-c", _BUILD_CHILD, str(src), str(cache), budget],
                                stdout=subprocess.PIPE, stderr=err)
        assert proc.stdout is not None
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # reap it ourselves: wait4 gives this child's rusage
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"the build failed: {err.read().decode()[-2000:]}")
    doc = json.loads(out.decode().strip().splitlines()[-1])
    doc["peak_rss_bytes"] = int(usage.ru_maxrss) * 1024  # Linux reports KiB
    return doc


# --- kernels ---------------------------------------------------------------------------------------


def rate(fn: Callable[[], Any], nbytes: int, min_seconds: float | None = None) -> float:
    """Best-of bytes per second of fn over repeated runs lasting at least min_seconds (MIN_SECONDS)."""
    fn()
    best, spent, limit = float("inf"), 0.0, MIN_SECONDS if min_seconds is None else min_seconds
    while best == float("inf") or spent < limit:  # at least one timed run
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return nbytes / best


def on_threads(fn: Callable[[np.ndarray], Any], tensors: list[np.ndarray], workers: int) -> Callable[[], Any]:
    pool = ThreadPoolExecutor(max_workers=workers)

    def run() -> None:
        list(pool.map(fn, tensors))
    return run


def expert_samples(src: Path, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(codes, float32 block scales) of the first `count` expert projections of the first MoE layer."""
    import torch

    from moet_cache.source.checkpoint import PROJECTIONS, open_checkpoint
    out = []
    with open_checkpoint(src) as ck:
        layer = ck.model.main_moe_layers()[0]
        for e in range(ck.model.n_routed_experts):
            for proj in PROJECTIONS:
                x = ck.read_expert(layer, e, proj)
                out.append((x.codes.copy(), x.block_scale.to(torch.float32).numpy().copy()))
                if len(out) >= count:
                    return out
    return out


def kernel_figures(samples: list[tuple[np.ndarray, np.ndarray]], workers: int,
                   min_seconds: float = MIN_SECONDS) -> dict[str, float]:
    from moet_cache.codec import planes as P
    codes = [c for c, _ in samples]
    nbytes = sum(c.nbytes for c in codes)

    def lut_split(c: np.ndarray) -> Any:  # the split this project shipped first: two 64 Ki lookups
        w = np.ascontiguousarray(c).view("<u2")
        return np.take(P._BASE_LUT, w), np.take(P._DELTA_LUT, w)

    def all_kernels(sc: tuple[np.ndarray, np.ndarray]) -> Any:
        c, s = sc
        P.split_planes(c)
        P.error_and_energy(c, s, P.fit_table(P.code_histogram(c)))

    one = codes[:3]
    one_bytes = sum(c.nbytes for c in one)
    return {
        "split_gbps": rate(on_threads(P.split_planes, codes, workers), nbytes, min_seconds) / 1e9,
        "split_1core_gbps": rate(lambda: [P.split_planes(c) for c in one], one_bytes, min_seconds) / 1e9,
        "split_lut_1core_gbps": rate(lambda: [lut_split(c) for c in one], one_bytes, min_seconds) / 1e9,
        "histogram_1core_gbps": rate(lambda: [P.code_histogram(c) for c in one], one_bytes, min_seconds) / 1e9,
        "error_energy_1core_gbps": rate(lambda: [P.error_and_energy(c, s, P.DEFAULT_TABLE) for c, s in samples[:3]],
                                        one_bytes, min_seconds) / 1e9,
        "plane_kernels_gbps": rate(on_threads(all_kernels, samples, workers), nbytes, min_seconds) / 1e9,
    }


def gpu_figures(nbytes: int = 1 << 30) -> dict[str, Any]:
    """The split on the GPU (device bytes per second) beside a pinned host-to-device copy of the same bytes."""
    import torch
    if not torch.cuda.is_available():
        return {}
    from moet_cache.codec.planes import split_planes, split_planes_torch
    rows = nbytes // 7168
    host = torch.randint(0, 256, (rows, 7168), dtype=torch.uint8).pin_memory()
    dev = host.cuda()
    sample = host[:512].numpy()
    b, d = split_planes_torch(dev[:512])
    cb, cd = split_planes(sample)
    exact = bool(np.array_equal(b.cpu().numpy(), cb) and np.array_equal(d.cpu().numpy(), cd))

    def timed(fn: Callable[[], Any], reps: int = 10) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    split_s = timed(lambda: split_planes_torch(dev))
    copy_s = timed(lambda: dev.copy_(host, non_blocking=True))
    return {"gpu_split_gbps": host.numel() / split_s / 1e9, "gpu_h2d_pinned_gbps": host.numel() / copy_s / 1e9,
            "gpu_split_exact": exact, "gpu_name": torch.cuda.get_device_name(0)}


def zstd_figures(cache: Path, sample_bytes: int = 64 << 20, min_seconds: float = MIN_SECONDS) -> dict[str, float]:
    """zstd (level 3) ratio and decompression speed on base planes and FP8 block scales of the cache."""
    import zstandard
    from safetensors import safe_open

    from moet_cache.cache import layout as L
    from moet_cache.source.checkpoint import tensor_bytes
    base_files = sorted((cache / L.LAYERS_DIR).glob("*.safetensors")) if (cache / L.LAYERS_DIR).is_dir() else []
    planes, scales = bytearray(), bytearray()
    for f in base_files:
        with safe_open(str(f), framework="pt") as h:
            names = set(h.keys())
            for name, dest in ((L.W13_BASE, planes), (L.W13_SCALE, scales)):
                if name in names and len(dest) < sample_bytes:
                    dest += tensor_bytes(h.get_tensor(name)).tobytes()[: sample_bytes - len(dest)]
    out: dict[str, float] = {}
    for key, data in (("planes", bytes(planes)), ("scales", bytes(scales))):
        if not data:
            continue
        comp = zstandard.ZstdCompressor(level=3).compress(data)
        dctx = zstandard.ZstdDecompressor()
        out[f"zstd_{key}_ratio"] = len(comp) / len(data)
        out[f"zstd_{key}_decompress_gbps"] = rate(lambda: dctx.decompress(comp), len(data), min_seconds) / 1e9
        out[f"zstd_{key}_compress_gbps"] = rate(lambda: zstandard.ZstdCompressor(level=3).compress(data), len(data), min_seconds) / 1e9
    return out


# --- the boot check as a process --------------------------------------------------------------------


def boot_seconds(cache: Path, runs: int = BOOT_RUNS) -> tuple[float, int]:
    """Median wall time of `moet-cache verify CACHE` (interpreter start included) and its exit code."""
    exe = shutil.which("moet-cache") or ""
    cmd = [exe, "verify", str(cache), "--json"] if exe else [sys.executable, "-m", "moet_cache.cli.app",
                                                              "verify", str(cache), "--json"]
    times, rc = [], 0
    for _ in range(runs):
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        times.append(time.perf_counter() - t0)
    return statistics.median(times), rc


def boot_figures(work: Path, layers: int, experts: int, runs: int = BOOT_RUNS) -> dict[str, Any]:
    from moet_cache import BuildOptions, build_cache, full_verify, make_checkpoint
    out: dict[str, Any] = {"boot_layers": layers, "boot_experts": experts}
    caches = {}
    for name, scale in (("small", 1), ("large", 12)):  # 12x per side: ~100x the cache bytes (manifests do not grow)
        src = make_checkpoint(work / f"boot-{name}-src", boot_spec(layers, experts, scale))
        cache = work / f"boot-{name}-cache"
        build_cache(src, cache, BuildOptions(delta_budget="10%"))
        full_verify(cache)  # the boot check then finds it "verified"
        caches[name] = cache
        shutil.rmtree(src)
    small, large = caches["small"], caches["large"]
    out["boot_files"] = len(tree_files(small))
    out["boot_files_large"] = len(tree_files(large))
    out["boot_bytes_ratio"] = tree_bytes(large) / tree_bytes(small)
    s, rc_small = boot_seconds(small, runs)
    big, rc_large = boot_seconds(large, runs)
    out.update(boot_check_s=s, boot_check_large_s=big, boot_check_ratio=big / s,
               boot_check_ok=rc_small == 0 and rc_large == 0)
    exe = shutil.which("moet-cache")
    t0 = time.perf_counter()
    subprocess.run([exe or "true", "--version"], stdout=subprocess.DEVNULL)
    out["cli_start_s"] = time.perf_counter() - t0  # the floor: the interpreter and the CLI's imports
    return out


# --- the run ----------------------------------------------------------------------------------------


def make_source(family: str, path: Path, size: int, seed: int = 0) -> tuple[Path, int]:
    """A synthetic checkpoint of about `size` routed-expert bytes; (its folder, its largest expert tensor's bytes).

    v3: DeepSeek-V3-like NVFP4 (bench_spec). v4: DeepSeek-V4-Flash-shaped (H 4096, I 2048, 32 experts a
    layer), the -0731 hybrid's NVFP4 main experts cast from MXFP4 (their scales stored compact, e8m0 per 32).
    """
    from moet_cache import make_checkpoint
    from moet_cache.source.synthetic import make_v4_checkpoint, v4_spec_for_size
    if family == "v4":
        v4 = v4_spec_for_size(size, seed=seed)
        return make_v4_checkpoint(path, v4), v4.hidden_size * v4.moe_intermediate_size // 2
    spec = bench_spec(size, seed)
    return make_checkpoint(path, spec), spec.hidden_size * spec.moe_intermediate_size // 2


def run(size: int, work: Path, boot_layers: int = 44, boot_experts: int = 256,
        rss_small_size: int | None = None, gpu: bool = True, skip: frozenset[str] = frozenset(),
        family: str = "v3") -> dict[str, Any]:
    from moet_cache import full_verify
    from moet_cache.build.options import plane_workers
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
        "cpu": platform.processor() or platform.machine(), "cores": plane_workers(),
        "size_requested": size, "family": family,
    }
    small_size = rss_small_size or max(size // 4, 1)
    src_small = make_source(family, work / "src-small", small_size, seed=1)[0] if "rss" not in skip else None
    src, largest = make_source(family, work / "src", size)
    files = tree_files(src)
    res["source_bytes"] = sum(p.stat().st_size for p in files)
    res["largest_source_tensor_bytes"] = largest

    # The disk: a direct read of the source, then the build from a cold page cache.
    drop_page_cache(files)
    secs, nread, method = read_direct(files)
    res["read_direct_gbps"], res["read_direct_method"] = nread / secs / 1e9, method
    drop_page_cache(files)
    b = build_in_child(src, work / "cache")
    res["build_gbps"] = b["source_bytes"] / b["seconds"] / 1e9
    res["build_seconds"] = b["seconds"]
    res["build_vs_direct_read"] = res["build_gbps"] / res["read_direct_gbps"]
    # The floor of the build on this disk: read the source and write the cache's bytes at once, no compute.
    res["io_floor_seconds"] = read_and_write(files, b["cache_bytes"], work / "io-floor.tmp")
    res["io_floor_burst_seconds"] = read_and_write(files, b["cache_bytes"], work / "io-floor.tmp", None)
    res["build_vs_io_floor"] = res["io_floor_seconds"] / b["seconds"]
    res["build_peak_rss_bytes"] = b["peak_rss_bytes"]
    res["rss_bound_bytes"] = (2 << 30) + 2 * res["largest_source_tensor_bytes"]
    if src_small is not None:
        rss_small = build_in_child(src_small, work / "cache-small")
        res["build_peak_rss_bytes_small"] = rss_small["peak_rss_bytes"]
        res["rss_sizes_bytes"] = [tree_bytes(src_small), res["source_bytes"]]
        res["rss_growth"] = b["peak_rss_bytes"] / rss_small["peak_rss_bytes"]
        shutil.rmtree(work / "cache-small")
        shutil.rmtree(src_small)

    # The plane kernels alone, on real expert tensors of this checkpoint.
    samples = expert_samples(src, 48)
    quick = 0.0 if "quick" in skip else MIN_SECONDS
    res.update(kernel_figures(samples, res["cores"], quick))
    res["split_vs_lut"] = res["split_1core_gbps"] / res["split_lut_1core_gbps"]

    # Verification against a plain read of the same cache files, both from the page cache.
    cache = work / "cache"
    cfiles = tree_files(cache)
    read_cached(cfiles)  # warm
    secs, nread = read_cached(cfiles)
    res["read_cached_gbps"] = nread / secs / 1e9
    rep = full_verify(cache)
    res["verify_full_gbps"] = rep.bytes_hashed / rep.seconds / 1e9
    res["verify_full_state"] = rep.state
    res["verify_vs_read"] = res["verify_full_gbps"] / res["read_cached_gbps"]
    if "zstd" not in skip:
        res.update(zstd_figures(cache, min_seconds=quick))
    shutil.rmtree(src)
    shutil.rmtree(cache)
    if "boot" not in skip:
        res.update(boot_figures(work, boot_layers, boot_experts, 1 if "quick" in skip else BOOT_RUNS))
    if gpu:
        res.update(gpu_figures())
    return res


GOALS = [  # (key, comparison, target) from the issue
    ("build_vs_direct_read", ">=", 1.0), ("verify_vs_read", ">=", 0.8), ("boot_check_s", "<", 1.0),
    ("boot_check_ratio", "<=", 1.2), ("rss_growth", "<=", 1.2), ("split_gbps", ">=", 2.0),
    ("gpu_split_gbps", ">=", 20.0),
]


def goal_status(res: dict[str, Any]) -> dict[str, bool]:
    out = {}
    for key, op, target in GOALS:
        if key in res:
            v = res[key]
            out[key] = v >= target if op == ">=" else v < target if op == "<" else v <= target
    if "build_peak_rss_bytes" in res:
        out["build_peak_rss_bytes"] = res["build_peak_rss_bytes"] < res["rss_bound_bytes"]
    return out


def render(res: dict[str, Any]) -> str:
    goals = {k: (op, t) for k, op, t in GOALS}
    ok = res.get("goals_met", {})
    lines = [f"moet-cache benchmark, {res['date']}, {res['host']}, {res['cores']} cores, "
             f"source {fmt_gib(res['source_bytes'])}"]
    for k, v in res.items():
        if k in ("date", "host", "goals_met"):
            continue
        shown = f"{v:.3f}" if isinstance(v, float) else str(v)
        goal = f"  (goal {goals[k][0]} {goals[k][1]}: {'met' if ok.get(k) else 'NOT met'})" if k in goals else ""
        if k == "build_peak_rss_bytes":
            goal = f"  (goal < {fmt_gib(res['rss_bound_bytes'])}: {'met' if ok.get(k) else 'NOT met'})"
        lines.append(f"  {k:34s} {shown}{goal}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="4GiB", help="routed-expert bytes of the synthetic checkpoint")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--workdir", help="where to write checkpoints and caches (the disk being measured)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--boot-layers", type=int, default=44)
    ap.add_argument("--boot-experts", type=int, default=256)
    ap.add_argument("--rss-small-size", help="the second, smaller size for rss_growth (default size/4)")
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--family", choices=("v3", "v4"), default="v3",
                    help="v4: a DeepSeek-V4-Flash-shaped checkpoint (the -0731 hybrid's NVFP4 cast from MXFP4)")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: rss, zstd, boot; "
                    "'quick' times each figure once (for tests; the figures are then rough)")
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    base = Path(args.workdir) if args.workdir else None
    if base:
        base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="moet-bench-", dir=base))
    try:
        res = run(size, work, args.boot_layers, args.boot_experts,
                  parse_size(args.rss_small_size) if args.rss_small_size else None, not args.no_gpu,
                  frozenset(filter(None, args.skip.split(","))), args.family)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    res["goals_met"] = goal_status(res)
    print(json.dumps(res, indent=1) if args.json else render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
