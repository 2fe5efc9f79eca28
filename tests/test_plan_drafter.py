"""plan counts the speculative drafter as vLLM 0.34 allocates it, and plan and serve agree on when it is on.

The full-size DeepSeek-V4-Flash-0731 layout (tests/v4flash.py "hybrid": three DSpark blocks and the head
stack) on one RTX PRO 6000 at 0.96 and 260,000 tokens fits with the DSpark drafter at the preset's drafter
settings; a real small cache built with the drafter's planes is planned and served (dry run) with the same
settings and vLLM 0.34's --speculative-config.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import vllm_cpu_env
from safetensors.torch import save_file
from v4flash import DSPARK, write_v4_flash

from moet_cache import BuildOptions, build_cache
from moet_cache.plan.drafter_vram import (DrafterLayout, decode_graph_sizes, draft_layers, layout_of,
                                     speculative_tokens)
from moet_cache.errors import InputError
from moet_cache.serve import (choose_drafter, fit_preset, get_preset, settings_from_argv, settings_from_flags,
                              speculative_flag)
from moet_cache.source.synthetic import make_v4_checkpoint, small_v4_spec
from moet_cache.units import GIB
from moet_cache.plan import (CUDAGRAPH_PER_SIZE, GPU_PRESETS, Footprint, PlanSettings, activation_reserve, footprint_from_cache,
                             footprint_from_checkpoint, make_plan)

BIN = Path(sys.executable).parent
MOET = shutil.which("moet-cache", path=str(BIN)) or str(BIN / "moet-cache")
RTX = GPU_PRESETS["rtx-pro-6000"]
MIB = 1 << 20


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM", "MOET_CACHE"))}
    env["PATH"] = os.pathsep.join([str(vllm_cpu_env.bin_without_vllm(BIN)), "/usr/bin", "/bin"])  # no nvidia-smi
    return env


def _moet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MOET, *args], capture_output=True, text=True, env=_env(), timeout=600)


# --- what vLLM 0.34 resolves, as drafter_vram redoes it ---------------------------------------------------------

def test_the_drafter_layout_and_its_vllm_figures() -> None:
    assert layout_of(["mtp.0.e_proj.weight", "mtp.0.attn.wkv.weight"]) == DrafterLayout.MTP
    assert layout_of(["mtp.0.main_proj.weight"]) == layout_of(["mtp.2.markov_head.markov_w1.weight"]) == \
        layout_of(["context_wkv_proj.weight"]) == DrafterLayout.DSPARK
    assert layout_of(["mtp.0.main_projection.weight"]) == DrafterLayout.MTP     # a name, not a prefix match
    # DSparkDeepseekV4Model: n_mtp_layers or 3; num_speculative_tokens: block_size, else dspark_block_size.
    assert draft_layers(DrafterLayout.DSPARK, {}) == 3 and draft_layers(DrafterLayout.DSPARK, {"n_mtp_layers": 2}) == 2
    assert draft_layers(DrafterLayout.MTP, {"num_nextn_predict_layers": 1}) == 1
    assert speculative_tokens(DrafterLayout.DSPARK, {"dspark_block_size": 4}) == 4
    assert speculative_tokens(DrafterLayout.DSPARK, {"block_size": 7, "dspark_block_size": 4}) == 7
    # VllmConfig._split_cudagraph_capture_sizes: request counts cdiv(s, q) whose q-token batch stays within the
    # largest size. Sizes 1 2 4 8 at q = 5 capture one request only; at q = 2 one, two and four.
    assert decode_graph_sizes((1, 2, 4, 8), 5) == (1,)
    assert decode_graph_sizes((1, 2, 4, 8), 2) == (1, 2, 4)
    assert decode_graph_sizes((1,), 5) == () and decode_graph_sizes((), 2) == ()
    cfg = {"num_nextn_predict_layers": 1}
    assert json.loads(speculative_flag(DrafterLayout.DSPARK, cfg).values[0]) == {"method": "dspark"}
    assert json.loads(speculative_flag(DrafterLayout.MTP, cfg).values[0]) == {"method": "mtp", "num_speculative_tokens": 1}


# --- the goal: the full-size -0731 layout on one 96 GB card ------------------------------------------------------

@pytest.fixture(scope="module")
def flash0731(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_v4_flash(tmp_path_factory.mktemp("v4flash0731") / "DeepSeek-V4-Flash-0731-NVFP4", "hybrid")


@pytest.fixture(scope="module")
def fp0731(flash0731: Path) -> Footprint:
    """Its footprint with the default 4.5 GB tier (reading every NVFP4 scale takes most of a minute)."""
    return footprint_from_checkpoint(flash0731, "4.5GB")


@pytest.mark.slow
def test_v4_flash_0731_fits_260k_with_the_dspark_drafter(flash0731: Path, fp0731: Footprint) -> None:
    shards = sorted(flash0731.glob("*.safetensors"))
    assert sum(f.stat().st_blocks * 512 for f in shards) < 64 << 20              # ~150 GB of checkpoint, a hole
    fp = fp0731
    d = fp.drafter
    # Compact scales, the release's (72.56 GiB; the NVFP4 layers add their 768 input and global scales a layer).
    assert fp.base_bytes == 43 * (1_811_954_688 + 256 * 3 * 4)
    assert d is not None and d.layout == DrafterLayout.DSPARK and d.blocks == 3 and d.planed
    # The drafter's 768 MXFP4 experts as base planes (e8m0 scales), not their FP4 bytes.
    assert d.experts == 768 and d.expert_bytes == 3 * 1_811_954_688 and d.tier_bytes == 0
    fp4 = 768 * 3 * 4096 * 2048 * 17 // 32                                       # codes + e8m0 scales
    assert d.expert_bytes < fp4 * 0.53 and fp.mtp_bytes == d.stored
    H, r, V = 4096, DSPARK["dspark_markov_rank"], 129280
    head = (H * 3 * H + 32 * 96) + H * 2 + H * 2 + (4 * 4 * H + 4 + 1) * 4 + 2 * V * r * 2 + (H + r) * 4
    blocks = d.dense_bytes - head
    assert blocks % 3 == 0 and 120 * MIB < blocks // 3 < 140 * MIB              # FP8 attention, shared expert, hc
    assert d.wkv_bytes == 3 * (512 * H + 4 * 32) and not d.context_wkv_shipped

    choice = choose_drafter(fp, RTX)
    assert choice.layout == DrafterLayout.DSPARK and choice.planned, choice.reason
    assert choice.footprint.tier_experts == 317                                  # the preset's 2 GB tier
    assert choice.reason.startswith("speculative decoding on: the dspark drafter fits rtx-pro-6000")

    r = _moet("plan", str(flash0731), "--json", "--gpu", "rtx-pro-6000")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    s = doc["settings"]
    assert doc["fits"] is True and doc["thin_margin"] is False and doc["preset"] == "v4-flash-96g"
    assert (s["gpu_memory_utilization"], s["max_model_len"], s["speculative"], s["max_num_batched_tokens"],
            s["cudagraph_capture_sizes"], s["kv_cache_dtype"]) == (0.96, 260_000, "dspark", 1024, [1, 2, 4, 8], "fp8")
    assert doc["buys"]["delta_experts"] == [317, 43 * 256]
    dr = doc["drafter"]
    assert dr["layout"] == "dspark" and dr["counted"] and dr["layers"] == 3 and dr["num_speculative_tokens"] == 4
    assert dr["weights_bytes"] == d.stored and dr["context_wkv_copy_bytes"] == d.wkv_bytes
    # The speculator's hidden_states (bf16), DSpark's own topk_indices_buffer (int32) and context_positions.
    assert dr["buffers_bytes"] == 1024 * (H * 2 + 512 * 4 + 8)
    assert dr["workspace_lane_bytes"] == activation_reserve(fp.model, 1024)
    assert dr["cudagraph_bytes"] == CUDAGRAPH_PER_SIZE * 1                       # one request of 5 tokens
    terms = doc["terms_bytes"]
    assert terms["mtp_weights"] == d.stored + d.wkv_bytes
    assert terms["drafter_reserves"] == dr["buffers_bytes"] + dr["workspace_lane_bytes"] + dr["cudagraph_bytes"]
    assert sum(terms.values()) == doc["need_bytes"] and doc["need_bytes"] <= doc["budget_bytes"]

    # serve starts the same settings: the preset fitted with the drafter, vLLM 0.34's speculative config.
    preset = get_preset("auto", fp.model["model_type"])
    flags, _ = fit_preset(preset, fp.model, drafter=choice.layout)
    by = {f.option: f.values for f in flags}
    assert json.loads(by["--speculative-config"][0]) == {"method": "dspark"}
    serve = settings_from_flags(flags, RTX)
    assert (serve.utilization, serve.max_model_len, serve.speculative, serve.batched_tokens, serve.cudagraph_sizes,
            serve.kv_cache_dtype, serve.block_size) == \
        (s["gpu_memory_utilization"], s["max_model_len"], s["speculative"], s["max_num_batched_tokens"],
         tuple(s["cudagraph_capture_sizes"]), s["kv_cache_dtype"], s["block_size"])
    assert make_plan(choice.footprint, serve).margin == doc["margin_bytes"]


@pytest.mark.slow
def test_the_cache_s_4_5_gb_tier_leaves_no_room_and_plan_says_what_decides(fp0731: Footprint) -> None:
    fp = fp0731
    s = PlanSettings(gpu=RTX, max_model_len=260_000, kv_cache_dtype="fp8", batched_tokens=1024,
                     speculative="dspark")
    p = make_plan(fp, s)
    without = make_plan(fp, replace(s, speculative="none"))
    assert without.fits and not p.fits and p.drafter is not None
    assert p.margin == without.margin - p.drafter.total                          # the drafter is every difference
    assert p.deciding.startswith("the dspark drafter:") and f"{without.margin / GIB:.3f} GiB" in p.deciding
    changes = {x.change: x for x in p.suggestions}
    assert changes["no-drafter"].margin == without.margin
    keep = changes["tier"].tier_experts
    assert keep is not None and 0 < keep < fp.tier_experts
    assert make_plan(fp.with_tier(keep * fp.expert_delta_bytes), s).fits
    assert not make_plan(fp.with_tier((keep + 1) * fp.expert_delta_bytes), s).fits
    # serve's choice on a cache with this tier: off, and why.
    choice = choose_drafter(replace(fp, source="cache"), RTX)
    assert choice.layout is None and "does not fit rtx-pro-6000" in choice.reason
    with pytest.raises(InputError, match="drafter is dspark"):
        make_plan(fp, replace(s, speculative="mtp"))


# --- a real cache with the drafter's planes: plan and serve --dry-run agree -----------------------------------------

def _with_dspark_head(src: Path) -> None:
    """Add DSpark's head stack (the names vLLM 0.34's dspark.py loads) where the synthetic checkpoint lacks it."""
    cfg = json.loads((src / "config.json").read_text())
    H, V, r = cfg["hidden_size"], cfg["vocab_size"], 16
    last = sum(1 for _ in {n.split(".")[1] for n in json.loads((src / "model.safetensors.index.json").read_text())
                           ["weight_map"] if n.startswith("mtp.")}) - 1
    head = {"mtp.0.main_proj.weight": torch.randn(H, 3 * H, dtype=torch.bfloat16),
            "mtp.0.main_norm.weight": torch.ones(H, dtype=torch.bfloat16),
            f"mtp.{last}.markov_head.markov_w1.weight": torch.randn(V, r, dtype=torch.bfloat16),
            f"mtp.{last}.markov_head.markov_w2.weight": torch.randn(V, r, dtype=torch.bfloat16),
            f"mtp.{last}.confidence_head.proj.weight": torch.randn(1, H + r, dtype=torch.float32)}
    index = json.loads((src / "model.safetensors.index.json").read_text())
    head = {k: v for k, v in head.items() if k not in index["weight_map"]}
    if head:
        save_file(head, str(src / "model-dspark-head.safetensors"), metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(head, "model-dspark-head.safetensors"))
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg.update({"dspark_target_layer_ids": [0, 1, 2], "dspark_markov_rank": r, "dspark_block_size": 4,
                "n_mtp_layers": last + 1})
    (src / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def dspark_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("dspark")
    src = make_v4_checkpoint(d / "DeepSeek-V4-Flash-0731-Tiny", small_v4_spec("hybrid", mtp_blocks=3))
    _with_dspark_head(src)
    build_cache(src, d / "cache", BuildOptions(delta_budget="25%", include_mtp=True))
    return src, d / "cache"


def test_the_cache_s_drafter_bytes_are_what_the_checkpoint_plan_computed(dspark_cache: tuple[Path, Path]) -> None:
    src, cache = dspark_cache
    exact, computed = footprint_from_cache(cache), footprint_from_checkpoint(src, "25%")
    de, dc = exact.drafter, computed.drafter
    assert de is not None and dc is not None and de.layout == dc.layout == DrafterLayout.DSPARK
    assert de.planed and de.blocks == dc.blocks == 3 and de.experts == dc.experts
    assert de.expert_bytes == dc.expert_bytes and de.dense_bytes == dc.dense_bytes and de.wkv_bytes == dc.wkv_bytes
    # The cache's tier may hold drafter experts; the main layers' terms are unchanged by the drafter.
    assert exact.mtp_bytes == de.expert_bytes + de.tier_bytes + de.dense_bytes
    assert exact.base_bytes == computed.base_bytes and exact.dense_bytes == computed.dense_bytes


def test_plan_and_serve_dry_run_start_the_same_drafter_settings(dspark_cache: tuple[Path, Path]) -> None:
    _, cache = dspark_cache
    plan = _moet("plan", str(cache), "--json")                                  # no GPU seen: the default card
    assert plan.returncode == 0, plan.stderr
    doc = json.loads(plan.stdout)
    assert doc["settings"]["speculative"] == "dspark" and doc["drafter"]["counted"]
    assert doc["speculative_choice"].startswith("speculative decoding on: the dspark drafter fits rtx-pro-6000")
    dry = _moet("serve", str(cache), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    sdoc = json.loads(dry.stdout)
    argv = sdoc["argv"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "dspark"}
    assert any(n.startswith("speculative decoding on: the dspark drafter fits rtx-pro-6000") and
               "no GPU seen" in n for n in sdoc["notes"])
    served = settings_from_argv(argv, RTX)
    s = doc["settings"]
    assert (served.utilization, served.max_model_len, served.kv_cache_dtype, served.block_size, served.batched_tokens,
            served.cudagraph_sizes, served.speculative) == \
        (s["gpu_memory_utilization"], s["max_model_len"], s["kv_cache_dtype"], s["block_size"],
         s["max_num_batched_tokens"], tuple(s["cudagraph_capture_sizes"]), s["speculative"])
    assert served.batched_tokens == 1024
    text = _moet("serve", str(cache), "--dry-run")
    assert "note: speculative decoding on: the dspark drafter" in text.stderr
    assert "--speculative-config" in text.stdout


def test_no_speculative_turns_it_off_and_the_user_s_config_wins(dspark_cache: tuple[Path, Path]) -> None:
    _, cache = dspark_cache
    off = json.loads(_moet("serve", str(cache), "--dry-run", "--json", "--no-speculative").stdout)
    assert "--speculative-config" not in off["argv"]
    assert "speculative decoding off (--no-speculative)" in off["notes"]
    assert off["argv"][off["argv"].index("--max-num-batched-tokens") + 1] == "2048"     # the preset's own
    mine = '{"method": "dspark", "num_speculative_tokens": 2}'
    own = json.loads(_moet("serve", str(cache), "--dry-run", "--json", "--", "--speculative-config", mine).stdout)
    assert own["argv"].count("--speculative-config") == 1
    assert own["argv"][own["argv"].index("--speculative-config") + 1] == mine
    none = json.loads(_moet("plan", str(cache), "--json", "--speculative", "none").stdout)
    assert none["settings"]["speculative"] == "none" and none["drafter"]["counted"] is False
    assert none["terms_bytes"]["mtp_weights"] == 0 and none["terms_bytes"]["drafter_reserves"] == 0
    bad = _moet("plan", str(cache), "--speculative", "eagle")
    assert bad.returncode == 2 and "use auto, dspark, mtp or none" in bad.stderr


def test_a_cache_without_drafter_planes_keeps_it_off(tmp_path: Path) -> None:
    src = make_v4_checkpoint(tmp_path / "DeepSeek-V4-Flash-0731-Tiny", small_v4_spec("hybrid"))
    build_cache(src, tmp_path / "cache", BuildOptions(delta_budget="25%"))
    fp = footprint_from_cache(tmp_path / "cache")
    choice = choose_drafter(fp, RTX)
    assert choice.layout is None and "holds no drafter" in choice.reason and not choice.planned
    doc = json.loads(_moet("serve", str(tmp_path / "cache"), "--dry-run", "--json").stdout)
    assert "--speculative-config" not in doc["argv"]
    assert any("holds no drafter (build with --include-drafter)" in n for n in doc["notes"])
