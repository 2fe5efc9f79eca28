"""The drafter served from the cache, with vLLM's real classes on a CPU (marker vllm): the moet loader fills the
drafter blocks' routed experts of vLLM's draft models (DSpark: block K at `model.layers.K`, built as layer
num_hidden_layers + K; MTP: `model.layers.{num_hidden_layers + K}.mtp_block`), and the moet method computes
them on the planes, base-only or with the tier, nothing expanded to FP4.

vLLM's own DeepSeek-V4 draft models cannot be built on a CPU (vllm/models/deepseek_v4/cpu/dspark.py and mtp.py
raise NotImplementedError "DeepSeek-V4 speculative decoding (DSpark|MTP) is not implemented on CPU."), so
each drafter block's MoE is vLLM's FusedMoE at the place and under the prefix those models give it
(vllm/models/deepseek_v4/nvidia/dspark.py, mtp.py), as tests/test_vllm_quant.py builds the main layers'.
"""

from __future__ import annotations

import gc
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import moet_cache.load.engine as load_engine
from moet_cache import BuildOptions, build_cache
from moet_cache.load import open_cache
from moet_cache.plan.measure import footprint_from_cache
from moet_cache.runtime import fused_moe
from moet_cache.runtime.dequant import LayerPlanes
from moet_cache.runtime.reference import fused_moe_reference
from moet_cache.source.synthetic import dspark_v4_spec, make_v4_checkpoint, small_v4_spec

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm.model_executor.layers.quantization", reason="vLLM is not installed")
from moet_cache.integrations.vllm.loader import PluginOptions, load_into_model  # noqa: E402 (imports vLLM)
from moet_cache.integrations.vllm.plugin import register  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "drafter_resident.py"
E, H, I, TOP_K, N = 16, 256, 128, 4, 4    # the tiny V4's experts; N main layers, drafter blocks from layer N
LIMIT = 10.0                              # the tiny V4's swiglu_limit


