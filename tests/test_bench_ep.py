"""benchmarks/bench_moe.py --expert-parallel on the CPU at a small layer: the rows it writes, the pairs each rank
computes counted from the routing, the per-pair arithmetic, and each rank's layer and call against the simple
exact versions (tests/parallel_ref.py, the whole layer with the other ranks' pairs skipped)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import summarize  # benchmarks/summarize.py: benchmarks/ is on the tests' path (pyproject.toml)
import torch

from moet_cache.load import Shard
from moet_cache.runtime import fused_moe
from moet_cache.runtime.synthetic_layer import random_layer
from parallel_ref import expert_map as ref_expert_map
from parallel_ref import linear, reference_share

ROOT = Path(__file__).resolve().parents[1]
E, K, H, I = 16, 4, 64, 64
TOKENS, SIZES = (1, 3, 33), (2, 4)


def _bench_moe(monkeypatch: pytest.MonkeyPatch):
    """benchmarks/bench_moe.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("bench_moe", ROOT / "benchmarks" / "bench_moe.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_moe", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


@pytest.fixture(scope="module")
def run_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ep") / "moe-ep.json"


@pytest.fixture(scope="module")
def run(run_file: Path) -> dict:
    out = run_file
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_moe.py"), "--expert-parallel",
                           ",".join(map(str, SIZES)), "--ep-layer", f"{E},{K},{H},{I}", "--tokens",
                           ",".join(map(str, TOKENS)), "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    doc["stdout"] = proc.stdout
    return doc


def test_every_rank_and_size_has_its_rows(run: dict) -> None:
    assert run["format"] == "moet-cache-benchmark-result" and run["device"] == "cpu"
    assert run["command"][:2] == ["benchmarks/bench_moe.py", "--expert-parallel"]
    rows = run["result"]
    layer = next(r for r in rows if r["what"] == "ep_layer")
    assert (layer["experts"], layer["top_k"], layer["hidden"], layer["inter"]) == (E, K, H, I)
    assert sorted((r["tokens"], r["harness"]) for r in rows if r["what"] == "ep_whole") == \
        [(T, "wall") for T in TOKENS]
    ranks = [r for r in rows if r["what"] == "ep_rank"]
    assert sorted((r["ep"], r["rank"], r["tokens"]) for r in ranks) == \
        sorted((n, rank, T) for n in SIZES for rank in range(n) for T in TOKENS)
    assert sorted((r["ep"], r["tokens"]) for r in rows if r["what"] == "ep") == \
        sorted((n, T) for n in SIZES for T in TOKENS)
    assert all(r["us"] > 0 for r in rows if r["what"] in ("ep_whole", "ep_rank"))
    # each rank computed exactly its part of the whole layer (the benchmark's own check, before timing)
    assert all(r["rel_diff_vs_whole"] == 0.0 for r in ranks)
    assert "over 1.05x:" in run["stdout"]


def test_pairs_are_counted_from_the_routing_and_the_ratios_from_them(run: dict,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's pairs are the routed ids its expert map gives a local id (counted here from the routing the
    benchmark drew, through the placement written out in parallel_ref); us a pair is us / pairs; the ratio
    is the ranks' summed time over every pair, against the whole layer's time over its pairs."""
    bench = _bench_moe(monkeypatch)
    rows = run["result"]
    for T in TOKENS:
        _, ids = bench.routing(T, 10 + T, E, K, "cpu")
        whole = next(r for r in rows if r["what"] == "ep_whole" and r["tokens"] == T)
        assert whole["pairs"] == T * K and whole["us_per_pair"] == pytest.approx(whole["us"] / (T * K))
        for n in SIZES:
            ranks = sorted((r for r in rows if r["what"] == "ep_rank" and (r["tokens"], r["ep"]) == (T, n)),
                           key=lambda r: r["rank"])
            for r in ranks:
                mine = ref_expert_map(linear(n, r["rank"], E), E)[ids.long()] >= 0
                assert r["pairs"] == int(mine.sum()) and r["experts"] == len(linear(n, r["rank"], E))
                assert r["us_per_pair"] == (pytest.approx(r["us"] / r["pairs"]) if r["pairs"] else None)
            assert sum(r["pairs"] for r in ranks) == T * K
            ep = next(r for r in rows if r["what"] == "ep" and (r["tokens"], r["ep"]) == (T, n))
            together = sum(r["us"] for r in ranks) / (T * K)
            worst = max(r["us_per_pair"] for r in ranks if r["pairs"])
            assert ep["ranks_us_per_pair"] == pytest.approx(together)
            assert ep["ratio"] == pytest.approx(together / whole["us_per_pair"])
            assert ep["worst_rank_ratio"] == pytest.approx(worst / whole["us_per_pair"])
            assert ep["over_goal"] == (ep["ratio"] > 1.05)
    assert any(r["pairs"] == 0 for r in rows if r["what"] == "ep_rank")  # T = 1 at N = 4 leaves a rank idle


def test_the_summary_shows_each_ratio(run: dict, run_file: Path) -> None:
    """benchmarks/summarize.py's section of such a results file: a row of each T and N, the ratio marked
    where it is over the goal."""
    text = summarize.summary([run_file])
    for r in (r for r in run["result"] if r["what"] == "ep"):
        row = (f"| wall | {r['tokens']} | {r['ep']} | {round(r['whole_us_per_pair'], 3):.4g} | "
               f"{round(r['ranks_us_per_pair'], 3):.4g} | {r['ratio']:.3f}" + (" (over 1.05)" if r["over_goal"] else "")
               + f" | {r['worst_rank_ratio']:.3f} |")
        assert row in text


def test_a_ranks_layer_and_call_are_its_share_of_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank's layer equals the simple exact share (reference_share: its experts' rows, its tier rows
    renumbered), its call (the method's: ids through to_local) equals the whole layer's output restricted to
    its pairs, and the ranks' outputs add up to the whole layer's (float32 activations: nothing rounded)."""
    bench = _bench_moe(monkeypatch)
    whole = random_layer(E, H, I, n_tier=5, e8m0=True, device="cpu", seed=7)
    w, ids = bench.routing(9, 5, E, K, "cpu")
    x = torch.randn((9, H), generator=torch.Generator().manual_seed(2))
    full = fused_moe(x, whole, w, ids, swiglu_limit=bench.SWIGLU_LIMIT)
    for n in (2, 4, 3):  # 3: the first 16 % 3 ranks hold one expert more
        total = torch.zeros_like(full)
        for rank in range(n):
            emap = bench.expert_map(n, rank, E)
            experts = bench.rank_experts(emap)
            assert experts == linear(n, rank, E) and torch.equal(emap, ref_expert_map(experts, E))
            layer = bench.rank_layer(whole, experts)
            want_layer = reference_share(whole, Shard(experts), E, I)
            assert sorted(layer) == sorted(want_layer)
            for name, t in want_layer.items():
                assert torch.equal(layer[name], t), name
            got = bench.layer_call(layer, x, w, ids, emap)()
            mine = emap[ids.long()] >= 0
            want = fused_moe(x, whole, w, torch.where(mine, ids, -1), swiglu_limit=bench.SWIGLU_LIMIT)
            assert bool(mine.any()) and torch.equal(got, want)
            total += got
        torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)


