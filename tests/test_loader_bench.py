"""The loader benchmark runs end to end at a tiny size and reports every figure (speed is not asserted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_loader.py"


@pytest.mark.slow  # ~11 s: builds a 2-layer cache of H=1024 experts
def test_bench_runs_at_a_tiny_size(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_loader", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.run(40_000_000, workers=(2,), reps=1, workdir=str(tmp_path), big_layers=False)
    for key in ("load_vs_read", "load_cpu_hash_vs_read", "load_vs_source", "load_vs_batched_scheme"):
        assert res[key] > 0, key
    assert res["load_bytes"] > 0 and res["layers"] == 2
    assert res["batched_scheme"]["tail_layers"] == 2  # 2 layers: no full batch of 12, all "tail"
