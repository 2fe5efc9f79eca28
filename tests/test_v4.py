"""DeepSeek-V4 as shipped: names, hash layers, per-tensor expert formats (ModelOpt / compressed-tensors NVFP4,
MXFP4), compact e8m0 scales, the model folder (hub snapshots), the one header reader, in all three forms."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from moet_cache import BuildOptions, build_cache
from moet_cache.cache import layout as L
from moet_cache.build import retier_cache
from moet_cache.source.checkpoint import MODELOPT, MXFP4_LAYOUT, open_checkpoint
from moet_cache.errors import InputError, UnsupportedCheckpointError, VerificationError
from moet_cache.source.exporter import export_checkpoint
from moet_cache.format.families import DeepseekV3, DeepseekV4, detect_family
from moet_cache.format.formats import (CT_NVFP4, E4M3_16, E8M0_32, MODELOPT_NVFP4, MXFP4, compact_e8m0, e4m3_shift,
                                e8m0_to_e4m3, scale_values)
from moet_cache.cache.geometry import LayerGeometry
from moet_cache.load import open_cache
from moet_cache.format.modelconfig import ModelConfig
from moet_cache.stheader import read_header
from moet_cache.source.synthetic import make_v4_checkpoint, small_v4_spec, v4_config_for, vllm_v4_spec
from moet_cache.verify import VERIFIED, boot_check, full_verify, verify_against

from faults.campaign import recommit, rewrite_json

VARIANTS = ("hybrid", "mxfp4", "nvfp4", "ct-nvfp4")


@pytest.fixture(scope="session")
def v4_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4src")
    return {v: make_v4_checkpoint(root / v, small_v4_spec(v, n_routed_experts=8, seed=i))
            for i, v in enumerate(VARIANTS)}


@pytest.fixture(scope="session")
def v4_lossless(tmp_path_factory: pytest.TempPathFactory, v4_sources: dict[str, Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4cache")
    out = {}
    for v, src in v4_sources.items():
        build_cache(src, root / v, BuildOptions(lossless=True, include_mtp=True, delta_budget="30%"))
        out[v] = root / v
    return out


def test_family_and_formats_per_tensor(v4_sources: dict[str, Path]) -> None:
    with open_checkpoint(v4_sources["hybrid"]) as ck:
        assert isinstance(ck.family, DeepseekV4) and ck.layout == MODELOPT
        assert ck.family.moe_layers == (0, 1, 2, 3) and ck.family.mtp_layers == (4,)
        assert ck.layer_format(0) is MODELOPT_NVFP4 and ck.layer_format(4) is MXFP4  # one checkpoint, two formats
        assert ck.family.expert_prefix(4, 3, "down_proj") == "mtp.0.ffn.experts.3.w2"
        assert ck.family.expert_prefix(2, 1, "up_proj") == "layers.2.ffn.experts.1.w3"
        assert ck.family.parse_expert("mtp.0.ffn.experts.3.w1.scale") == (4, 3, "gate_proj", "scale")
        assert ck.family.parse_expert("layers.1.ffn.shared_experts.w1.weight") is None
        # hash layer: tid2eid int32, no gate bias; the others a bias; FP8 attention with e8m0 scales
        assert ck.tensors["layers.0.ffn.gate.tid2eid"].dtype == "I32" and "layers.0.ffn.gate.bias" not in ck.tensors
        assert "layers.1.ffn.gate.bias" in ck.tensors and "layers.1.ffn.gate.tid2eid" not in ck.tensors
        assert ck.tensors["layers.1.attn.wq_a.scale"].dtype == "F8_E8M0"
        assert ck.tensors["layers.1.ffn.shared_experts.w1.weight"].dtype == "F8_E4M3"
        ck.validate_experts([0, 1, 2, 3, 4])
    with open_checkpoint(v4_sources["mxfp4"]) as ck:
        assert ck.layout == MXFP4_LAYOUT and ck.layer_format(0) is MXFP4
    with open_checkpoint(v4_sources["ct-nvfp4"]) as ck:
        assert ck.layer_format(0) is CT_NVFP4 and ck.layer_format(4) is CT_NVFP4
    cfg = json.loads((v4_sources["hybrid"] / "config.json").read_text())
    assert cfg["compress_ratios"] == [0, 4, 128, 4, 0] and "kv_lora_rank" not in cfg
    assert (v4_sources["hybrid"] / "encoding" / "encoding_dsv4.py").is_file()


def test_the_cast_is_exact_powers_of_two_in_pairs(v4_sources: dict[str, Path]) -> None:
    with open_checkpoint(v4_sources["nvfp4"]) as ck:
        x = ck.read_raw_expert(1, 2, "gate_proj")
        up = ck.read_raw_expert(1, 2, "up_proj")
        # Model-Optimizer's cast: scale_2 = 2^m, m = max(k_max(w1), k_max(w3)) - 8, e4m3 = 2^(k - m)
        k_max = max(np.log2(scale_values(y.scale_bytes, E4M3_16)).max() for y in (x, up)) + np.log2(x.scale_2)
        assert x.scale_2 == up.scale_2 == 2.0 ** (k_max - 8) and compact_e8m0(x.scale_bytes) is not None
        values = scale_values(x.scale_bytes, E4M3_16)
        assert np.array_equal(values[:, 0::2], values[:, 1::2])
        assert np.array_equal(np.exp2(np.round(np.log2(values))), values)


def test_unknown_family_is_refused_naming_what_was_found() -> None:
    m = ModelConfig.from_dict({"num_hidden_layers": 2, "hidden_size": 64, "moe_intermediate_size": 32,
                               "n_routed_experts": 4})
    with pytest.raises(UnsupportedCheckpointError, match="model_type 'glm4_moe'.*model.layers.0.mlp.experts.0"):
        detect_family({"model_type": "glm4_moe"}, m, ["model.layers.0.mlp.experts.0.gate_proj.weight"])
    with pytest.raises(UnsupportedCheckpointError, match="blocks.0.moe.w"):
        detect_family({}, m, ["blocks.0.moe.w.weight"])
    # the config says V4 and the names are V3's: refused, not guessed
    with pytest.raises(UnsupportedCheckpointError):
        detect_family({"model_type": "deepseek_v4"}, m, ["model.layers.0.mlp.experts.0.gate_proj.weight"])
    assert isinstance(detect_family({"model_type": "deepseek_v3"}, m, ["model.layers.1.mlp.experts.0.up_proj.weight"]),
                      DeepseekV3)


def test_all_forms_build_verify_export_retier(v4_sources: dict[str, Path], v4_lossless: dict[str, Path],
                                              tmp_path: Path) -> None:
    for v in VARIANTS:
        src, cache = v4_sources[v], v4_lossless[v]
        assert boot_check(cache).state == VERIFIED
        assert full_verify(cache).state == VERIFIED
        rep = verify_against(cache, src)
        assert rep.state == VERIFIED and rep.details["experts"] == 5 * 8 and rep.details["dense_tensors"] > 100
        for layer in range(5):
            lm = json.loads((cache / L.layer_manifest(layer)).read_text())
            want = {"hybrid": "mxfp4" if layer == 4 else "modelopt-nvfp4", "mxfp4": "mxfp4",
                    "nvfp4": "modelopt-nvfp4", "ct-nvfp4": "ct-nvfp4"}[v]
            assert lm["source_format"] == want and lm["kind"] == ("mtp" if layer == 4 else "moe")
            assert lm["scale_forms"] == {L.W13_SCALE: E8M0_32, L.W2_SCALE: E8M0_32}
        out = tmp_path / f"export-{v}"
        export_checkpoint(cache, out)
        with open_checkpoint(src) as a, open_checkpoint(out) as b:
            assert set(a.tensors) == set(b.tensors)
            for n, t in a.tensors.items():  # every tensor bit for bit, in its own dtype and shape
                assert (t.dtype, t.shape) == (b.tensors[n].dtype, b.tensors[n].shape), n
                assert np.array_equal(a.read(n), b.read(n)), n
        for p in src.rglob("*"):
            if p.is_file() and not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json":
                assert (out / p.relative_to(src)).read_bytes() == p.read_bytes()
    cache = tmp_path / "retier"
    shutil.copytree(v4_lossless["hybrid"], cache)
    r = retier_cache(cache, "10%")
    assert r.tier_experts > 0 and boot_check(cache).state == VERIFIED
    assert verify_against(cache, v4_sources["hybrid"]).state == VERIFIED


def test_compact_scales_halve_the_scale_bytes(v4_lossless: dict[str, Path]) -> None:
    cache = v4_lossless["hybrid"]
    with safe_open(str(cache / L.base_file(1)), "pt") as f:
        s13, s2 = f.get_tensor(L.W13_SCALE), f.get_tensor(L.W2_SCALE)
        assert s13.dtype == torch.float8_e8m0fnu and s13.shape == (8, 2 * 128, 256 // 32)
        assert s2.dtype == torch.float8_e8m0fnu and s2.shape == (8, 256, 128 // 32)
        s2 = f.get_tensor(L.W13_SCALE_2)
        assert float(s2[0, 0]) == float(s2[0, 1]) and np.log2(float(s2[0, 0])).is_integer()
    e4, e8 = LayerGeometry(256, 4096, 2048), LayerGeometry(256, 4096, 2048, E8M0_32, E8M0_32)
    assert e4.base_bytes - e8.base_bytes == 256 * 3 * 4096 * 2048 // 32  # one byte per 32 weights saved
    assert e8.base_bytes / e8.weights == pytest.approx(0.25 + 1 / 32, rel=1e-4)


def test_loader_expand_gives_stock_nvfp4_scales(v4_sources: dict[str, Path], v4_lossless: dict[str, Path]) -> None:
    for v in ("hybrid", "mxfp4"):
        cache = open_cache(v4_lossless[v])
        with open_checkpoint(v4_sources[v]) as ck:
            compact = {x.index: x.tensors for x in cache.load(delta="all", layers=[1, 4])}
            stock = {x.index: x.tensors for x in cache.load(delta="all", layers=[1, 4], expand=True)}
            for layer in (1, 4):
                t, s = compact[layer], stock[layer]
                assert t[L.W13_SCALE].dtype == torch.float8_e8m0fnu and t[L.W13_SCALE].shape[-1] == 256 // 32
                assert s[L.W13_SCALE].dtype == torch.float8_e4m3fn and s[L.W13_SCALE].shape[-1] == 256 // 16
                for e in (0, 5):
                    for proj, (fused, scale, s2, k) in {"gate_proj": ("w13_weight", L.W13_SCALE, L.W13_SCALE_2, 0),
                                                        "up_proj": ("w13_weight", L.W13_SCALE, L.W13_SCALE_2, 1),
                                                        "down_proj": ("w2_weight", L.W2_SCALE, L.W2_SCALE_2, None)}.items():
                        x = ck.read_raw_expert(layer, e, proj)
                        rows = slice(0, 128) if k == 0 else slice(128, 256) if k == 1 else slice(None)
                        assert np.array_equal(s[fused][e][rows].numpy(), x.codes)
                        scale_2 = float(s[s2][e, k] if k is not None else s[s2][e])
                        got = s[scale][e][rows].to(torch.float32).numpy() * scale_2
                        want = np.repeat(scale_values(x.scale_bytes, x.fmt.scale_form), 2 if x.fmt is MXFP4 else 1,
                                         axis=-1) * x.scale_2
                        assert np.array_equal(got, want)
                        if x.fmt is MODELOPT_NVFP4:  # the cast's own e4m3 bytes and scale_2 come back
                            assert np.array_equal(s[scale][e][rows].view(torch.uint8).numpy(), x.scale_bytes)
                            assert scale_2 == x.scale_2
                        ck.release(x.codes)
        cache.release()


def test_non_power_of_two_scales_stay_e4m3(v4_sources: dict[str, Path], tmp_path: Path) -> None:
    src = Path(shutil.copytree(v4_sources["nvfp4"], tmp_path / "src"))
    name = "layers.2.ffn.experts.7.w2.weight_scale"
    with open_checkpoint(src) as ck:
        info, ent = ck.tensors[name], ck.offsets[name]
    shard = src / info.shard
    with open(shard, "r+b") as f:  # one scale of one expert becomes 3 * 2^-4 (not a power of two)
        f.seek(ent.begin + 5)
        f.write(bytes([0x3C]))
    cache = tmp_path / "cache"
    build_cache(src, cache, BuildOptions(lossless=True))
    lm = json.loads((cache / L.layer_manifest(2)).read_text())
    assert lm["scale_forms"] == {L.W13_SCALE: E8M0_32, L.W2_SCALE: E4M3_16}  # decided per tensor group
    assert verify_against(cache, src).state == VERIFIED
    export_checkpoint(cache, tmp_path / "out")
    with open_checkpoint(tmp_path / "out") as b, open_checkpoint(src) as a:
        assert np.array_equal(a.read(name), b.read(name))


def test_hub_snapshot_links_are_followed_and_config_is_required(v4_sources: dict[str, Path], tmp_path: Path) -> None:
    # a Hugging Face hub cache: snapshots/<rev>/ holds links into ../../blobs
    repo = tmp_path / "models--x--v4"
    snap = repo / "snapshots" / "abc123"
    for p in sorted(v4_sources["hybrid"].rglob("*")):
        if p.is_file():
            blob = repo / "blobs" / f"{abs(hash(p.name))}-{p.name}"
            blob.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, blob)
            link = snap / p.relative_to(v4_sources["hybrid"])
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(blob, link.parent), link)
    cache = tmp_path / "cache"
    build_cache(snap, cache, BuildOptions())
    # the source's config.json is kept byte for byte as config.source.json (config.json is the one served
    # to vLLM: quant_method moet, the source's block inside)
    for rel, src in (("config.source.json", "config.json"), ("hf_quant_config.json",) * 2,
                     ("generation_config.json",) * 2, ("tokenizer.json",) * 2, ("tokenizer_config.json",) * 2,
                     ("encoding/encoding_dsv4.py",) * 2):
        got = cache / L.AUX_DIR / rel
        assert got.is_file() and not got.is_symlink() and got.read_bytes() == (snap / src).read_bytes(), rel
    served = json.loads((cache / L.AUX_DIR / "config.json").read_text())["quantization_config"]
    assert served["quant_method"] == "moet" and served["source"] == json.loads((snap / "config.json").read_text())[
        "quantization_config"]
    assert boot_check(cache).state == VERIFIED
    # a cache whose manifest lists no config never verifies as complete
    doc = json.loads((cache / "cache.json").read_bytes())
    doc["files"] = [f for f in doc["files"] if f["path"] != "model/config.json"]
    rewrite_json(cache / "cache.json", doc)
    recommit(cache)
    rep = boot_check(cache)
    assert not rep.complete and any("config.json" in p.detail for p in rep.problems)
    with pytest.raises(VerificationError):
        open_cache(cache)


def test_served_blocks_default_and_include_mtp(v4_sources: dict[str, Path], tmp_path: Path) -> None:
    r = build_cache(v4_sources["hybrid"], tmp_path / "a", BuildOptions())
    assert r.layers == (0, 1, 2, 3)
    src_map = json.loads((tmp_path / "a" / L.SOURCE_MAP).read_text())
    assert not any(n.startswith("mtp.") for s in src_map["shards"] for n, _, _ in s["tensors"])
    r = build_cache(v4_sources["hybrid"], tmp_path / "b", BuildOptions(include_mtp=True))
    assert r.layers == (0, 1, 2, 3, 4)
    with pytest.raises(InputError, match="--include-mtp"):
        build_cache(v4_sources["hybrid"], tmp_path / "c", BuildOptions(layers="3-4"))


def test_header_reader_is_strict(tmp_path: Path) -> None:
    from moet_cache.stwriter import SafetensorsWriter, TensorSpec
    p = tmp_path / "a.safetensors"
    with SafetensorsWriter(p, [TensorSpec("s", "F8_E8M0", (4, 2)), TensorSpec("t", "I32", (3,))]) as w:
        w.write("s", np.arange(8, dtype=np.uint8))
        w.write("t", np.arange(3, dtype="<i4"))
        w.commit()
    h = read_header(p)
    assert h.tensors["s"].dtype == "F8_E8M0" and h.tensors["t"].end - h.tensors["t"].begin == 12
    blob = p.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    doc = json.loads(blob[8:8 + n])
    for bad, match in ((dict(doc, t={"dtype": "I32", "shape": [4], "data_offsets": [8, 20]}), "need 16"),
                       (dict(doc, t={"dtype": "Q7", "shape": [3], "data_offsets": [8, 20]}), "cannot carry"),
                       (dict(doc, t={"dtype": "I32", "shape": [-3], "data_offsets": [8, 20]}), "malformed"),
                       (dict(doc, t={"dtype": "I32", "shape": [300], "data_offsets": [8, 1208]}), "ends at byte")):
        raw = json.dumps(bad).encode()
        p.write_bytes(len(raw).to_bytes(8, "little") + raw + blob[8 + n:])
        with pytest.raises(InputError, match=match):
            read_header(p)
    p.write_bytes(blob[:20])
    with pytest.raises(InputError, match="header length"):
        read_header(p)


def test_e8m0_e4m3_round_trip_and_shift() -> None:
    rng = np.random.default_rng(0)
    e8 = rng.integers(127 - 18, 127, size=(6, 8), dtype=np.uint8)
    assert np.array_equal(compact_e8m0(e8m0_to_e4m3(e8, -9)), (e8.astype(np.int16) + 9).astype(np.uint8))
    wide = np.array([[125, 140]], dtype=np.uint8)           # 2^-2 .. 2^13: needs a shift into scale_2
    shift = e4m3_shift(wide)
    assert shift == 5 and np.array_equal(scale_values(e8m0_to_e4m3(wide, shift), E4M3_16) * 2.0 ** shift,
                                         np.repeat(scale_values(wide, E8M0_32), 2, axis=-1))
    with pytest.raises(InputError):
        e8m0_to_e4m3(np.array([[100, 160]], dtype=np.uint8), 0)


def test_vllm_variant_has_what_vllm_reads(tmp_path: Path) -> None:
    spec = vllm_v4_spec()
    cfg = v4_config_for(spec)
    for key in ("hc_mult", "hc_sinkhorn_iters", "hc_eps", "o_groups", "o_lora_rank", "q_lora_rank", "index_n_heads",
                "index_head_dim", "index_topk", "compress_ratios", "num_hash_layers", "swiglu_limit", "head_dim",
                "sliding_window", "scoring_func", "routed_scaling_factor", "norm_topk_prob", "rms_norm_eps"):
        assert key in cfg, key
    assert cfg["compress_ratios"] == [0, 4, 128] and cfg["num_hidden_layers"] == 3 and cfg["n_routed_experts"] == 64
    src = make_v4_checkpoint(tmp_path / "v", spec)
    with open_checkpoint(src) as ck:
        assert ck.tensors["layers.1.attn.wq_a.weight"].dtype == "BF16"
        assert "layers.1.attn.indexer.weights_proj.weight" in ck.tensors
        assert "layers.2.attn.compressor.ape" in ck.tensors and "layers.2.attn.indexer.wq_b.weight" not in ck.tensors
        assert ck.layer_format(0) is MODELOPT_NVFP4 and not ck.family.mtp_layers
