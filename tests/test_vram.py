"""The VRAM arithmetic: KV sizes from the dims, footprints from real caches and checkpoints, the plan."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from moet_cache import BuildOptions, build_cache, make_checkpoint, small_spec
from moet_cache.source.checkpoint import COMPRESSED_TENSORS, MODELOPT
from moet_cache.errors import InputError
from moet_cache.units import GIB, parse_size
from moet_cache.plan import (GPU_PRESETS, Attention, GpuPreset, Footprint, PlanSettings, attention_from_config,
                             footprint_from_cache, footprint_from_checkpoint, kv_bytes_per_token_layer,
                             make_plan, read_footprint, resolve_gpu)

V3 = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_nextn_predict_layers": 1}


@pytest.fixture(scope="module", params=[MODELOPT, COMPRESSED_TENSORS])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp(f"vram-{request.param}")
    src = make_checkpoint(d / "src", small_spec(request.param, seed=3, n_routed_experts=8, num_hidden_layers=3))
    build_cache(src, d / "cache", BuildOptions(delta_budget="25%"))
    return src, d / "cache"


# --- the KV term -------------------------------------------------------------------------------------

def test_kv_bytes_from_dims_match_vllm_figures_for_deepseek_v3() -> None:
    att = attention_from_config(V3)
    assert att.kind == "mla" and att.layers == 61 and att.mtp_layers == 1
    got = {d: kv_bytes_per_token_layer(att, d) for d in ("fp8_ds_mla", "fp8", "auto", "bfloat16", "nvfp4_ds_mla")}
    assert got == {"fp8_ds_mla": 656, "fp8": 576, "auto": 1152, "bfloat16": 1152, "nvfp4_ds_mla": 352}


def test_kv_adds_the_v32_indexer_keys_and_refuses_unknown_attention() -> None:
    att = attention_from_config({**V3, "index_head_dim": 128, "index_topk": 2048})
    assert kv_bytes_per_token_layer(att, "fp8_ds_mla") == 656 + 128 + 4
    unknown = attention_from_config({"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128})
    assert unknown.kind == "unknown"
    with pytest.raises(InputError, match="--kv-bytes-per-token"):
        kv_bytes_per_token_layer(unknown, "fp8")
    with pytest.raises(InputError, match="unknown --kv-cache-dtype"):
        kv_bytes_per_token_layer(att, "int3")


def test_gpu_presets_and_sizes_read_gb_and_gib() -> None:
    assert GPU_PRESETS["rtx-pro-6000"].total_bytes / GIB == pytest.approx(95.59, abs=0.01)
    assert resolve_gpu("96GB").total_bytes == 96 * 10**9
    assert resolve_gpu("96GiB").total_bytes == 96 * GIB
    assert resolve_gpu("H200") is GPU_PRESETS["h200"]
    with pytest.raises(InputError, match="unknown GPU"):
        resolve_gpu("rtx-4090ish")


# --- 72 + 19 GB of weights and 260K of fp8_ds_mla KV on a 96 GB card ----------------------------------

def _single_card(unit: str, reserves: int | None = 0) -> tuple[Footprint, PlanSettings]:
    """A single-card deployment: 44 layers, base ~72, dense ~19, tier ~4.5, fp8_ds_mla at 260K on 96 GB."""
    u = parse_size(f"1{unit}")
    fp = Footprint("given", "single card", False, base_bytes=72 * u, delta_tier_bytes=int(4.5 * 10**9),
                   dense_bytes=19 * u, expert_delta_bytes=3 << 20, tier_experts=1430, total_experts=44 * 256,
                   served_layers=44, mtp_bytes=0, mtp_exact=False,
                   attention=Attention("mla", 512, 64, 0, layers=44), model={})
    s = PlanSettings(gpu=GPU_PRESETS["rtx-pro-6000"], utilization=0.96, max_model_len=260_000,
                     kv_cache_dtype="fp8_ds_mla", cudagraph_reserve=reserves, activation_reserve=reserves)
    return fp, s


def test_96gb_card_read_as_gib_the_weights_alone_do_not_fit() -> None:
    fp, s = _single_card("GiB")
    p = make_plan(fp, s)
    assert p.budget / GIB == pytest.approx(91.77, abs=0.01)
    assert p.static > p.budget and not p.fits          # 72 + 19 + 4.19 GiB = 95.19 GiB > 91.77 before any KV
    assert p.deciding.startswith("weights")
    assert p.longest_context == 0 and p.max_kv_per_token_layer == 0
    kinds = {x.change for x in p.suggestions}
    assert kinds == {"base-only+context"}               # 3.4 GiB over: only a base-only cache leaves KV room
    (only,) = p.suggestions
    assert make_plan(*_apply(fp, s, only.setting)).fits and 0 <= only.margin < 656 * 44 * s.block_size


def test_96gb_card_read_as_gb_the_kv_cache_decides() -> None:
    fp, s = _single_card("GB")
    p = make_plan(fp, s)
    left = p.budget - (fp.base_bytes + fp.dense_bytes + fp.delta_tier_bytes)
    assert 2.8 * GIB < left < 3 * GIB                    # under 3 GiB for the KV cache and the reserves
    assert p.kv_per_token_layer == 656 and p.kv_layers == 44
    assert p.kv / GIB == pytest.approx(7.0, abs=0.05)    # 260K tokens x 656 B x 44 layers
    assert not p.fits and p.deciding.startswith("KV cache")
    # What would fit: at most 261 B per token per layer at 260K, or ~104K tokens of fp8_ds_mla.
    assert p.max_kv_per_token_layer == left // (p.kv_tokens * 44)
    assert 250 <= p.max_kv_per_token_layer <= 265
    assert p.longest_context * 656 * 44 <= left < (p.longest_context + s.block_size) * 656 * 44
    # So the report's model caches far less than V3's MLA per token, or the 260K are not fully backed.
    with_reserves = make_plan(*_single_card("GB", reserves=None))
    assert with_reserves.max_kv_per_token_layer < p.max_kv_per_token_layer


# --- footprints from real files ---------------------------------------------------------------------------

def test_cache_footprint_is_exact_and_checkpoint_computes_the_same(built: tuple[Path, Path]) -> None:
    src, cache = built
    exact = footprint_from_cache(cache)
    computed = footprint_from_checkpoint(src, "25%")
    assert exact.exact and not computed.exact
    for key in ("base_bytes", "delta_tier_bytes", "dense_bytes", "expert_delta_bytes", "tier_experts",
                "total_experts", "served_layers"):
        assert getattr(exact, key) == getattr(computed, key), key
    # The simple reference: every tensor of every base file, read back with safetensors.
    ref = 0
    for f in sorted((cache / "layers").glob("*.base.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                t = h.get_tensor(name)
                ref += t.numel() * t.element_size()
    assert exact.base_bytes == ref
    assert exact.attention.kind == "mla" and exact.attention.kv_lora_rank == 128
    assert read_footprint(cache).exact and not read_footprint(src).exact


def test_delta_budget_chooses_whole_experts(built: tuple[Path, Path]) -> None:
    _, cache = built
    fp = footprint_from_cache(cache)
    assert footprint_from_cache(cache, "0").delta_tier_bytes == 0
    everything = footprint_from_cache(cache, "100%")
    assert everything.tier_experts == fp.total_experts
    odd = fp.with_tier(5 * fp.expert_delta_bytes - 1)
    assert odd.tier_experts == 4 and odd.delta_tier_bytes == 4 * fp.expert_delta_bytes


def test_plan_refuses_an_incomplete_cache(built: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil
    cache = Path(shutil.copytree(built[1], tmp_path / "c"))
    (cache / "COMMIT.json").unlink()
    with pytest.raises(InputError, match="incomplete"):
        footprint_from_cache(cache)


# --- the plan's promises, on random settings -------------------------------------------------------------

def test_plan_terms_verdict_buys_and_suggestions_hold_on_random_settings(built: tuple[Path, Path]) -> None:
    _, cache = built
    fp = footprint_from_cache(cache)
    mpe = fp.model["max_position_embeddings"]
    rng = np.random.default_rng(5)
    checked_suggestions = checked_buys = 0
    for _ in range(300):
        # A synthetic cache is a few MiB, so the "GPUs" here are MiB-sized too.
        s = PlanSettings(gpu=GpuPreset("test", int(rng.integers(1, 40)) * (64 << 20), ""),
                         utilization=float(rng.uniform(0.5, 0.98)),
                         # mostly within the model's positions, a fifth past them (never fits)
                         max_model_len=int(rng.integers(1, 3_000_000 if rng.random() < 0.2 else mpe + 1)),
                         kv_cache_dtype=str(rng.choice(["fp8_ds_mla", "fp8", "auto", "nvfp4_ds_mla"])),
                         max_num_seqs=int(rng.integers(1, 8)), block_size=int(rng.choice([16, 64, 256])),
                         cudagraph_sizes=tuple(range(1, int(rng.integers(0, 6)) + 1)),
                         activation_reserve=int(rng.integers(0, 64 << 20)))
        f = fp.with_tier(int(rng.integers(0, fp.total_experts + 1)) * fp.expert_delta_bytes)
        p = make_plan(f, s)
        assert p.need == p.base + p.delta + p.dense + p.cudagraph + p.activations + p.kv
        # A context past the model's positions never fits: vLLM refuses it whatever the memory.
        assert p.fits == (p.need <= p.budget and s.max_model_len <= mpe) and p.margin == p.budget - p.need
        if p.fits:
            checked_buys += 1
            assert p.suggestions == ()
            assert make_plan(f, replace(s, max_num_seqs=s.max_num_seqs + p.extra_full_seqs)).fits
            assert not make_plan(f, replace(s, max_num_seqs=s.max_num_seqs + p.extra_full_seqs + 1)).fits
            assert make_plan(f, replace(s, max_model_len=p.context_limit)).fits
            assert not make_plan(f, replace(s, max_model_len=p.longest_context + s.block_size)).fits
            more = f.with_tier(f.delta_tier_bytes + p.extra_delta_experts * f.expert_delta_bytes)
            assert make_plan(more, s).fits
        else:
            assert p.suggestions
            for x in p.suggestions:
                if x.change == "gpu":
                    continue
                checked_suggestions += 1
                assert make_plan(*_apply(f, s, x.setting)).fits, x
    assert checked_suggestions > 50 and checked_buys > 20


def _apply(f: Footprint, s: PlanSettings, setting: str) -> tuple[Footprint, PlanSettings]:
    words = re.sub(r"\([^)]*\)", "", setting).split()          # without the "(N experts, G GiB)" note
    if len(words) > 2:
        return _apply(*_apply(f, s, " ".join(words[:2])), " ".join(words[2:]))
    flag, value = words[:2]
    if flag == "--max-model-len":
        return f, replace(s, max_model_len=int(value))
    if flag == "--max-num-seqs":
        return f, replace(s, max_num_seqs=int(value))
    if flag == "--kv-cache-dtype":
        return f, replace(s, kv_cache_dtype=value)
    if flag == "--delta-budget":
        return f.with_tier(parse_size(value) if value != "0" else 0), s
    raise AssertionError(setting)


def test_speculative_mtp_counts_the_mtp_layer_and_its_kv(built: tuple[Path, Path]) -> None:
    src, _ = built
    fp = footprint_from_checkpoint(src)
    assert fp.mtp_exact and fp.mtp_bytes > 0
    s = PlanSettings(max_model_len=4096)
    off, on = make_plan(fp, s), make_plan(fp, replace(s, speculative="mtp"))
    assert on.kv_layers == off.kv_layers + 1 and on.mtp_weights == fp.mtp_bytes
    assert on.need - off.need == off.mtp_need == fp.mtp_bytes + off.kv_per_token_layer * off.kv_tokens


def test_mtp_bytes_are_exact_when_the_cache_holds_the_mtp_layer(built: tuple[Path, Path], tmp_path: Path) -> None:
    src, plain = built
    fp4 = footprint_from_checkpoint(src).mtp_bytes                # the MTP layer as the source holds it
    lossless = tmp_path / "lossless"
    build_cache(src, lossless, BuildOptions(delta_budget="25%", lossless=True))
    planed = tmp_path / "mtp"
    build_cache(src, planed, BuildOptions(delta_budget="25%", include_mtp=True))
    a, b, c = footprint_from_cache(lossless), footprint_from_cache(planed), footprint_from_cache(plain)
    assert a.mtp_exact and a.mtp_bytes == fp4                    # kept whole, at FP4, among the dense parts
    assert b.mtp_exact and b.mtp_bytes < fp4                     # its experts as base planes
    assert not c.mtp_exact and c.mtp_bytes > 0                   # not in the cache: an estimate
    assert a.dense_bytes == b.dense_bytes == c.dense_bytes       # the MTP layer is never in the dense term
    assert b.served_layers == c.served_layers and b.base_bytes == c.base_bytes