@pytest.fixture
def vllm_config(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A default VllmConfig, current while the test builds layers (as tests/test_vllm_quant.py)."""
    import vllm.triton_utils
    from vllm.config import VllmConfig, set_current_vllm_config
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    cfg = VllmConfig()
    with set_current_vllm_config(cfg):
        yield cfg


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A DSpark cache (three blocks, a tier over every layer) and an MTP one, built with the drafter."""
    root = tmp_path_factory.mktemp("drafter-vllm")
    out = {}
    for layout, spec in (("dspark", dspark_v4_spec(n_routed_experts=E, seed=5)),
                         ("mtp", small_v4_spec(n_routed_experts=E, seed=6))):
        src = make_v4_checkpoint(root / f"{layout}-src", spec)
        build_cache(src, root / layout, BuildOptions(include_mtp=True, delta_budget="40%"))
        out[layout] = root / layout
    return out


class _Model(nn.Module):
    """A vLLM model's layout around real fused-MoE layers; the dense tensors it is handed are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.dense: list[str] = []
        self.model = nn.Module()

    def load_weights(self, weights: Any) -> set[str]:
        self.dense += [name for name, _ in weights]
        return set(self.dense)


def _ffn(qc: Any, built_as: int) -> nn.Module:
    """A DeepSeek-V4 decoder layer's ffn: vLLM's FusedMoE built at layer `built_as` under the moet config."""
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    ffn = nn.Module()
    ffn.experts = FusedMoEFactory(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                                  params_dtype=torch.bfloat16, quant_config=qc, tp_size=1, dp_size=1, pcp_size=1,
                                  prefix=f"model.layers.{built_as}.ffn.experts", swiglu_limit=LIMIT)
    return ffn


def _quant_config(cache: Path) -> Any:
    register()
    block = json.loads((cache / "model" / "config.json").read_text())["quantization_config"]
    return vllm.get_quantization_config("moet").from_config(block)


def _dspark_model(cache: Path) -> _Model:
    """vLLM 0.34's DSparkDeepseekV4Model: nn.ModuleList of the blocks, each DeepseekV4DecoderLayer built with
    prefix model.layers.{num_hidden_layers + i}."""
    qc, model = _quant_config(cache), _Model()
    model.model.layers = nn.ModuleList()
    for k in range(3):
        block = nn.Module()
        block.ffn = _ffn(qc, N + k)
        model.model.layers.append(block)
    return model


def _mtp_model(cache: Path) -> _Model:
    """vLLM 0.34's DeepSeekV4MultiTokenPredictor: nn.ModuleDict keyed num_hidden_layers + K, the decoder layer
    as mtp_block, built with prefix model.layers.{num_hidden_layers + K}."""
    qc, model = _quant_config(cache), _Model()
    model.model.layers = nn.ModuleDict()
    block = nn.Module()
    block.mtp_block = nn.Module()
    block.mtp_block.ffn = _ffn(qc, N)
    model.model.layers[str(N)] = block
    return model


def _main_model(cache: Path) -> _Model:
    qc, model = _quant_config(cache), _Model()
    model.model.layers = nn.ModuleList()
    for i in range(N):
        layer = nn.Module()
        layer.ffn = _ffn(qc, i)
        model.model.layers.append(layer)
    return model


def _routed(seed: int, must: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(6)]).to(torch.int32)
    if must is not None:  # every token routes `must` first, once
        ids[:, 1:] = torch.where(ids[:, 1:] == must, (must + 1) % E, ids[:, 1:])
        ids[:, 0] = must
    return x, torch.rand(6, TOP_K, generator=g), ids


def _experts_of(model: _Model, layout: str) -> dict[int, Any]:
    if layout == "dspark":
        return {N + k: block.ffn.experts.routed_experts for k, block in enumerate(model.model.layers)}
    return {int(key): block.mtp_block.ffn.experts.routed_experts for key, block in model.model.layers.items()}


@pytest.mark.parametrize("layout", ["dspark", "mtp"])
@pytest.mark.parametrize("delta", ["tier", "none"])
def test_the_draft_models_experts_are_loaded_and_computed_on_the_planes(caches: dict[str, Path], vllm_config: Any,
                                                                         layout: str, delta: str) -> None:
    cache = caches[layout]
    model = (_dspark_model if layout == "dspark" else _mtp_model)(cache)
    experts = _experts_of(model, layout)
    assert all(type(x.quant_method).__name__ == "MoetMoEMethod" for x in experts.values())
    summary = load_into_model(model, PluginOptions(cache=str(cache), workers=1, delta=delta))
    assert summary.layers == tuple(sorted(experts)) and not summary.expanded
    want = {x.index: x.tensors for x in open_cache(cache).load(delta=delta, workers=1, layers=sorted(experts))}
    drafter_dense = {n for p in sorted((cache / "dense").glob("*.json"))
                     for n in (t["name"] for t in json.loads(p.read_text())["tensors"]) if n.startswith("mtp.")}
    assert drafter_dense <= set(model.dense)  # the head stack among them: the draft model's load_weights maps them
    tiered = 0
    for layer, ex in experts.items():
        held = {n: getattr(ex, n) for n in ex.moet_tensor_names}
        assert "w13_weight" not in dict(ex.named_parameters())  # nothing expanded to FP4
        assert set(want[layer]) <= set(held)  # base-only: the tier's buffers stay empty
        assert all(held[n].numel() == 0 for n in set(held) - set(want[layer]))
        for name, t in want[layer].items():
            assert torch.equal(held[name].view(torch.uint8) if t.dim() else held[name],
                               t.view(torch.uint8) if t.dim() else t), (layer, name)
        rows = held["delta_experts"].tolist()
        tiered += len(rows)
        x, w, ids = _routed(layer, must=rows[0] if rows else None)
        out = ex.quant_method.apply(ex, x, w, ids, None, None)
        assert out.dtype == x.dtype and out.abs().sum() > 0
        assert torch.equal(out, fused_moe(x, want[layer], w, ids, swiglu_limit=LIMIT))
        ref = fused_moe_reference(x, LayerPlanes.from_tensors(want[layer]), w, ids, swiglu_limit=LIMIT)
        assert torch.equal(out, ref.to(x.dtype))
    assert (tiered > 0) == (delta == "tier")
    # resident: the planes, scales and tier rows the cache holds for these layers, byte for byte
    resident = sum(getattr(ex, n).nbytes for ex in experts.values() for n in ex.moet_tensor_names)  # empty: 0
    assert resident == sum(t.nbytes for ts in want.values() for t in ts.values())


def test_a_tier_expert_of_a_drafter_block_is_served_at_fp4(caches: dict[str, Path], vllm_config: Any) -> None:
    """The same routed tokens through a drafter block, base-only and with the tier: they differ exactly where the
    tier holds the expert's low bits."""
    from vllm.config import VllmConfig, set_current_vllm_config
    outs = {}
    for delta in ("none", "tier"):
        with set_current_vllm_config(VllmConfig()):  # each model its own layer names, as in its own vLLM
            model = _dspark_model(caches["dspark"])
        load_into_model(model, PluginOptions(cache=str(caches["dspark"]), workers=1, delta=delta))
        experts = _experts_of(model, "dspark")
        layer = next(x for x, ex in experts.items() if getattr(ex, "delta_experts").numel()) if delta == "tier" else None
        outs[delta] = (experts, layer)
    experts_t, layer = outs["tier"]
    experts_b, _ = outs["none"]
    tier_expert = int(experts_t[layer].delta_experts[0])
    x, w, ids = _routed(7, must=tier_expert)
    with_tier = experts_t[layer].quant_method.apply(experts_t[layer], x, w, ids, None, None)
    base_only = experts_b[layer].quant_method.apply(experts_b[layer], x, w, ids, None, None)
    assert not torch.equal(with_tier, base_only)
    others = torch.tensor([e for e in range(E) if e not in set(experts_t[layer].delta_experts.tolist())][:TOP_K],
                          dtype=torch.int32).repeat(6, 1)
    assert torch.equal(experts_t[layer].quant_method.apply(experts_t[layer], x, w, others, None, None),
                       experts_b[layer].quant_method.apply(experts_b[layer], x, w, others, None, None))


def test_the_main_model_loads_only_its_layers_from_a_cache_with_a_drafter(caches: dict[str, Path],
                                                                           vllm_config: Any) -> None:
    model = _main_model(caches["dspark"])
    summary = load_into_model(model, PluginOptions(cache=str(caches["dspark"]), workers=1))
    assert summary.layers == (0, 1, 2, 3)
    want = next(x.tensors for x in open_cache(caches["dspark"]).load(workers=1, layers=[2]))
    got = model.model.layers[2].ffn.experts.routed_experts
    assert torch.equal(got.w13_base, want["w13_base"])


def test_vllms_dspark_loader_maps_every_drafter_tensor_of_the_cache(caches: dict[str, Path]) -> None:
    """vLLM's own DSpark name mapping (DSparkDeepseekV4ForCausalLM._remap_dspark_name, the class cannot be built
    on a CPU) takes every drafter tensor the cache holds to a draft-model parameter, the head stack at model level."""
    from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4ForCausalLM
    names = {n for p in sorted((caches["dspark"] / "dense").glob("*.json"))
             for n in (t["name"] for t in json.loads(p.read_text())["tensors"]) if n.startswith("mtp.")}
    fake = SimpleNamespace(model=SimpleNamespace(confidence_head=object()))
    mapped = {n: DSparkDeepseekV4ForCausalLM._remap_dspark_name(fake, n) for n in names}
    assert all(v is not None for v in mapped.values())
    assert {mapped[n] for n in ("mtp.0.main_proj.weight", "mtp.2.markov_head.markov_w1.weight",
                                "mtp.2.confidence_head.proj.weight", "mtp.2.hc_head_fn", "mtp.2.norm.weight")} == {
        "model.main_proj.weight", "model.markov_head.markov_w1.weight", "model.confidence_head.proj.weight",
        "model.hc_head_fn", "model.norm.weight"}
    assert mapped["mtp.1.attn.wkv.weight"] == "model.layers.1.attn.wkv.weight"


def test_vllms_mtp_loader_maps_every_drafter_tensor_of_the_cache(caches: dict[str, Path]) -> None:
    """vLLM's own MTP name mapping (DeepSeekV4MTP's _to_spec_layer_name and _rewrite_spec_layer_name) takes
    every drafter tensor of the cache to block num_hidden_layers + K, the decoder block under `mtp_block`,
    where the loader looks for its experts."""
    from vllm.models.deepseek_v4.nvidia.mtp import DeepSeekV4MTP, get_spec_layer_idx_from_weight_name
    cfg = json.loads((caches["mtp"] / "model" / "config.json").read_text())
    fake = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=cfg["num_hidden_layers"],
                                                  num_nextn_predict_layers=cfg["num_nextn_predict_layers"]))
    names = {n for p in sorted((caches["mtp"] / "dense").glob("*.json"))
             for n in (t["name"] for t in json.loads(p.read_text())["tensors"]) if n.startswith("mtp.")}
    mapped = {}
    for n in names:
        spec = DeepSeekV4MTP._to_spec_layer_name(fake, n)
        assert get_spec_layer_idx_from_weight_name(fake.config, spec) == N, n
        mapped[n] = DeepSeekV4MTP._rewrite_spec_layer_name(fake, N, spec)
    assert mapped["mtp.0.e_proj.weight"] == f"model.layers.{N}.e_proj.weight"
    assert mapped["mtp.0.hc_head_fn"] == f"model.layers.{N}.hc_head_fn"
    assert mapped["mtp.0.attn.wkv.weight"] == f"model.layers.{N}.mtp_block.attn.wkv.weight"
    assert mapped["mtp.0.ffn.gate.weight"] == f"model.layers.{N}.mtp_block.ffn.gate.weight"


