"""The quality ladder's CI version on the committed reference model (benchmarks/quality.py --short): the
default cache's KL to the FP4 model must stay within 10% of the figure recorded in
benchmarks/results/quality-ci.json. Plus the pieces the ladder's figures rest on."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from quality import mix_forms  # benchmarks/ is on the path: pyproject's [tool.pytest.ini_options] pythonpath
from quality_compare import differences
from quality_model.fp4export import mxfp4_export, mxfp4_fake
from quality_model.model import routed_from_weights
from quality_model.reference import unpack_nibbles
from quality_model.routed import routed_sum

from moet_cache.build import BuildOptions
from moet_cache.format.fp4 import E2M1_VALUES

ROOT = Path(__file__).resolve().parents[1]

RECORDED = ROOT / "benchmarks" / "results" / "quality-ci.json"


def test_default_cache_kl_to_fp4_stays_within_10_percent_of_the_recorded_figure() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--short", "--json-only",
                           "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)["models"]["mxfp4"]
    recorded = json.loads(RECORDED.read_text())["result"]["models"]["mxfp4"]
    assert [r["name"] for r in got["rows"]] == [r["name"] for r in recorded["rows"]]
    # the ladder's default cache is what the build writes by default (its manifest's base-table form)
    assert got["default_table_form"] == recorded["default_table_form"] == str(BuildOptions().base_table)
    # the default cache is lossy (a KL of 0 would mean the base planes were never used) ...
    assert got["default_kl"] > 0
    # ... and no worse than recorded, by more than 10%
    assert got["default_kl"] <= 1.10 * recorded["default_kl"], (got["default_kl"], recorded["default_kl"])


def test_the_ladders_routed_sum_is_bit_for_bit_the_models() -> None:
    # the ladder computes every row with routed_sum; its figures are the model's only if the bits are
    gen = torch.Generator().manual_seed(5)
    E, H, inter, k = 32, 64, 48, 4
    w13 = torch.randn((E, 2 * inter, H), generator=gen) * 0.05
    w2 = torch.randn((E, H, inter), generator=gen) * 0.05
    for tokens in (1, 7, 300):                  # a decode step, a short prompt, a scored window
        x = torch.randn((tokens, H), generator=gen)
        probs = torch.softmax(torch.randn((tokens, E - 3), generator=gen), -1)   # 3 experts never routed
        top_w, top_ids = probs.topk(k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        got = routed_sum(w13, w2)(x, top_w, top_ids)
        assert torch.equal(got, routed_from_weights(w13, w2)(x, top_w, top_ids)), tokens
        assert got.abs().sum() > 0


def test_the_results_comparison_finds_a_changed_figure_and_ignores_timing() -> None:
    recorded = json.loads((ROOT / "benchmarks" / "results" / "quality.json").read_text())
    same = json.loads(json.dumps(recorded))
    same["result"]["seconds"], same["result"]["cpu_seconds"], same["date"] = 1.0, 1.0, "another day"
    assert differences(recorded, same) == []
    for model, row, key in (("mxfp4", 0, "kl"), ("nvfp4", -1, "greedy"), ("nvfp4", 7, "bits_per_weight")):
        changed = json.loads(json.dumps(recorded))
        r = changed["result"]["models"][model]["rows"][row]
        r[key] = float(f"{r[key] * (1 + 1e-5):.6g}") if r[key] else 1e-6   # the last written digit
        assert len(differences(recorded, changed)) == 1, (model, row, key)
    changed = json.loads(json.dumps(recorded))
    changed["result"]["models"]["mxfp4"]["default_kl"] *= 1 + 1e-12     # kept at full precision
    assert differences(recorded, changed)
    changed = json.loads(json.dumps(recorded))
    del changed["result"]["models"]["nvfp4"]["rows"][3]
    assert differences(recorded, changed)


def test_qat_fake_quantization_equals_the_exported_mxfp4_checkpoint_values() -> None:
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn((64, 256), generator=gen) * 0.02 * torch.exp(torch.randn((64, 1), generator=gen)))
    w[0, :32] = 0.0                                     # an all-zero block
    w[1, 5] = 6.0 * 2.0 ** -7                           # an exact grid value at the block's max
    fake = mxfp4_fake(w)
    codes, e8 = mxfp4_export(w.numpy())
    values = torch.from_numpy(E2M1_VALUES)[unpack_nibbles(torch.from_numpy(codes)).long()]
    exported = values * torch.exp2(torch.from_numpy(e8.astype(np.float32)) - 127).repeat_interleave(32, dim=1)
    assert torch.equal(fake, exported)
    assert (fake - w).abs().max() > 0                   # it did round
    # the straight-through gradient reaches the master weights unchanged
    w.requires_grad_(True)
    mxfp4_fake(w).sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_the_2_3_4_bit_mix_is_the_best_choice_under_its_budget_on_a_small_case() -> None:
    # 1 layer, 4 experts; brute force over every assignment of forms within 3 extra bit-planes
    errs = {"base": torch.tensor([[10.0, 9.0, 2.0, 8.0]]), "3bit": torch.tensor([[3.0, 8.5, 1.0, 2.0]]),
            "fp4": torch.zeros(1, 4)}
    forms = mix_forms(errs, 3)
    cost = {"base": 0, "3bit": 1, "fp4": 2}

    def total(fs: list[str]) -> float:
        return sum(float(errs[f][0, e]) for e, f in enumerate(fs))
    best = min(total(list(fs)) for fs in itertools.product(cost, repeat=4)
               if sum(cost[f] for f in fs) <= 3)
    assert sum(cost[f] for f in forms[0]) <= 3
    assert total(forms[0]) == best


def test_training_is_bit_for_bit_reproducible_and_resumes_to_the_same_bytes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    text = (ROOT / "benchmarks" / "quality_model" / "data" / "eval-slice.txt").read_bytes()
    (data / "train.txt").write_bytes(text[: 1 << 15])
    (data / "eval-slice.txt").write_bytes(text[: 1 << 13])
    tiny = ["--steps", "4", "--qat-fraction", "0.5", "--warmup", "2", "--batch", "2", "--seq", "32",
            "--log-every", "2", "--save-every", "10", "--layers", "1", "--experts", "4", "--top-k", "2",
            "--expert-width", "32", "--hidden", "64", "--shared-width", "32", "--data", str(data)]
    script = str(ROOT / "benchmarks" / "quality_model" / "train.py")

    def train(out: Path, *extra: str) -> None:
        proc = subprocess.run([sys.executable, script, *tiny, "--out", str(out), *extra],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    train(tmp_path / "a")
    train(tmp_path / "b", "--stop-after", "3")            # stopped inside QAT, its state saved ...
    assert not (tmp_path / "b" / "mxfp4").exists()
    train(tmp_path / "b")                                # ... and resumed by the same command
    for fmt in ("mxfp4", "nvfp4"):
        a = (tmp_path / "a" / fmt / "model-00001-of-00001.safetensors").read_bytes()
        b = (tmp_path / "b" / fmt / "model-00001-of-00001.safetensors").read_bytes()
        assert a == b, fmt
    log_a = json.loads((tmp_path / "a" / "train.json").read_text())["log"]
    log_b = json.loads((tmp_path / "b" / "train.json").read_text())["log"]
    assert [r["train_ce"] for r in log_a] == [r["train_ce"] for r in log_b]
