"""Tensor and expert parallelism through vLLM's real fused-MoE classes on a CPU (marker vllm).

vLLM's `FusedMoEFactory` builds each rank's layer with tp_size 2 (and `enable_expert_parallel` for EP):
its own FusedMoEParallelConfig, its own expert placement and `expert_map` (determine_expert_map), its own
`intermediate_size_per_partition`. The one stand-in: the rank comes from vLLM's
`get_tensor_model_parallel_rank`, which without a process group has no rank to give, so the test names
it (one process builds every rank in turn). The moet loader fills each rank's layer from the cache
(reading only its share, counted), and `apply` per rank, summed as vLLM's all-reduce sums, equals the
whole layer's (float32 activations). The all-reduce itself is vLLM's (moe_runner.py) and not run here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from moet_cache.errors import InputError
from moet_cache.load import Shard
from moet_cache.load import reads as load_reads
from moet_cache.runtime.launch import Config, config_named
from moet_cache.runtime.mma_moe import CHUNK_WORDS

pytestmark = pytest.mark.vllm
quantization = pytest.importorskip("vllm.model_executor.layers.quantization", reason="vLLM is not installed")
from moet_cache.integrations.vllm.loader import PluginOptions, load_into_model  # noqa: E402 (imports vLLM)
from moet_cache.integrations.vllm.method import TP_KERNEL_WIDTH, check_tp_width  # noqa: E402 (imports vLLM)
from moet_cache.integrations.vllm.plugin import register  # noqa: E402

E, H, I, TOP_K = 16, 256, 128, 4        # small_spec
LAYERS = (1, 2, 3)


class _Model(nn.Module):
    def load_weights(self, weights: Any) -> set[str]:
        return {name for name, _ in weights}


def _rank_model(cache: Path, monkeypatch: pytest.MonkeyPatch, tp: int, rank: int, ep: bool,
                placement: str = "linear") -> nn.Module:
    """vLLM's DeepSeek layout with real fused-MoE layers 1-3 as rank `rank` of `tp` builds them."""
    import vllm.model_executor.layers.fused_moe.config as moe_config
    import vllm.triton_utils
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    monkeypatch.setattr(moe_config, "get_tensor_model_parallel_rank", lambda: rank)
    register()
    block = json.loads((cache / "model" / "config.json").read_text())["quantization_config"]
    qc = quantization.get_quantization_config("moet").from_config(block)
    cfg = VllmConfig()  # one per rank: vLLM registers each layer name once a config
    cfg.parallel_config.enable_expert_parallel = ep
    cfg.parallel_config.expert_placement_strategy = placement
    model = _Model()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList()
    with set_current_vllm_config(cfg):
        for i in range(4):
            layer = nn.Module()
            if i in LAYERS:
                layer.mlp = nn.Module()
                layer.mlp.experts = FusedMoEFactory(
                    num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I, params_dtype=torch.float32,
                    quant_config=qc, tp_size=tp, dp_size=1, pcp_size=1, prefix=f"model.layers.{i}.mlp.experts",
                    swiglu_limit=0.5,
                    # vLLM places round robin only for grouped experts (else it falls back to linear)
                    **({"use_grouped_topk": True, "num_expert_group": 4, "topk_group": 2}
                       if placement == "round_robin" else {}))
            model.model.layers.append(layer)
    return model


def _experts(model: nn.Module, layer: int) -> Any:
    return model.model.layers[layer].mlp.experts.routed_experts


def _loaded(cache: Path, monkeypatch: pytest.MonkeyPatch, tp: int, rank: int, ep: bool,
            placement: str = "linear") -> tuple[nn.Module, int]:
    """A rank's model, filled by the moet loader; the bytes the loader's read seams (os.preadv, and
    moet_cache._preads where built) read from the experts' files (Linux's /proc names each descriptor's
    file), equal to what the loaded layers hold."""
    model = _rank_model(cache, monkeypatch, tp, rank, ep, placement)
    real, real_c, read = os.preadv, load_reads._preads, [0]

    def experts_file(fd: int) -> bool:  # the dense files are read whole by every rank, as vLLM does
        return os.readlink(f"/proc/self/fd/{fd}").startswith((str(cache / "layers"), str(cache / "delta")))

    def counted(fd: int, buffers: Any, offset: int) -> int:
        got = real(fd, buffers, offset)
        read[0] += got if experts_file(fd) else 0
        return got

    class CountedC:  # a share's pieces, where the C extension reads them
        @staticmethod
        def pread_runs(fd: int, *args: Any) -> int:
            got = real_c.pread_runs(fd, *args)
            read[0] += got if experts_file(fd) else 0
            return got
    monkeypatch.setattr(load_reads.os, "preadv", counted)
    if real_c is not None:
        monkeypatch.setattr(load_reads, "_preads", CountedC)
    try:
        summary = load_into_model(model, PluginOptions(cache=str(cache), workers=1, verify="none"))
    finally:
        monkeypatch.setattr(load_reads.os, "preadv", real)
        monkeypatch.setattr(load_reads, "_preads", real_c)
    assert read[0] == summary.moe_bytes > 0
    return model, read[0]


