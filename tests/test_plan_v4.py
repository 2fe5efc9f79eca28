"""One 96 GB card, planned on a full-size DeepSeek-V4-Flash checkpoint (header-only, sparse: no disk).

43 main layers of base planes with compact e8m0 scales (72.56 GiB), the checkpoint's dense tensors, a 4.5 GB
delta tier, 260,000 tokens of FP8 KV (vLLM 0.34's V4 arithmetic), four CUDA-graph sizes, an RTX PRO 6000 at
0.96: what fits, by how much, what the margin buys; an 80 GB card does not fit. docs/SERVING.md shows the
same figures.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import vllm_cpu_env
from v4flash import write_v4_flash

from moet_cache.units import GIB
from moet_cache.plan import GPU_PRESETS, PlanSettings, footprint_from_checkpoint, make_plan

BIN = Path(sys.executable).parent
MOET = shutil.which("moet-cache", path=str(BIN)) or str(BIN / "moet-cache")
REPORT = PlanSettings(gpu=GPU_PRESETS["rtx-pro-6000"], utilization=0.96, max_model_len=260_000,
                      kv_cache_dtype="fp8", block_size=256, cudagraph_sizes=(1, 2, 4, 8), batched_tokens=2048)


@pytest.fixture(scope="module")
def flash(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_v4_flash(tmp_path_factory.mktemp("v4flash") / "DeepSeek-V4-Flash", "mxfp4")


def test_the_fixture_costs_no_disk(flash: Path) -> None:
    shards = sorted(flash.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in shards)
    used = sum(f.stat().st_blocks * 512 for f in shards)
    assert size > 150 * 10**9 and used < 64 << 20          # ~160 GB of checkpoint, a few MiB on disk


def test_v4_flash_fits_the_rtx_pro_6000_with_the_real_margin(flash: Path) -> None:
    fp = footprint_from_checkpoint(flash, "4.5GB")
    assert fp.served_layers == 43 and fp.total_experts == 43 * 256
    assert fp.base_bytes == 43 * 1_811_954_688 and fp.base_bytes / GIB == pytest.approx(72.56, abs=0.005)
    assert fp.tier_experts == 715 and fp.delta_tier_bytes == 715 * 6 * 2**20     # 4.5 GB = 715 whole experts
    assert fp.attention.kind == "deepseek_v4" and fp.attention.layers == 43
    p = make_plan(fp, REPORT)
    assert p.v4_kv is not None and p.kv == 2_713_063_680 and p.kv_raw == 1_016_494_176
    assert p.fits and not p.thin
    assert 3.0 * GIB < p.margin < 4.5 * GIB
    # What the margin buys, each checked by planning again.
    assert p.extra_full_seqs >= 1
    assert make_plan(fp, replace(REPORT, max_num_seqs=1 + p.extra_full_seqs)).fits
    assert not make_plan(fp, replace(REPORT, max_num_seqs=2 + p.extra_full_seqs)).fits
    bigger = fp.with_tier(fp.delta_tier_bytes + p.extra_delta_experts * fp.expert_delta_bytes)
    assert p.extra_delta_experts > 500 and make_plan(bigger, REPORT).fits
    assert fp.mtp_bytes > 0 and p.mtp_need >= fp.mtp_bytes          # the drafter block; its KV adds no block here
    # vLLM's default batch (8192 tokens, async) reserves 7.19 GiB of V4 windows: the same settings do not fit.
    default = make_plan(fp, replace(REPORT, batched_tokens=8192))
    assert not default.fits and default.kv == 7_716_245_760
    assert any(x.setting == "--max-num-batched-tokens 2048" or x.change == "context" for x in default.suggestions)


def test_an_80_gb_card_does_not_fit_and_says_what_would(flash: Path) -> None:
    fp = footprint_from_checkpoint(flash, "4.5GB")
    p = make_plan(fp, replace(REPORT, gpu=GPU_PRESETS["h100-80g"]))
    assert not p.fits and p.static > p.budget and "base planes" in p.deciding
    cards = [x for x in p.suggestions if x.change == "gpu"]
    assert any("rtx-pro-6000" in x.setting for x in cards)


def test_plan_cli_on_the_full_size_checkpoint(flash: Path) -> None:
    args = [MOET, "plan", str(flash), "--json", "--gpu", "rtx-pro-6000", "--delta-budget", "4.5GB",
            "--max-model-len", "260000", "--kv-cache-dtype", "fp8", "--max-num-batched-tokens", "2048",
            "--cudagraph-capture-sizes", "1", "2", "4", "8", "--speculative", "none"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["attention"] == "deepseek_v4" and doc["fits"] is True
    assert doc["kv_allocator"]["bytes_per_block"] == 1_002_240 and doc["kv_raw_bytes"] == 1_016_494_176
    r80 = subprocess.run([*args[:5], "h100-80g", *args[6:]], capture_output=True, text=True, timeout=300)
    assert r80.returncode == 1 and json.loads(r80.stdout)["fits"] is False


def test_plan_given_nothing_plans_what_serve_starts(flash: Path) -> None:
    """plan's defaults are the preset serve picks for the model (V4: 2,048 batched tokens, not vLLM's 8,192), with
    the drafter serve turns on when it fits: the release's MTP block, at the preset's 1,024 batched tokens."""
    from moet_cache.plan.drafter_vram import DrafterLayout
    from moet_cache.serve import fit_preset, get_preset, settings_from_flags
    r = subprocess.run([MOET, "plan", str(flash), "--json", "--gpu", "rtx-pro-6000"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["preset"] == "v4-flash-96g" and doc["fits"] is True and doc["margin_gib"] > 2.6
    assert doc["speculative_choice"].startswith("speculative decoding on: the mtp drafter fits rtx-pro-6000")
    assert doc["drafter"]["layout"] == "mtp" and doc["drafter"]["counted"] and doc["drafter"]["layers"] == 1
    cfg = json.loads((flash / "config.json").read_text())
    preset = get_preset("auto", cfg["model_type"])
    serve = settings_from_flags(fit_preset(preset, cfg, drafter=DrafterLayout.MTP)[0], GPU_PRESETS["rtx-pro-6000"])
    s = doc["settings"]
    assert (s["gpu_memory_utilization"], s["max_model_len"], s["kv_cache_dtype"], s["block_size"],
            s["max_num_batched_tokens"], tuple(s["cudagraph_capture_sizes"]), s["speculative"]) == \
        (serve.utilization, serve.max_model_len, serve.kv_cache_dtype, serve.block_size, serve.batched_tokens,
         serve.cudagraph_sizes, serve.speculative) == (0.96, 260_000, "fp8", 256, 1024, (1, 2, 4, 8), "mtp")
    # Without the drafter, the preset's own settings: 2,048 batched tokens.
    off = settings_from_flags(fit_preset(preset, cfg)[0], GPU_PRESETS["rtx-pro-6000"])
    assert (off.batched_tokens, off.speculative) == (2048, "none")


@pytest.mark.parametrize("variant", ["hybrid", "mxfp4"])
def test_v4_checkpoint_footprint_equals_the_built_cache(variant: str, tmp_path: Path) -> None:
    """The computed footprint of a real (small) V4 checkpoint is the built cache's exact one, compact scales
    found in the NVFP4 data included."""
    from moet_cache import BuildOptions, build_cache
    from moet_cache.source.synthetic import make_v4_checkpoint, small_v4_spec
    from moet_cache.plan import footprint_from_cache
    src = make_v4_checkpoint(tmp_path / "src", small_v4_spec(variant))
    build_cache(src, tmp_path / "cache", BuildOptions(delta_budget="25%"))
    exact, computed = footprint_from_cache(tmp_path / "cache"), footprint_from_checkpoint(src, "25%")
    for key in ("base_bytes", "delta_tier_bytes", "dense_bytes", "expert_delta_bytes", "tier_experts",
                "total_experts", "served_layers"):
        assert getattr(exact, key) == getattr(computed, key), key
    assert exact.attention.kind == computed.attention.kind == "deepseek_v4"
    assert computed.mtp_bytes > 0


def test_serve_picks_the_v4_preset_and_refuses_max_effort_below_393216(tmp_path: Path) -> None:
    from moet_cache import BuildOptions, build_cache
    from moet_cache.source.synthetic import make_v4_checkpoint, small_v4_spec
    src = make_v4_checkpoint(tmp_path / "DeepSeek-V4-Tiny", small_v4_spec("hybrid"))
    cache = tmp_path / "cache"
    build_cache(src, cache, BuildOptions(delta_budget="25%"))
    env = {"PATH": f"{vllm_cpu_env.bin_without_vllm(BIN)}:/usr/bin:/bin", "HOME": str(tmp_path)}
    r = subprocess.run([MOET, "serve", str(cache), "--dry-run", "--json"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    argv = doc["argv"]
    assert doc["preset"] == "v4-flash-96g" and doc["model_type"] == "deepseek_v4"
    assert argv[argv.index("--tokenizer-mode") + 1] == "deepseek_v4"
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8" and argv[argv.index("--block-size") + 1] == "256"
    assert json.loads(argv[argv.index("--default-chat-template-kwargs") + 1]) == {"thinking": True}
    assert argv[argv.index("--reasoning-parser") + 1] == "moet_deepseek"
    effort = '{"thinking": true, "reasoning_effort": "max"}'
    r = subprocess.run([MOET, "serve", str(cache), "--dry-run", "--", "--default-chat-template-kwargs", effort],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2
    assert 'reasoning_effort "max" needs --max-model-len of at least 393,216 tokens on DeepSeek-V4' in r.stderr
    ok = subprocess.run([MOET, "serve", str(cache), "--dry-run", "--", "--default-chat-template-kwargs", effort,
                         "--max-model-len", "384K"], capture_output=True, text=True, timeout=300, env=env)
    assert ok.returncode == 0, ok.stderr
