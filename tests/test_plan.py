"""moet-cache plan: the CLI over the VRAM arithmetic (CliRunner, main() and one real process)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moet_cache import BuildOptions, build_cache, make_checkpoint, small_spec
from moet_cache.cli.app import app, main
from moet_cache.units import GIB

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("plan")
    src = make_checkpoint(d / "src", small_spec(seed=7, n_routed_experts=8, num_hidden_layers=3))
    build_cache(src, d / "cache", BuildOptions(delta_budget="25%"))
    return src, d / "cache"


def test_plan_json_of_a_cache_adds_up_and_fits(pair: tuple[Path, Path]) -> None:
    _, cache = pair
    r = CliRunner().invoke(app, ["plan", str(cache), "--json", "--gpu", "h100-80g", "--max-model-len", "4096"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["source"] == "cache" and doc["exact"] is True and doc["fits"] is True
    assert sum(doc["terms_bytes"].values()) == doc["need_bytes"]
    assert doc["budget_bytes"] == int(81559 * (1 << 20) * 0.96)
    assert doc["margin_bytes"] == doc["budget_bytes"] - doc["need_bytes"]
    assert doc["margin_gib"] == pytest.approx(doc["margin_bytes"] / GIB)
    # kv_lora_rank 128, rope 64; the preset's fp8_ds_mla needs a sparse indexer, which this model lacks: fp8
    assert doc["kv_bytes_per_token_per_layer"] == 128 + 64 and doc["settings"]["kv_cache_dtype"] == "fp8"
    assert doc["buys"]["delta_experts"] == [4, 16] and doc["buys"]["extra_delta_experts"] == 12
    assert doc["suggestions"] == []


def test_plan_that_does_not_fit_exits_1_and_says_what_would(pair: tuple[Path, Path],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    _, cache = pair
    # The model's whole 4,096-token context (the preset's, capped), 16,000 B a token a layer: 5 sequences do not fit.
    code = main(["plan", str(cache), "--gpu", "1GiB", "--max-num-seqs", "5", "--kv-bytes-per-token", "16000"])
    out = capsys.readouterr().out
    assert code == 1
    assert "does not fit" in out and "All figures in GiB" in out and "Deciding term: KV cache" in out
    assert "--max-model-len " in out and "--max-num-seqs 3" in out
    assert main(["plan", str(cache), "--gpu", "a-big-one"]) == 2
    assert "unknown GPU" in capsys.readouterr().err


def test_plan_of_a_checkpoint_in_a_real_process(pair: tuple[Path, Path]) -> None:
    src, cache = pair
    exe = shutil.which("moet-cache", path=str(BIN)) or str(BIN / "moet-cache")
    r = subprocess.run([exe, "plan", str(src), "--json", "--delta-budget", "25%", "--max-model-len", "4096"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    computed = json.loads(r.stdout)
    exact = json.loads(CliRunner().invoke(app, ["plan", str(cache), "--json", "--max-model-len", "4096"]).stdout)
    assert computed["source"] == "checkpoint" and computed["exact"] is False
    assert computed["terms_bytes"] == exact["terms_bytes"]


def test_unknown_attention_needs_kv_bytes_per_token(pair: tuple[Path, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    src = Path(shutil.copytree(pair[0], tmp_path / "src"))
    cfg = json.loads((src / "config.json").read_text())
    del cfg["kv_lora_rank"]
    (src / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", str(src)]) == 2
    assert "--kv-bytes-per-token" in capsys.readouterr().err
    assert main(["plan", str(src), "--kv-bytes-per-token", "100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kv_bytes_per_token_per_layer"] == 100 and doc["kv_bytes_per_token"] == 100 * 3
