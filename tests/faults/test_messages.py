"""Messages that say what happened. A NaN or infinite scale in the source is the source's problem; the tier
summary stays within its budget; a copied cache (cp -a) is "copied", with the cost of one --full, never the
words for damage."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moet_cache import BuildOptions, build_cache

from .campaign import make_tiny, run_main


@pytest.mark.parametrize("suffix,value", [("experts.1.up_proj.weight_scale_2", float("nan")),
                                          ("experts.0.down_proj.weight_scale_2", float("inf")),
                                          ("experts.2.gate_proj.input_scale", float("nan")),
                                          ("experts.3.gate_proj.weight_scale", float("nan"))])
def test_a_nan_or_inf_scale_in_the_source_is_a_source_problem(work: Path, suffix: str, value: float) -> None:
    src = make_tiny(work / "src", seed=5)
    shard = next(src.glob("*.safetensors"))
    with safe_open(str(shard), framework="pt") as f:
        meta = f.metadata()
        ts = {k: f.get_tensor(k) for k in f.keys()}
    name = next(k for k in ts if k.endswith(suffix) and ".layers.1." in k)
    t = ts[name].to(torch.float32).clone()
    t.view(-1)[0] = value
    ts[name] = t.to(ts[name].dtype)
    save_file(ts, str(shard), metadata=meta)
    rc, _, err = run_main(["build", src, work / "cache"])
    assert rc == 2, err
    assert "source checkpoint" in err and "NaN or infinite" in err and "layer 1" in err, err
    assert "manifest" not in err and "damaged; run moet-cache build again" not in err, err


def test_the_tier_summary_never_exceeds_its_budget(work: Path) -> None:
    src = make_tiny(work / "src", seed=6)
    for budget in ("10%", "30%", "50000"):
        rc, out, err = run_main(["build", src, work / "cache", "--delta-budget", budget, "--json"])
        doc = json.loads(out)
        assert rc == 0 and 0 < doc["tier_bytes"] <= doc["budget_bytes"] < doc["tier_file_bytes"] or \
            doc["tier_bytes"] <= doc["budget_bytes"], doc
        assert doc["tier_file_bytes"] > doc["tier_bytes"]  # the pack's header, reported on its own
        rc, out, _ = run_main(["inspect", work / "cache", "--json"])
        assert json.loads(out)["delta_tier_bytes"] == doc["tier_bytes"]
    rc, out, _ = run_main(["build", src, work / "c2", "--delta-budget", "30%", "--lossless"])
    assert "of delta planes" in out and "header" in out


def test_docs_say_what_bit_exact_means() -> None:
    root = Path(__file__).resolve().parents[2]
    text = " ".join((root / "docs/GUARANTEES.md").read_text().split())
    assert "not byte-identical" in text and "every tensor" in text
    assert "bit for bit" not in " ".join((root / "cli/export.py").read_text().split())


def test_a_copied_cache_says_copied_and_what_a_full_verify_costs(work: Path) -> None:
    src = make_tiny(work / "src", seed=8, hidden_size=512, moe_intermediate_size=256)
    cache = work / "cache"
    build_cache(src, cache, BuildOptions(delta_budget="30%"))
    subprocess.run(["cp", "-a", str(cache), str(work / "copy")], check=True)
    rc, out, err = run_main(["verify", work / "copy", "--json"])
    doc = json.loads(out)
    assert rc == 1 and doc["state"] == "unverified"
    assert doc["problems"] and all(p["kind"] == "changed" and p["detail"].startswith("copied") for p in doc["problems"])
    d = doc["details"]
    assert d["copied_files"] == d["changed_files"] == len(doc["problems"]) and d["touched_files"] == 0
    assert d["full_verify_bytes"] > 1 << 20
    assert d["hash_bytes_per_second"] and d["full_verify_seconds_estimate"] is not None  # measured by the build
    rc, out, err = run_main(["verify", work / "copy"])
    words = out + err
    assert "corrupt" not in words and "damaged" not in words.replace("not damage", "")
    assert "copied" in words and "not damage" in words and "GB/s" in words and "iB once" in words, words
    (work / "copy" / "layers/layer-001.base.safetensors").touch()
    rc, out, _ = run_main(["verify", work / "copy", "--json"])
    assert json.loads(out)["details"]["touched_files"] == 1
    assert run_main(["verify", work / "copy", "--full"])[0] == 0
    assert run_main(["verify", work / "copy"])[0] == 0
