"""The mid tier through the vLLM method `moet`, with vLLM's real classes on a CPU (marker vllm): the method
declares the mid tier's tensors, the moet loader fills them, and `apply` computes the mid-tier experts at
3 bits (fused_moe on the cache's own tensors). Skipped without vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moet_cache import BuildOptions, build_cache, make_checkpoint, small_spec
from moet_cache.load import open_cache
from moet_cache.load.assemble import MID_NAMES

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.model_executor.layers.quantization", reason="vLLM is not installed")

from moet_cache.integrations.vllm.loader import PluginOptions, load_into_model  # noqa: E402 (imports vLLM)

from test_vllm_quant import LIMIT, TOP_K, H, _model_on, vllm_config  # noqa: E402,F401 - the fixture too


@pytest.fixture(scope="module")
def mid_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("mid-vllm")
    src = make_checkpoint(work / "src", small_spec())
    build_cache(src, work / "cache", BuildOptions(delta_budget="10%", mid_budget="25%"))
    return work / "cache"


@pytest.mark.usefixtures("vllm_config")
def test_the_method_declares_loads_and_computes_the_mid_tier(mid_cache: Path) -> None:
    from moet_cache.runtime import fused_moe
    model = _model_on(mid_cache)
    want = {x.index: x.tensors for x in open_cache(mid_cache).load(delta="tier", workers=1)}
    layer = max(want, key=lambda i: want[i]["mid_experts"].numel())
    mids = want[layer]["mid_experts"]
    assert mids.numel() > 0
    experts = model.model.layers[layer].mlp.experts.routed_experts
    for name in MID_NAMES:  # declared empty, as the tier's are
        assert getattr(experts, name).shape[0] == 0 and name in experts.moet_tensor_names
    load_into_model(model, PluginOptions(cache=str(mid_cache), workers=1))
    for name in MID_NAMES:
        assert torch.equal(getattr(experts, name), want[layer][name]), name
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([mids[torch.randperm(mids.numel(), generator=g)[:1]].repeat(TOP_K) for _ in range(5)])
    ids[:, 1:] = torch.randint(0, 16, (5, TOP_K - 1), generator=g)
    w = torch.rand(5, TOP_K, generator=g)
    out = experts.quant_method.apply(experts, x, w, ids.to(torch.int32), None, None)
    assert torch.equal(out, fused_moe(x, want[layer], w, ids, swiglu_limit=LIMIT))
    base_only = {k: v for k, v in want[layer].items() if k not in MID_NAMES}
    assert not torch.equal(out, fused_moe(x, base_only, w, ids, swiglu_limit=LIMIT))  # the mid planes count