def _routing(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(6)]).to(torch.int32)
    ids[5] = -1  # vLLM's padding row
    return x, torch.rand(6, TOP_K, generator=g), ids


@pytest.mark.parametrize("ep,placement", [(False, "linear"), (True, "linear"), (True, "round_robin")],
                         ids=["tp2", "ep2", "ep2-round-robin"])
def test_two_ranks_of_vllms_layer_sum_to_the_whole_layer(built_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                         ep: bool, placement: str) -> None:
    whole, whole_bytes = _loaded(built_cache, monkeypatch, 1, 0, False)
    ranks = [_loaded(built_cache, monkeypatch, 2, r, ep, placement) for r in range(2)]
    for r, (model, nbytes) in enumerate(ranks):
        experts = _experts(model, 2)
        par = experts.moe_config.moe_parallel_config
        assert (par.tp_size, par.ep_size) == ((1, 2) if ep else (2, 1))
        shard = experts.quant_method.shard
        assert experts.moet_shard == shard and shard.tp_size == par.tp_size
        if ep:  # vLLM's placement, read from its expert_map
            assert shard.experts == (tuple(range(r * 8, r * 8 + 8)) if placement == "linear" else tuple(range(r, E, 2)))
            assert experts.expert_map.tolist() == [shard.experts.index(g) if g in shard.experts else -1
                                                   for g in range(E)]
        assert experts.w13_base.shape[:2] == ((8, 2 * I) if ep else (E, I))
        if not ep:  # the rank's half of the experts' bytes, plus 1% (the per-expert scale_2 and tables, whole)
            assert nbytes <= whole_bytes / 2 * 1.01
    if ep:  # whole experts, each on one rank: together the ranks read every byte once (the tier rows unevenly)
        assert ranks[0][1] + ranks[1][1] == whole_bytes
    for layer in LAYERS:
        x, w, ids = _routing(layer)
        tier = _experts(whole, layer).delta_experts
        ids[0, :2] = tier[:2].to(ids.dtype)  # tier experts routed
        full = _experts(whole, layer)
        want = full.quant_method.apply(full, x, w, ids, None, None)
        got = sum(_experts(m, layer).quant_method.apply(_experts(m, layer), x, w, ids, None, None) for m, _ in ranks)
        assert want.abs().sum() > 0 and bool((want[5] == 0).all())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_what_the_method_does_not_serve_is_refused(built_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _rank_model(built_cache, monkeypatch, 1, 0, False)
    experts = _experts(model, 1)
    qc = quantization.get_quantization_config("moet").from_config(
        json.loads((built_cache / "model" / "config.json").read_text())["quantization_config"])
    par = experts.moe_config.moe_parallel_config
    for change, match in (({"dp_size": 2}, "data parallel 2"), ({"pcp_size": 2}, "prefill context parallel 2"),
                          ({"enable_eplb": True}, "expert load balancing")):
        experts.moe_config = dataclasses.replace(experts.moe_config,
                                                 moe_parallel_config=dataclasses.replace(par, **change))
        with pytest.raises(InputError, match=match):
            qc.get_quant_method(experts, "model.layers.1.mlp.experts.routed_experts")


def test_the_gpu_width_rule_is_the_kernels() -> None:
    """TP_KERNEL_WIDTH is what the plane kernels' decode steps need of w2's K (mma_moe.supported): 16 *
    CHUNK_WORDS codes a chunk times the most chunks a step takes, in the H200's steps and the defaults."""
    for cfg in (config_named("NVIDIA H200"), Config()):
        assert max(16 * CHUNK_WORDS * b.ks2 for b in cfg.decode_blocks()) <= TP_KERNEL_WIDTH
    assert max(16 * CHUNK_WORDS * b.ks2 for b in config_named("NVIDIA H200").decode_blocks()) == TP_KERNEL_WIDTH
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    for tp in (1, 2, 4):  # V4-Flash: expert width 2048
        check_tp_width(2048 // tp, tp, gpu)
    with pytest.raises(InputError, match="256 wide"):
        check_tp_width(2048 // 8, 8, gpu)
    check_tp_width(64, 2, cpu)  # the CPU reference takes any width of whole scale groups
    assert Shard(None, 1, 8).width(2048) == (256, 512)
