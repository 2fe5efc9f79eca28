"""The mid tier through the loader and the CPU runtime (dequant_expert, fused_moe's reference), on real built
caches of the quality ladder's trained model, against a plain torch dequantization of the 3-bit codes read
straight from the source checkpoint."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moet_cache import BuildOptions, build_cache
from moet_cache.source.checkpoint import PROJECTIONS, open_checkpoint
from moet_cache.format.formats import scale_values
from moet_cache.cache.geometry import LayerGeometry
from moet_cache.load import open_cache
from moet_cache.runtime import fused_moe
from moet_cache.runtime.dequant import E2M1, LayerPlanes, dequant_expert

from triton_interpreter import run_interpreted

MODELS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "quality_model"


@pytest.fixture(scope="module", params=["mxfp4", "nvfp4"])
def mid_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    src = MODELS / request.param
    cache = tmp_path_factory.mktemp(f"midrt-{request.param}") / "cache"
    build_cache(src, cache, BuildOptions(delta_budget="3%", mid_budget="12%"))
    return src, cache


def _load(cache: Path, delta: str) -> dict[int, tuple[dict[str, torch.Tensor], int]]:
    return {x.index: (x.tensors, x.nbytes) for x in open_cache(cache).load(device="cpu", delta=delta, verify="hash")}


def _mid_layers(cache: Path) -> dict[int, list[int]]:
    index = json.loads((cache / "delta/tier.json").read_text())
    return {x["layer"]: x["experts"] for x in index["mid_layers"]}


def _plain_3bit(src: Path, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (w13 [2I, H], w2 [H, I]) of expert e at 3 bits, in plain torch from the source's codes and
    scales: the 8-entry table is the count-weighted mean of each pair of E2M1 values."""
    e2m1 = torch.tensor(E2M1, dtype=torch.float32)
    out = []
    with open_checkpoint(src) as ck:
        for proj in PROJECTIONS:
            x = ck.read_raw_expert(layer, e, proj)
            packed = torch.from_numpy(x.codes.copy())
            codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
            hist = torch.bincount(codes.reshape(-1), minlength=16).float().reshape(8, 2)
            pairs = e2m1.reshape(8, 2)
            n = hist.sum(1)
            table = torch.where(n > 0, (hist * pairs).sum(1) / n.clamp_min(1), pairs.mean(1))
            s = torch.from_numpy(scale_values(x.scale_bytes, x.fmt.scale_form))
            s = s.repeat_interleave(codes.shape[1] // s.shape[1], dim=1)
            out.append(table[codes >> 1] * s * float(x.scale_2))
            ck.release(x.codes)
    return torch.cat(out[:2]), out[2]


def test_the_loader_hands_out_the_mid_tier_with_delta_tier_only(mid_cache: tuple[Path, Path]) -> None:
    src, cache = mid_cache
    mids = _mid_layers(cache)
    tier, none = _load(cache, "tier"), _load(cache, "none")
    with safe_open(cache / "delta/tier.safetensors", "pt") as pack:
        for layer, (t, nbytes) in tier.items():
            assert t["mid_experts"].tolist() == mids[layer]
            for name in ("w13_mid", "w2_mid", "w13_mid_table", "w2_mid_table"):
                if mids[layer]:
                    assert torch.equal(t[name], pack.get_tensor(f"layers.{layer}.{name}"))
                else:
                    assert t[name].shape[0] == 0
            # only the bytes it needs: delta "none" reads the base file alone, "tier" adds the tiers' planes
            t0, n0 = none[layer]
            assert not [k for k in t0 if "mid" in k]
            geo = LayerGeometry(32, 256, 128)
            n_delta = t["delta_experts"].numel()
            assert nbytes - n0 == n_delta * geo.expert_delta_bytes + len(mids[layer]) * geo.expert_mid_bytes


def test_dequant_expert_decodes_a_mid_expert_from_base_mid_and_its_8_entry_table(mid_cache: tuple[Path, Path]) -> None:
    src, cache = mid_cache
    mids = _mid_layers(cache)
    layers = _load(cache, "tier")
    checked = 0
    for layer, experts in mids.items():
        planes = LayerPlanes.from_tensors(layers[layer][0])
        rows = planes.tier_rows()
        for e in experts[:3]:
            assert e not in rows
            w13, w2 = dequant_expert(planes, e, None)
            p13, p2 = _plain_3bit(src, layer, e)
            assert torch.equal(w13, p13) and torch.equal(w2, p2)
            checked += 1
    assert checked > 0


def test_fused_moe_cpu_reference_computes_mid_experts_at_3_bits(mid_cache: tuple[Path, Path]) -> None:
    src, cache = mid_cache
    layer, experts = max(_mid_layers(cache).items(), key=lambda kv: len(kv[1]))
    t = _load(cache, "tier")[layer][0]
    planes = LayerPlanes.from_tensors(t)
    torch.manual_seed(0)
    T, H, I = 6, 256, 128
    x = torch.randn(T, H)
    ids = torch.tensor([[experts[k % len(experts)], experts[(k + 1) % len(experts)]] for k in range(T)])
    w = torch.rand(T, 2)
    got = fused_moe(x, t, w, ids)
    want = torch.zeros(T, H)
    for tok in range(T):
        for k in range(2):
            w13, w2 = _plain_3bit(src, layer, int(ids[tok, k]))
            gu = x[tok] @ w13.T
            want[tok] += w[tok, k] * ((torch.nn.functional.silu(gu[:I]) * gu[I:]) @ w2.T)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # and not the base: the same experts decoded from their base planes give another output
    base_only = {k: v for k, v in t.items() if "mid" not in k}
    assert not torch.allclose(fused_moe(x, base_only, w, ids), got, rtol=1e-3, atol=1e-4)
    assert planes.has_mid and not LayerPlanes.from_tensors(base_only).has_mid


# --- the kernel paths: each says whether it decodes the mid tier; launch falls back where none does ---------
E, H, I = 8, 512, 256


def test_the_kernel_paths_refuse_a_mid_tier_layer_and_launch_falls_back_to_the_reference() -> None:
    from moet_cache.runtime.launch import DEFAULT, cuda_experts
    from moet_cache.runtime.mma_moe import DecodeExperts
    from moet_cache.runtime.mma_prefill import Prefill, PrefillExperts
    from moet_cache.runtime.reference import ReferenceExperts, fused_moe_reference
    from moet_cache.runtime.synthetic_layer import random_layer
    from moet_cache.runtime.triton_experts import TritonExperts
    layer = random_layer(E, H, I, n_tier=2, e8m0=True, device="cpu", seed=5, n_mid=3)
    planes = LayerPlanes.from_tensors(layer)
    assert planes.has_mid
    x = torch.randn(4, H).to(torch.bfloat16)
    for path in (DecodeExperts(DEFAULT.pick(3, mma_runs=True)), PrefillExperts(Prefill())):
        assert path.unsupported(planes, x, 12) == f"{type(path).__name__} does not decode the mid tier this layer has"
    assert ReferenceExperts().supports(planes, x, 12)
    for pairs in (3, 60, 6000):  # the Triton kernels decode it (tested under the interpreter below)
        got = cuda_experts(x, planes, pairs, DEFAULT)
        assert isinstance(got, TritonExperts) and got.supports(planes, x, pairs) and got.decodes_mid
    # the mid planes are used: the reference's output differs from the same layer without them
    ids = torch.tensor([[int(e) for e in planes.mid.mid_experts[:2]]] * 4)
    w = torch.rand(4, 2)
    plain = {k: v for k, v in layer.items() if "mid" not in k}
    assert not torch.equal(fused_moe_reference(x, planes, w, ids), fused_moe_reference(x, LayerPlanes.from_tensors(plain), w, ids))
    # a layer whose mid tier is empty is no mid-tier layer: the Triton kernels still take it
    empty = dict(layer, mid_experts=layer["mid_experts"][:0], w13_mid=layer["w13_mid"][:0], w2_mid=layer["w2_mid"][:0],
                 w13_mid_table=layer["w13_mid_table"][:0], w2_mid_table=layer["w2_mid_table"][:0])
    assert isinstance(cuda_experts(x, LayerPlanes.from_tensors(empty), 3, DEFAULT), TritonExperts)


TRITON_CHILD = textwrap.dedent("""
    import torch
    from moet_cache.runtime.dequant import LayerPlanes
    from moet_cache.runtime.launch import Config, Grouped, Pairs, fused_moe_cuda
    from moet_cache.runtime.reference import fused_moe_reference
    from moet_cache.runtime.synthetic_layer import random_layer

    E, H, I = 8, 64, 32
    for e8m0 in (False, True):
        layer = random_layer(E, H, I, n_tier=2, e8m0=e8m0, device="cpu", seed=6, n_mid=3)
        planes = LayerPlanes.from_tensors(layer)
        base = LayerPlanes.from_tensors({k: v for k, v in layer.items() if "mid" not in k})
        for i, (T, cfg) in enumerate(((3, Config.only(Pairs(16, 2, 4))),
                                      (9, Config.only(Grouped(16, 16, 2, 4, 2, False))),
                                      (9, Config.only(Grouped(16, 16, 2, 4, 2, True))))):
            g = torch.Generator().manual_seed(T)
            x = torch.randn((T, H), generator=g)
            ids = torch.randint(0, E, (T, 4), generator=g)
            ids[:, 0] = planes.mid.mid_experts[torch.arange(T) % 3]  # every token routes to a mid expert
            w = torch.rand((T, 4), generator=g)
            limit = 0.05 if (i + e8m0) % 2 else None
            got = fused_moe_cuda(x, planes, w, ids, limit, cfg)
            ref = fused_moe_reference(x, planes, w, ids, limit)
            rel = ((got - ref).norm() / ref.norm()).item()
            assert rel < 1e-5, (e8m0, T, limit, rel)
            off = ((got - fused_moe_reference(x, base, w, ids, limit)).norm() / ref.norm()).item()
            assert off > 1e-2, (e8m0, T, off)  # the mid planes were decoded, not the base alone
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_the_triton_kernels_decode_mid_experts_as_the_reference_does() -> None:
    """The pairs and both grouped kernels under Triton's interpreter (a child: TRITON_INTERPRET must be set
    before Triton is imported), both scale forms, against the CPU reference."""
    run_interpreted(TRITON_CHILD, timeout=900)
