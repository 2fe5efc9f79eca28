"""One rank's MoE layer on the GPU kernels at DeepSeek-V4-Flash dims (E 256, top-6, H 4096, I 2048): under
expert parallelism (its experts only, the router's ids mapped through its expert map, another rank's
experts -1) it equals the whole layer with the other ranks' pairs skipped; under tensor parallelism the
ranks' partial sums add up to the whole layer. In the decode and the prefill kernels, eagerly and replayed
from a CUDA graph. Skipped without CUDA (CI has none); run on the device machine."""

from __future__ import annotations

import pytest
import torch

from moet_cache.load import Shard, open_cache
from moet_cache.runtime import fused_moe
from moet_cache.runtime.launch import DEFAULT, Mma, Prefill
from moet_cache.runtime.padding import to_local
from moet_cache.runtime.synthetic_layer import random_layer
from cuda_graph import replayed
from parallel_ref import expert_map, linear, reference_share

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

E, K, H, I = 256, 6, 4096, 2048
DECODE, PREFILL = 4, 512   # tokens: P = 24 pairs (the decode kernels), 3072 (the prefill kernels)


@pytest.fixture(scope="module", params=["e8m0", "e4m3"])
def layer(request: pytest.FixtureRequest) -> dict[str, torch.Tensor]:
    return random_layer(E, H, I, n_tier=26, e8m0=request.param == "e8m0", device="cuda", seed=3)


def _routing(layer: dict[str, torch.Tensor], T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((T, H), generator=g, device="cuda").to(torch.bfloat16)
    ids = torch.rand((T, E), generator=g, device="cuda").topk(K, dim=1).indices.to(torch.int32)
    ids[0, :2] = layer["delta_experts"][:2].to(torch.int32)  # tier experts routed
    return x, torch.rand((T, K), generator=g, device="cuda"), ids


@pytest.mark.parametrize("T", [DECODE, PREFILL])
def test_an_expert_parallel_rank_equals_the_whole_layer_without_the_other_ranks_pairs(layer: dict, T: int) -> None:
    assert isinstance(DEFAULT.pick(T * K), Mma if T == DECODE else Prefill)
    x, w, ids = _routing(layer, T, 40 + T)
    for rank in range(2):
        shard = Shard(linear(2, rank, E))
        local_layer = reference_share(layer, shard, E, I)
        emap = expert_map(shard.experts, E, device="cuda")
        mine = emap[ids.long()] >= 0
        want = fused_moe(x, layer, w, torch.where(mine, ids, -1))  # the whole layer, other ranks' pairs skipped
        got = replayed(lambda: fused_moe(x, local_layer, w, to_local(ids, emap)))
        assert bool(mine.any()) and bool((~mine).any()) and want.abs().sum() > 0
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("T", [DECODE, PREFILL])
def test_tensor_parallel_ranks_add_up_to_the_whole_layer(layer: dict, T: int) -> None:
    """Each rank's output is rounded to bf16 before the sum (as vLLM's all-reduce adds bf16 outputs): within
    bf16 rounding of the whole layer."""
    x, w, ids = _routing(layer, T, 50 + T)
    want = fused_moe(x, layer, w, ids).float()
    shares = [reference_share(layer, Shard(None, r, 2), E, I) for r in range(2)]  # outside the capture
    got = sum(replayed(lambda share=share: fused_moe(x, share, w, ids)).float() for share in shares)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("verify", ["boot", "none"])
def test_a_share_loads_into_the_gpu_as_into_host_memory(built_cache, verify: str) -> None:
    """The staging windows read a share's pieces as the host path does (the session's cache: 16 experts;
    its build recorded it verified, so `boot` passes)."""
    for shard in (Shard(None, 1, 2), Shard(linear(2, 1, 16)), Shard(linear(2, 0, 16), 1, 2)):
        cache = open_cache(built_cache)
        host = {x.index: x.tensors for x in cache.load(device="cpu", verify="none", shard=shard)}
        gpu = {x.index: x.tensors for x in cache.load(device="cuda", verify=verify, workers=4, shard=shard)}
        assert sorted(gpu) == sorted(host)
        for layer, tensors in host.items():
            for name, t in tensors.items():
                got = gpu[layer][name]
                assert got.is_cuda and got.shape == t.shape, name
                assert torch.equal(got.cpu().view(torch.uint8) if t.dim() else got.cpu(),
                                   t.view(torch.uint8) if t.dim() else t), name