def _storage_bytes(modules: Any) -> int:
    """The bytes the modules' tensors (parameters and buffers) keep allocated: each storage once, whole."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for m in modules for t in (*m.parameters(), *m.buffers()) if t.numel()}
    return sum(storages.values())


def _one_buffer_a_job(read_host: Any) -> Any:
    """read_host, its tensors handed out as views of one buffer a job, 256-byte aligned, as a GPU load hands
    them out (load/staging.py CudaStaging.job)."""
    def read(files: Any, job: Any, chunk: int, verify_hash: bool) -> dict[str, torch.Tensor]:
        tensors = read_host(files, job, chunk, verify_hash)
        offsets, pos = {}, 0
        for name, t in tensors.items():
            offsets[name], pos = pos, -(-(pos + t.nbytes) // 256) * 256
        flat = torch.empty(pos, dtype=torch.uint8)
        out = {}
        for name, t in tensors.items():
            view = flat[offsets[name]:offsets[name] + t.nbytes].view(t.dtype).reshape(t.shape)
            view.copy_(t)
            out[name] = view
        return out
    return read


def test_the_layers_keep_only_their_tensors_when_a_load_hands_out_views_of_one_buffer(
        caches: dict[str, Path], vllm_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU a layer's tensors arrive as views of one device buffer: the tier rows kept as the layer's buffers
    keep their own bytes, not the buffer that also held the planes copied into the parameters; the drafter's
    layers then hold the plane bytes `plan` counts for the drafter, and the main model's layers likewise theirs."""
    monkeypatch.setattr(load_engine, "read_host", _one_buffer_a_job(load_engine.read_host))
    drafter = footprint_from_cache(caches["dspark"]).drafter
    assert drafter is not None
    draft, target = _dspark_model(caches["dspark"]), _main_model(caches["dspark"])
    for model in (draft, target):
        load_into_model(model, PluginOptions(cache=str(caches["dspark"]), workers=1, delta="tier"))
    drafter_layers = _experts_of(draft, "dspark")
    for layers in (drafter_layers, {i: x.ffn.experts.routed_experts for i, x in enumerate(target.model.layers)}):
        assert sum(ex.delta_experts.numel() for ex in layers.values()) > 0  # tier rows were loaded
        held = [getattr(ex, n) for ex in layers.values() for n in ex.moet_tensor_names]
        assert all(t.untyped_storage().nbytes() == t.nbytes for t in held)
        assert _storage_bytes(layers.values()) == sum(t.nbytes for t in held)
    rows = sum(ex.delta_experts.nbytes for ex in drafter_layers.values())  # int64 a tier row: not a plane byte
    assert _storage_bytes(drafter_layers.values()) == drafter.expert_bytes + drafter.tier_bytes + rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("delta", ["tier", "none"])
