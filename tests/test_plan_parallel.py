"""plan per GPU: what the fullest rank holds under tensor and expert parallelism, the sizes the planes allow,
V4-Flash on two 48 GB cards, two 96 GB cards and four 32 GB cards, and "more GPUs" as a suggestion."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from v4flash import FLASH, RATIOS, write_v4_flash

from moet_cache import BuildOptions, build_cache
from moet_cache.cache import layout as L
from moet_cache.cache.cacheview import open_view
from moet_cache.plan.parallel import Parallel, allowed_sizes, is_split
from moet_cache.serve import preset_plan_settings
from moet_cache.source.synthetic import make_v4_checkpoint, small_v4_spec
from moet_cache.units import GIB, parse_size
from moet_cache.plan import (COMM_RESERVE, GPU_PRESETS, GPUS, GpuPreset, PlanSettings, footprint_from_cache,
                             make_plan, rank_footprint, read_footprint)

BIN = Path(sys.executable).parent
MOET = shutil.which("moet-cache", path=str(BIN)) or str(BIN / "moet-cache")


@pytest.fixture(scope="module")
def flash(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_v4_flash(tmp_path_factory.mktemp("flash") / "DeepSeek-V4-Flash")


@pytest.fixture(scope="module")
def small_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("v4par")
    src = make_v4_checkpoint(d / "src", small_v4_spec("hybrid", mtp_blocks=0, num_nextn_predict_layers=0))
    build_cache(src, d / "cache", BuildOptions(delta_budget="40%"))
    return d / "cache"


def _plan_json(*args: str) -> tuple[int, dict]:
    r = subprocess.run([MOET, "plan", *args, "--json"], capture_output=True, text=True, timeout=600,
                       env={"PATH": "/usr/bin:/bin"})   # no nvidia-smi: --gpu decides
    return r.returncode, json.loads(r.stdout)


def _split_bytes_of_flash() -> int:
    """The bytes vLLM 0.34 splits across tensor-parallel ranks in V4-Flash, from the dims (not the name rule):
    embed and head, and per layer wq_b, wo_a, wo_b (FP8 + one e8m0 scale per 128 x 128), attn_sink, the shared
    expert's w1, w3, w2."""
    c = FLASH
    H, V, nh, hd, q, o, g, I = (c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["head_dim"],
                                c["q_lora_rank"], c["o_lora_rank"], c["o_groups"], c["moe_intermediate_size"])

    def fp8(out: int, inp: int) -> int:
        return out * inp + -(-out // 128) * -(-inp // 128)
    layer = fp8(nh * hd, q) + fp8(g * o, nh * hd // g) + fp8(H, g * o) + nh * 4 + 2 * fp8(I, H) + fp8(H, I)
    return 2 * V * H * 2 + len(RATIOS) * layer


# --- the goal: V4-Flash on two 48 GB cards --------------------------------------------------------------

def test_v4_flash_on_two_48_gb_cards_says_precisely_why_not(flash: Path) -> None:
    """Two RTX 6000 Ada (or L40S, A6000): vLLM 0.34 refuses V4's attention on compute capability 8.x, and the
    memory alone would also be 0.68 GiB short at 260K with the 4.5 GB tier; on a 48 GB card V4's attention runs
    on, 72,448 tokens fit, or base-only, or four GPUs."""
    code, doc = _plan_json(str(flash), "--gpu", "rtx-6000-ada", "--tensor-parallel-size", "2")
    assert code == 1 and not doc["fits"]
    assert doc["deciding"].startswith("attention: vLLM 0.34 runs DeepSeek-V4's attention only on compute "
                                      "capability 9.x, 10.x and 12.x")
    assert "the RTX 6000 Ada is 8.9, where vLLM refuses it" in doc["deciding"]
    assert doc["parallel"] == {**doc["parallel"], "tensor_parallel_size": 2, "expert_parallel": False, "per_rank": True}
    whole, t = doc["parallel"]["whole_model_bytes"], doc["terms_bytes"]
    # The fullest rank: half of every expert's codes and scales (scalars and tables on both), half of each tier
    # expert, the split dense tensors halved and the rest whole, the whole KV cache, the reserves.
    assert doc["parallel"]["dense_split_bytes"] == _split_bytes_of_flash()
    assert t["dense"] == whole["dense"] - _split_bytes_of_flash() // 2
    assert t["delta_tier"] * 2 == whole["delta_tier"]
    assert 0 < t["base_planes"] * 2 - whole["base_planes"] < 1 << 20
    assert t["communication_reserve"] == COMM_RESERVE
    assert doc["need_bytes"] == sum(t.values())
    assert round(doc["margin_gib"], 2) == -0.68 and round(doc["need_gib"], 2) == 46.75
    assert [x["setting"] for x in doc["suggestions"]] == ["--gpu h100-80g (H100 SXM/PCIe, sold as 80 GB, 2 of them)"]
    # The same memory on a card whose architecture V4's attention runs on: the memory verdict and what fits.
    code, mem = _plan_json(str(flash), "--gpu", "49140MiB", "--tensor-parallel-size", "2")
    assert code == 1 and mem["deciding"] == "KV cache: the weights fit, the KV cache for these settings does not"
    assert mem["margin_bytes"] == doc["margin_bytes"]
    settings = {x["change"]: x["setting"] for x in mem["suggestions"]}
    assert settings["context"] == "--max-model-len 72448"
    assert settings["base-only"] == "--delta-budget 0"
    base_only = next(x for x in mem["suggestions"] if x["change"] == "base-only")
    assert round(base_only["margin_bytes"] / GIB, 2) == 1.41     # 2 x 48 GB fit V4-Flash base-only at 260K
    assert settings["gpus"] == "--tensor-parallel-size 4 (2 more GPUs, 4 in all)"


def test_two_rtx_pro_6000_hold_every_delta_plane_at_the_models_whole_context(flash: Path) -> None:
    """The v4-flash-2x96g preset with the whole tier (every expert at FP4): 1,048,576 tokens fit."""
    code, doc = _plan_json(str(flash), "--settings", "v4-flash-2x96g", "--delta-budget", "100%")
    assert code == 0 and doc["preset"] == "v4-flash-2x96g" and doc["gpu"]["name"] == "rtx-pro-6000"
    assert doc["settings"]["max_model_len"] == 1_048_576 and doc["parallel"]["tensor_parallel_size"] == 2
    assert doc["buys"]["delta_experts"] == [11008, 11008]
    assert round(doc["terms_gib"]["delta_tier"], 2) == 32.25 and round(doc["margin_gib"], 2) == 11.99


def test_four_rtx_5090_fit_at_260k_and_four_rtx_4090_are_refused(flash: Path) -> None:
    code, doc = _plan_json(str(flash), "--settings", "v4-flash-4x32g")
    assert code == 0 and doc["gpu"]["name"] == "rtx-5090" and doc["parallel"]["tensor_parallel_size"] == 4
    assert round(doc["margin_gib"], 2) == 4.76
    code, doc = _plan_json(str(flash), "--settings", "v4-flash-4x32g", "--gpu", "rtx-4090")
    assert code == 1 and "the GeForce RTX 4090 is 8.9" in doc["deciding"]


def test_one_more_gpu_is_suggested_when_that_makes_it_fit(flash: Path) -> None:
    """An 80 GB card cannot hold V4-Flash; two can: the plan says so, and planning that suggestion fits."""
    fp = read_footprint(flash)
    _, s = preset_plan_settings(fp.model, GPU_PRESETS["h100-80g"])
    p = make_plan(fp, s)
    more = [x for x in p.suggestions if x.where == GPUS]
    assert not p.fits and [x.setting for x in more] == ["--tensor-parallel-size 2 (1 more GPU, 2 in all)"]
    assert more[0].advice() == "more GPUs of this card: --tensor-parallel-size 2 (1 more GPU, 2 in all)"
    two = make_plan(fp, replace(s, parallel=Parallel(2)))
    assert two.fits and two.margin == more[0].margin


# --- the split, exact on a built cache ------------------------------------------------------------------

def test_a_ranks_share_of_a_built_cache_is_its_tensors_bytes(small_v4: Path) -> None:
    """Counted from the manifests tensor by tensor: tensor parallel 2 halves the codes and block scales and
    each tier expert; expert parallel 2 gives each rank experts [8r, 8r + 8) whole, and the fullest rank's
    tier experts are counted from the delta index."""
    fp = footprint_from_cache(small_v4)
    view = open_view(small_v4)
    split = repl = 0
    for lm in view.layers.values():
        base_files = {f.path for f in lm.files if f.role == L.Role.BASE}
        for t in lm.tensors:
            if t.file in base_files:
                n = t.end - t.begin
                if t.name in ("w13_base", "w2_base", "w13_weight_scale", "w2_weight_scale"):
                    assert t.shape[1] % 2 == 0 and n % 2 == 0
                    split += n
                else:
                    repl += n
    tp = rank_footprint(fp, Parallel(2))
    assert tp.base_bytes == repl + split // 2 and repl > 0
    assert tp.delta_tier_bytes * 2 == fp.delta_tier_bytes and tp.tier_experts == fp.tier_experts > 0
    dense_split = sum(t.end - t.begin for part in view.dense_parts for t in part.tensors if is_split(t.name))
    assert 0 < dense_split < fp.dense_bytes and tp.dense_bytes == fp.dense_bytes - dense_split // 2
    ep = rank_footprint(fp, Parallel(2, expert=True))
    E = fp.total_experts // fp.served_layers
    counts = [sum(1 for _, ex in view.delta_index.layers for e in ex if r * E // 2 <= e < (r + 1) * E // 2)
              for r in range(2)]
    assert ep.tier_experts == max(counts) and ep.delta_tier_bytes == max(counts) * fp.expert_delta_bytes
    assert ep.base_bytes * 2 == fp.base_bytes and ep.dense_bytes == tp.dense_bytes
    assert ep.total_experts * 2 == fp.total_experts


@pytest.mark.parametrize(("name", "split"), [
    ("embed.weight", True), ("head.weight", True), ("layers.2.attn.wq_b.weight", True),
    ("layers.2.attn.wq_b.scale", True), ("layers.2.attn.wo_a.weight", True), ("layers.2.attn.wo_b.scale", True),
    ("layers.2.attn.attn_sink", True), ("layers.2.ffn.shared_experts.w2.weight", True),
    ("layers.2.attn.wq_a.weight", False), ("layers.2.attn.wkv.weight", False), ("layers.2.attn.q_norm.weight", False),
    ("layers.2.attn.indexer.wq_b.weight", False), ("layers.2.attn.indexer.weights_proj.weight", False),
    ("layers.2.attn.compressor.wkv.weight", False), ("layers.2.attn.indexer.compressor.ape", False),
    ("layers.0.ffn.gate.tid2eid", False), ("layers.5.ffn.gate.bias", False), ("layers.2.hc_attn_fn", False),
    ("mtp.0.e_proj.weight", False), ("norm.weight", False), ("hc_head_fn", False),
    ("model.embed_tokens.weight", True), ("lm_head.weight", True),
    ("model.layers.3.self_attn.q_b_proj.weight", True), ("model.layers.3.self_attn.kv_b_proj.weight_scale", True),
    ("model.layers.3.self_attn.o_proj.weight", True), ("model.layers.0.mlp.down_proj.weight", True),
    ("model.layers.3.mlp.shared_experts.gate_proj.weight_scale_2", True),
    ("model.layers.3.self_attn.q_a_proj.weight", False), ("model.layers.3.self_attn.kv_a_proj_with_mqa.weight", False),
    ("model.layers.3.self_attn.indexer.wq_b.weight", False), ("model.layers.3.mlp.gate.weight", False),
    ("model.layers.3.mlp.gate.e_score_correction_bias", False), ("model.norm.weight", False),
])
def test_which_checkpoint_tensors_vllm_splits(name: str, split: bool) -> None:
    """vLLM 0.34's column/row/vocab-parallel layers split; its replicated ones (and disable_tp) do not."""
    assert is_split(name) is split


def test_the_sizes_the_planes_allow_and_a_refusal_in_one_line(small_v4: Path, flash: Path) -> None:
    assert allowed_sizes(FLASH, expert=True) == (1, 2, 4, 8)
    assert allowed_sizes(FLASH, expert=False) == (1, 2, 4)   # a rank's width: multiples of TP_KERNEL_WIDTH (512)
    assert allowed_sizes({**FLASH, "moe_intermediate_size": 3072}, expert=False) == (1, 2)
    assert allowed_sizes({**FLASH, "moe_intermediate_size": 128}, expert=False) == (1,)
    assert allowed_sizes({**FLASH, "n_routed_experts": 12}, expert=True) == (1, 2, 4)
    for args, line in ((["-tp", "3"], "--tensor-parallel-size 3: the moet method takes 1, 2, 4, 8"),
                       (["-tp", "4"], "--tensor-parallel-size 4 does not divide DeepSeek-V4's 2 output groups")):
        r = subprocess.run([MOET, "plan", str(small_v4), *args], capture_output=True, text=True, timeout=300,
                           env={"PATH": "/usr/bin:/bin"})
        assert r.returncode == 2 and line in r.stderr, r.stderr
        assert len([x for x in r.stderr.splitlines() if x.strip()]) <= 2   # the error, and its hint


def test_plan_terms_and_suggestions_hold_per_rank_on_random_settings(flash: Path) -> None:
    """As tests/test_vram.py does for one GPU: every suggestion, applied (a larger --tensor-parallel-size
    included), fits, on tensor and expert parallel plans of full-size V4-Flash on cards of 16 to 100 GiB."""
    fp = read_footprint(flash)
    rng = np.random.default_rng(7)
    checked = more_gpus = 0
    for _ in range(60):
        size = int(rng.choice(allowed_sizes(fp.model, False)))
        s = PlanSettings(gpu=GpuPreset("test", int(rng.integers(16, 100)) * GIB, ""),
                         utilization=float(rng.uniform(0.8, 0.98)), max_model_len=int(rng.integers(1, 1 << 20)),
                         kv_cache_dtype="fp8", max_num_seqs=int(rng.integers(1, 4)), batched_tokens=2048,
                         parallel=Parallel(size, bool(rng.random() < 0.5)))
        f0 = fp.with_tier(int(rng.integers(0, fp.total_experts + 1)) * fp.expert_delta_bytes)
        p = make_plan(f0, s)
        assert p.need == p.base + p.delta + p.dense + p.cudagraph + p.activations + p.kv + p.comm
        assert p.comm == (COMM_RESERVE if size > 1 else 0)
        for x in p.suggestions:
            if x.change == "gpu":
                continue
            checked += 1
            more_gpus += x.where == GPUS
            f, s2 = f0, s
            words = re.sub(r"\([^)]*\)", "", x.setting).split()
            while words:
                flag, value = words[0], words[1] if len(words) > 1 and not words[1].startswith("--") else ""
                words = words[2 if value else 1:]
                if flag == "--tensor-parallel-size":
                    s2 = replace(s2, parallel=Parallel(int(value), s2.parallel.expert))
                elif flag == "--enable-expert-parallel":
                    assert s2.parallel.expert
                elif flag == "--max-model-len":
                    s2 = replace(s2, max_model_len=int(value))
                elif flag == "--max-num-seqs":
                    s2 = replace(s2, max_num_seqs=int(value))
                elif flag == "--kv-cache-dtype":
                    s2 = replace(s2, kv_cache_dtype=value)
                elif flag == "--max-num-batched-tokens":
                    s2 = replace(s2, batched_tokens=int(value))
                elif flag == "--delta-budget":
                    f = f.with_tier(parse_size(value) if value != "0" else 0)
                else:
                    raise AssertionError(x.setting)
            assert make_plan(f, s2).fits, x
    assert checked > 30 and more_gpus > 5
