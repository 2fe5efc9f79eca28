"""benchmarks/run.py at a tiny size, as a real process: it keeps working and its JSON keeps its keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["build_gbps", "read_direct_gbps", "build_vs_direct_read", "split_gbps", "verify_full_gbps",
        "read_cached_gbps", "verify_vs_read", "boot_check_s", "boot_check_ratio", "build_peak_rss_bytes",
        "build_peak_rss_bytes_small", "rss_growth", "zstd_planes_ratio", "zstd_scales_ratio"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--size", "3MiB", "--json",
                           "--no-gpu", "--workdir", str(work), "--boot-layers", "2", "--boot-experts", "4",
                           "--skip", "quick"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_benchmark_reports_every_figure(bench: dict) -> None:
    missing = [k for k in KEYS if k not in bench]
    assert not missing
    for k in KEYS:
        assert isinstance(bench[k], (int, float)) and bench[k] > 0, k
    assert "gpu_split_gbps" not in bench  # --no-gpu
    assert bench["build_vs_direct_read"] == pytest.approx(bench["build_gbps"] / bench["read_direct_gbps"])
    assert bench["verify_vs_read"] == pytest.approx(bench["verify_full_gbps"] / bench["read_cached_gbps"])
    assert set(bench["goals_met"]) >= {"build_vs_direct_read", "verify_vs_read", "boot_check_s", "rss_growth"}


def test_the_benchmark_measured_real_work(bench: dict) -> None:
    assert bench["verify_full_state"] == "verified"
    assert bench["boot_check_ok"] is True  # both boot fixtures passed `moet-cache verify` (exit 0)
    assert bench["boot_files"] == bench["boot_files_large"]  # same file count ...
    assert bench["boot_bytes_ratio"] > 20  # ... many times the bytes (~100x at 44 x 256; less at this size)
    assert bench["build_peak_rss_bytes"] > 50 << 20  # an interpreter with torch: a real child's peak
    assert bench["rss_sizes_bytes"][0] < bench["rss_sizes_bytes"][1]
    assert bench["zstd_planes_ratio"] > 0.9  # code planes barely compress


def test_the_cli_layout_names_match_the_checkpoint_module() -> None:
    # cli/demo.py spells them out so that loading the CLI does not import torch
    from moet_cache.source.checkpoint import COMPRESSED_TENSORS, MODELOPT
    from moet_cache.cli import demo
    assert (demo.MODELOPT, demo.COMPRESSED_TENSORS) == (MODELOPT, COMPRESSED_TENSORS)


def test_loading_the_cli_imports_neither_torch_nor_numpy() -> None:
    # torch's import alone is 2-6 s: `moet-cache verify` (the boot check) must not pay it
    code = ("import sys; from moet_cache.cli import app; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().replace("'", '"')) == []
