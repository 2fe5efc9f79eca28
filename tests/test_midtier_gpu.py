"""The mid tier on CUDA at DeepSeek-V4-Flash's dims (marker gpu; benchmarks/gpu_tests.py runs them): a layer
with mid-tier experts goes to the Triton kernels (the plane kernels refuse it) and equals the reference,
eagerly and under CUDA-graph capture. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from moet_cache.runtime import fused_moe
from moet_cache.runtime.dequant import LayerPlanes
from moet_cache.runtime.launch import DEFAULT, cuda_experts
from moet_cache.runtime.synthetic_layer import random_layer
from moet_cache.runtime.triton_experts import TritonExperts

from gpu_reference import Reference
from test_runtime_gpu import E, H, I, _check, _routing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module", params=["e8m0", "e4m3"])
def mid_layer(request: pytest.FixtureRequest) -> dict[str, torch.Tensor]:
    return random_layer(E, H, I, n_tier=26, e8m0=request.param == "e8m0", device="cuda", seed=3, n_mid=52)


@pytest.mark.parametrize("T", [1, 7, 64, 4096])
def test_a_mid_tier_layer_runs_on_triton_and_equals_the_reference(mid_layer: dict, T: int,
                                                                     reference: Reference) -> None:
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn((T, H), generator=g, device="cuda").to(torch.bfloat16)
    w, ids = _routing(T, T, all_hot=T >= 64)
    ids[0, :2] = mid_layer["mid_experts"][:2]  # the first token takes two mid-tier experts
    assert isinstance(cuda_experts(x, LayerPlanes.from_tensors(mid_layer), T * ids.shape[1], DEFAULT), TritonExperts)
    got = fused_moe(x, mid_layer, w, ids, swiglu_limit=7.0)
    _check(got, reference(x, mid_layer, w, ids, 7.0))


def test_a_mid_tier_layer_is_captured_by_a_cuda_graph(mid_layer: dict) -> None:
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn((4, H), generator=g, device="cuda").to(torch.bfloat16)
    w, ids = _routing(4, 11)
    ids[:, 0] = mid_layer["mid_experts"][:4]
    fused_moe(x, mid_layer, w, ids)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, mid_layer, w, ids)
    x.copy_(torch.randn((4, H), generator=g, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe(x, mid_layer, w, ids))