def test_the_drafters_moe_layers_on_the_gpu_hold_their_plane_bytes(caches: dict[str, Path], vllm_config: Any,
                                                                    delta: str) -> None:
    """The DSpark drafter's MoE layers built on CUDA as vLLM builds them (create_weights, the moet loader,
    process_weights_after_loading: the kernels' layout and their compile): the GPU memory they hold
    (torch.cuda.memory_allocated before and after) is the plane bytes `plan` counts for the drafter (planes,
    scales, tables; the tier rows with delta "tier") within 1%, and each tensor holds only its own bytes.
    benchmarks/drafter_resident.py measures the same at V4-Flash's width."""
    cache = caches["dspark"]
    drafter = footprint_from_cache(cache).drafter
    assert drafter is not None
    planes = drafter.expert_bytes + (drafter.tier_bytes if delta == "tier" else 0)
    before = _settled_cuda()
    with torch.device("cuda"):
        model = _dspark_model(cache)
    load_into_model(model, PluginOptions(cache=str(cache), workers=1, delta=delta))
    experts = _experts_of(model, "dspark")
    for ex in experts.values():
        ex.quant_method.process_weights_after_loading(ex)
    held = _settled_cuda() - before
    tensors = [t for ex in experts.values() for t in (*ex.parameters(), *ex.buffers()) if t.numel()]
    assert tensors and all(t.is_cuda for t in tensors)
    rows = sum(ex.delta_experts.nbytes for ex in experts.values() if hasattr(ex, "delta_experts"))
    assert (rows > 0) == (delta == "tier")
    assert _storage_bytes(experts.values()) == planes + rows  # each tensor its own bytes, no buffer kept whole
    # what the allocator must hold for them: each storage in its blocks of 512 bytes (the tiny layers' tensors
    # are all in its small-block pool, where a block is split to that size)
    blocks = sum(-(-n // 512) * 512 for n in {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                              for t in tensors}.values())
    assert held >= blocks, (held, blocks)
    assert abs(held - planes) <= 0.01 * planes, (held, blocks, planes)


def _settled_cuda() -> int:
    """CUDA's allocated bytes once freed tensors are gone and the allocator released its unused blocks."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def test_the_resident_bytes_benchmark_counts_the_drafters_tensors_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/drafter_resident.py at a tiny width on the CPU, where it counts the layers' tensors' storages:
    they are the plane bytes `plan` counts for the drafter, plus the tier's expert ids (8 bytes a row)."""
    spec = importlib.util.spec_from_file_location("drafter_resident", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "drafter-resident-cpu.json"
    assert bench.main(["--device", "cpu", "--hidden", "256", "--inter", "128", "--experts", "8", "--workers", "1",
                       "--workdir", str(tmp_path), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["command"][0] == "benchmarks/drafter_resident.py"
    r = doc["result"]
    drafter = footprint_from_cache(tmp_path / "cache").drafter
    assert drafter is not None and drafter.tier_experts > 0
    assert r["with_tier_plane_bytes"] == drafter.expert_bytes + drafter.tier_bytes
    assert r["base_only_plane_bytes"] == drafter.expert_bytes
    assert r["with_tier_experts_in_tier"] == drafter.tier_experts and r["base_only_experts_in_tier"] == 0
    assert r["with_tier_held_bytes"] == r["with_tier_plane_bytes"] + 8 * drafter.tier_experts
    assert r["base_only_held_bytes"] == r["base_only_plane_bytes"]
    assert r["with_tier_layers"] == r["base_only_layers"] == 3
    assert r["goals_met"] == {"with_tier_held_vs_planes": True, "base_only_held_vs_planes": True}