@pytest.mark.vllm
def test_the_placement_is_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench's expert map is vLLM's own (determine_expert_map, linear), remainders included."""
    vllm_map = pytest.importorskip("vllm.model_executor.layers.fused_moe.expert_map_manager",
                                   reason="vLLM is not installed").determine_expert_map
    bench = _bench_moe(monkeypatch)
    for n_experts, size in ((256, 2), (256, 8), (16, 3), (10, 4)):
        for rank in range(size):
            count, want, _ = vllm_map(size, rank, n_experts)
            got = bench.expert_map(size, rank, n_experts)
            assert torch.equal(got, want) and int((got >= 0).sum()) == count


def test_a_mid_tier_layer_is_not_cut_and_an_empty_one_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the loader: a rank's share of a layer with mid-tier experts is refused; the empty mid-tier tensors
    every layer of a cache with a mid tier carries go through as they are."""
    bench = _bench_moe(monkeypatch)
    layer = random_layer(E, H, I, n_tier=2, e8m0=True, device="cpu", seed=1, n_mid=2)
    with pytest.raises(ValueError, match="mid tier"):
        bench.rank_layer(layer, (0, 1))
    empty = {k: v[:0] if k.startswith(("mid_", "w13_mid", "w2_mid")) else v for k, v in layer.items()}
    share = bench.rank_layer(empty, (3, 4))
    assert share["w13_base"].shape[0] == 2 and share["mid_experts"].numel() == 0
    assert {k: v.shape for k, v in share.items() if "mid" in k} == {k: v.shape for k, v in empty.items() if "mid" in k}


@pytest.mark.parametrize("argv", [["--expert-parallel", "1"], ["--expert-parallel", "2", "--fidelity"],
                                  ["--expert-parallel", "2", "--ep-layer", "16,4,64"],
                                  ["--expert-parallel", "32", "--ep-layer", "16,4,64,64"]])
def test_bad_expert_parallel_options_are_usage_errors(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench_moe(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["bench_moe.py", *argv])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_run_times_ranks_that_compute_their_share(tmp_path: Path) -> None:
    """On the GPU at V4-Flash's dims (decode and prefill kernels, each timing a CUDA graph): every rank's row,
    and each rank's output within bf16 rounding of the whole layer's with the other ranks' pairs skipped."""
    out = tmp_path / "moe-ep.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_moe.py"), "--expert-parallel", "2",
                           "--tokens", "4,512", "--harness", "write", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["result"]
    ranks = [r for r in rows if r["what"] == "ep_rank"]
    assert sorted((r["rank"], r["tokens"]) for r in ranks) == [(0, 4), (0, 512), (1, 4), (1, 512)]
    assert all(r["rel_diff_vs_whole"] <= 1.5e-2 and r["note"] == "graph" for r in ranks)
    assert len([r for r in rows if r["what"] == "ep"]) == 2 and "DIFFERS" not in proc.stdout
