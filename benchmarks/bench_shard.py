"""Benchmark of a rank's share loads (tensor and expert parallelism) against a whole load, in the same run.

Figures (throughput over the bytes each load hands out, host memory, page cache warm, best of --reps;
ratio 1 means a share loads at the whole load's GB/s):
  tp2_vs_whole         rank 0 of TP 2 (w2's columns: a piece of I/8 bytes in every row, by moet_cache._preads)
  tp2_python_vs_whole  the same through the Python loop that stands in where _preads is not built
  ep2_vs_whole         rank 0 of EP 2 (whole experts: one run of bytes a tensor)

    python benchmarks/bench_shard.py --size 1GiB [--workers 4] [--reps 3] [--json]
Importable: run(size_bytes, workers, reps) -> dict.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_loader import make_cache

from moet_cache.load import Shard, open_cache
from moet_cache.load import reads as load_reads
from moet_cache.units import parse_size


def _load(cache: Any, workers: int, shard: Shard | None) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = sum(layer.nbytes for layer in cache.load(verify="none", workers=workers, shard=shard))
    return n, time.perf_counter() - t0


def _best(cache: Any, workers: int, shard: Shard | None, reps: int) -> tuple[int, float]:
    runs = [_load(cache, workers, shard) for _ in range(reps)]
    return runs[0][0], min(t for _, t in runs)


def run(size_bytes: int, workers: int = 4, reps: int = 3) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="moet-bench-shard-") as tmp:
        _, root = make_cache(Path(tmp), size_bytes)
        cache = open_cache(root)
        _load(cache, workers, None)  # the page cache warm for every figure
        whole_n, whole_s = _best(cache, workers, None, reps)
        experts = cache.view.layers[cache.layers[0]].n_experts
        tp_n, tp_s = _best(cache, workers, Shard(None, 0, 2), reps)
        ep_n, ep_s = _best(cache, workers, Shard(tuple(range(experts // 2))), reps)
        c_reads = load_reads._preads
        load_reads._preads = None
        try:
            py_n, py_s = _best(cache, workers, Shard(None, 0, 2), reps)
        finally:
            load_reads._preads = c_reads
    whole = whole_n / whole_s
    out = {"bytes_whole": whole_n, "whole_gbps": whole / 1e9,
           "tp2_bytes": tp_n, "tp2_gbps": tp_n / tp_s / 1e9, "tp2_vs_whole": tp_n / tp_s / whole,
           "tp2_python_gbps": py_n / py_s / 1e9, "tp2_python_vs_whole": py_n / py_s / whole,
           "ep2_bytes": ep_n, "ep2_gbps": ep_n / ep_s / 1e9, "ep2_vs_whole": ep_n / ep_s / whole,
           "preads_built": c_reads is not None, "workers": workers, "reps": reps}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="routed-expert bytes of the synthetic checkpoint")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = run(parse_size(args.size, what="--size"), args.workers, args.reps)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for k, v in res.items():
            print(f"{k:22} {v:.3f}" if isinstance(v, float) else f"{k:22} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
