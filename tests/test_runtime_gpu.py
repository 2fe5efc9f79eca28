"""The Triton kernels against the plain torch reference at DeepSeek-V4-Flash dims (E 256, top-6,
H 4096, I 2048): skipped without CUDA (CI has none); run on the device machine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moet_cache.runtime import fused_moe
from moet_cache.runtime.dequant import LayerPlanes
from moet_cache.runtime import mma_moe, mma_prefill
from moet_cache.runtime.mma_moe import two_accumulators
from moet_cache.codec.planes import X4_PATTERN
from moet_cache.runtime.launch import (DEFAULT, SPLIT, WHOLE, Config, Mma, Pairs, Prefill, config_for, fused_moe_cuda,
                                       layer_form)
from moet_cache.runtime.synthetic_layer import random_layer
from moet_cache.runtime import layout, x4_table
from moet_cache.runtime.layout import prepare, prepare_in_place
from moet_cache.runtime.warm_up import kernel_names, warm_up
from moet_cache.runtime.plane_layout import TILED, X4

from cuda_graph import replayed
from gpu_reference import Reference

X4_NAMES = X4.names

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

E, K, H, I = 256, 6, 4096, 2048


@pytest.fixture(scope="module", params=["e8m0", "e4m3"])
def layer(request: pytest.FixtureRequest) -> dict[str, torch.Tensor]:
    return random_layer(E, H, I, n_tier=26, e8m0=request.param == "e8m0", device="cuda", seed=1)


def _routing(T: int, seed: int, all_hot: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand((T, E), generator=g, device="cuda").topk(K, dim=1).indices
    if all_hot:  # every expert routed at least once
        ids.view(-1)[:E] = torch.randperm(E, generator=g, device="cuda")
    if T > 1:
        ids[1, 1] = ids[1, 0]  # a repeated expert in one row
    w = torch.rand((T, K), generator=g, device="cuda") * 1.5
    return w, ids


def _tokens_to_tier(t: dict, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] bf16 and a routing (every expert hot from T = 64) whose first token takes two of the layer's
    tier experts beside base ones."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((T, H), generator=g, device="cuda").to(torch.bfloat16)
    w, ids = _routing(T, seed, all_hot=T >= 64)
    ids[0, :2] = t["delta_experts"][:2]
    return x, w, ids


#: the tiled fitted blocks' output against the natural layout's where they sum in another order (norm; rows
#: 3x): measured at most 5.4e-4 (rows 1.0e-3) against the reference's 4-6e-3 (H200)
ACC2_TOL = 2e-3


def _check(got: torch.Tensor, ref: torch.Tensor, tol: float = 1.5e-2) -> None:
    assert got.shape == ref.shape and torch.isfinite(got).all()
    rel = ((got.float() - ref).norm() / ref.norm()).item()
    row = ((got.float() - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)).max().item()
    assert rel < tol and row < 3 * tol, (rel, row)


@pytest.mark.parametrize("T", [1, 7, 64, 4096])
def test_kernels_equal_reference(layer: dict, T: int, reference: Reference) -> None:
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn((T, H), generator=g, device="cuda").to(torch.bfloat16)
    w, ids = _routing(T, T, all_hot=T >= 64)
    limit = 7.0 if T in (7, 4096) else None
    got = fused_moe(x, layer, w, ids, swiglu_limit=limit)
    assert got.dtype == torch.bfloat16
    _check(got, reference(x, layer, w, ids, limit))


def test_the_reference_copies_a_layer_to_the_cpu_once(layer: dict, reference: Reference) -> None:
    """The small-T reference reads the layer's CPU copies made at its first call (the layer's tensors are
    unchanged since), and a tensor's copy goes with the tensor."""
    x, w, ids = _tokens_to_tier(layer, 2, 5)
    first = reference(x, layer, w, ids, None)
    copies = [reference.copies.of(v) for v in layer.values()]
    assert torch.equal(reference(x, layer, w, ids, None), first)
    assert all(reference.copies.of(v) is c for v, c in zip(layer.values(), copies))
    held = len(reference.copies)
    extra = torch.zeros(3, device="cuda")
    assert torch.equal(reference.copies.of(extra), torch.zeros(3)) and len(reference.copies) == held + 1
    del extra
    assert len(reference.copies) == held


@pytest.mark.parametrize("T,mode", [(7, "large"), (64, "pairs"), (3, "mid"), (64, "large"), (4096, "mid"),
                                    (5, "tiny")])
def test_both_regimes(layer: dict, T: int, mode: str, reference: Reference) -> None:
    """Each regime at sizes the default choice would give to the other one."""
    cfg = Config.only(getattr(DEFAULT, mode))
    g = torch.Generator(device="cuda").manual_seed(100 + T)
    x = torch.randn((T, H), generator=g, device="cuda").to(torch.bfloat16)
    w, ids = _routing(T, 100 + T)
    got = fused_moe_cuda(x, LayerPlanes.from_tensors(layer), w, ids, None, cfg)
    _check(got, reference(x, layer, w, ids, None))


@pytest.mark.parametrize("T,block", [(1, Mma(1, 4, 4, True)), (3, Mma(1, 1, 1)), (7, Mma(2, 2, 2)),
                                     (16, Mma(1, 8, 8, True)), (64, Mma(4, 1, 1)), (300, Mma(8, 1, 1)),
                                     (5, Mma(1, 2, 4)), (16, Mma(1, 4, 8, True)), (16, Mma(1, 2, 1, True)),
                                     (64, Mma(1, 2, 2)), (256, Mma(1, 2, 2)), (2, Mma(1, 2, 2, True, True)),
                                     (40, Mma(1, 2, 2, True, True)), (64, Mma(1, 2, 2, False, True))])
def test_tensor_core_blocks(layer: dict, T: int, block: Mma, reference: Reference) -> None:
    """The tensor-core plane kernels (mma_moe.cu) at every block shape the sweep may pick, with the
    tier's experts routed (exact FP4) and the SwiGLU clamp."""
    assert mma_moe.supported(LayerPlanes.from_tensors(layer), torch.device("cuda"), block)  # not a fallback
    g = torch.Generator(device="cuda").manual_seed(200 + T)
    x = torch.randn((T, H), generator=g, device="cuda").to(torch.bfloat16)
    w, ids = _routing(T, 200 + T, all_hot=T >= 64)
    ids[0, :3] = layer["delta_experts"][:3]  # tier experts for sure
    got = fused_moe_cuda(x, LayerPlanes.from_tensors(layer), w, ids, 7.0, Config.only(block))
    _check(got, reference(x, layer, w, ids, 7.0))


@pytest.mark.parametrize("T", [16, 64])
def test_direct_blocks_group_hot_experts(layer: dict, T: int, reference: Reference) -> None:
    """Direct blocks take an expert's pairs 8 at a time in pair order (mma_moe.cu group_pair): one
    expert in every token (T pairs: whole groups of 8), a tier expert in most tokens (a last group
    short), the rest random."""
    block = Mma(1, 2, 2, True)
    g = torch.Generator(device="cuda").manual_seed(300 + T)
    x = torch.randn((T, H), generator=g, device="cuda").to(torch.bfloat16)
    w, ids = _routing(T, 300 + T)
    tier = layer["delta_experts"]
    ids[:, 0] = min(set(range(E)) - set(tier.tolist()))
    ids[: (3 * T) // 4, 1] = tier[0]
    got = fused_moe_cuda(x, LayerPlanes.from_tensors(layer), w, ids, 7.0, Config.only(block))
    _check(got, reference(x, layer, w, ids, 7.0))


def test_tier_edges_and_float32(layer: dict, reference: Reference) -> None:
    """No tier, every expert in the tier, float32 activations, zero tokens."""
    T = 5
    x = torch.randn((T, H), device="cuda")
    w, ids = _routing(T, 7)
    none = {k: v for k, v in layer.items() if k not in ("w13_delta", "w2_delta", "delta_experts")}
    _check(fused_moe(x, none, w, ids), reference(x, none, w, ids, None))
    full = dict(layer, delta_experts=torch.arange(E, device="cuda"),
                w13_delta=torch.randint(0, 256, layer["w13_base"].shape, dtype=torch.uint8, device="cuda"),
                w2_delta=torch.randint(0, 256, layer["w2_base"].shape, dtype=torch.uint8, device="cuda"))
    _check(fused_moe(x, full, w, ids), reference(x, full, w, ids, None))
    empty = fused_moe(x[:0], layer, w[:0], ids[:0])
    assert empty.shape == (0, H)


@pytest.mark.parametrize("T", [4, 64])
def test_cuda_graph_capture(layer: dict, T: int) -> None:
    """No host sync inside, in either regime: vLLM captures decode steps in CUDA graphs."""
    x = torch.randn((T, H), device="cuda").to(torch.bfloat16)
    w, ids = _routing(T, 11)
    replayed(lambda: fused_moe(x, layer, w, ids))


@pytest.mark.parametrize("T,block,mode", [(300, Prefill(), "cold"), (300, Prefill(4, 8, 4), "tier"),
                                          (300, Prefill(12, 4, 3), "plain"), (4096, Prefill(), "hot"),
                                          (300, Prefill(), "full tier"), (300, Prefill(8, 8, 4, True, 1), "tier"),
                                          (4096, Prefill(16, 4, 2, True, 1), "hot"),
                                          (300, Prefill(4, 8, 4, True, 2), "full tier"),
                                          (300, Prefill(16, 4, 2, True, 1), "tier"),
                                          (300, Prefill(2, 8, 4, True, 2), "tier"),
                                          (300, Prefill(4, 8, 3, True, 2), "tier"),
                                          (300, Prefill(4, 4, 2, True, 2), "tier"),
                                          (300, Prefill(4, 4, 2, True, 2), "full tier"),
                                          (300, Prefill(8, 4, 2, True, 2), "cold"),
                                          (4096, Prefill(8, 4, 2, True, 2), "hot"),
                                          (4096, Prefill(4, 4, 2, True, 2), "full tier"),
                                          (4096, Prefill(2, 8, 4, True, 2), "full tier")])
def test_prefill_kernels(layer: dict, T: int, block: Prefill, mode: str, reference: Reference) -> None:
    """The prefill tensor-core kernels (mma_prefill.cu), forced below their default range too: half the
    experts without a pair ("cold"), every expert hot, tier experts routed, every expert in the tier,
    the clamp on and off. Each must run on mma_prefill (not fall back to Triton)."""
    g = torch.Generator(device="cuda").manual_seed(300 + T)
    x = torch.randn((T, H), generator=g, device="cuda").to(torch.bfloat16)
    w, ids = _routing(T, 300 + T, all_hot=mode == "hot")
    if mode == "cold":
        ids = ids % (E // 2)
    t = layer
    if mode == "full tier":
        t = dict(layer, delta_experts=torch.arange(E, device="cuda"),
                 w13_delta=torch.randint(0, 256, layer["w13_base"].shape, dtype=torch.uint8, device="cuda"),
                 w2_delta=torch.randint(0, 256, layer["w2_base"].shape, dtype=torch.uint8, device="cuda"))
    ids[0, :3] = t["delta_experts"][:3]
    limit = None if mode == "plain" else 7.0
    planes = LayerPlanes.from_tensors(t)
    assert mma_prefill.supported(planes, x, ids.numel(), block)
    got = fused_moe_cuda(x, planes, w, ids, limit, Config.only(block))
    _check(got, reference(x, t, w, ids, limit))


def test_prefill_on_a_card_with_less_shared_memory(layer: dict, monkeypatch: pytest.MonkeyPatch,
                                                   reference: Reference) -> None:
    """Where a CTA may take 99 KB of shared memory (sm_86, sm_89, sm_120: the RTX PRO 6000), a prefill step
    whose block takes 104 KB (a Prefill(4, 8, 4)) runs on the prefill kernels with 3 stages
    (mma_prefill.within), not on Triton's with the layer put back in the natural layout on every call, and
    gives the reference."""
    T = 700
    config = Config(prefill=((1536, Prefill(4, 8, 4, True, 2)),))
    served = LayerPlanes.from_tensors(prepare(layer))
    assert config.pick(T * K, **layer_form(served)) == Prefill(4, 8, 4, True, 2)
    monkeypatch.setattr(mma_prefill, "smem_limit", lambda device: 99 * 1024)
    ran, run = [], mma_prefill.fused_moe_prefill
    monkeypatch.setattr(mma_prefill, "fused_moe_prefill", lambda *a: ran.append(a[-1]) or run(*a))
    x, w, ids = _tokens_to_tier(layer, T, 21)
    got = fused_moe_cuda(x, served, w, ids, 7.0, config)
    assert ran == [Prefill(4, 8, 3, True, 2)]
    _check(got, reference(x, layer, w, ids, 7.0))


def test_prefill_cuda_graph_capture(layer: dict) -> None:
    """The prefill path (the default from P = 1536-1808 by layer form) has no host sync either."""
    T = 512
    assert isinstance(DEFAULT.pick(T * K), Prefill)
    x = torch.randn((T, H), device="cuda").to(torch.bfloat16)
    w, ids = _routing(T, 12)
    replayed(lambda: fused_moe(x, layer, w, ids))


@pytest.fixture(scope="module", params=["e8m0", "e4m3"])
def x4_layer(request: pytest.FixtureRequest) -> dict[str, torch.Tensor]:
    """A layer built with --base-table x4: every table a * (1, 4, -1, -4), a random and positive."""
    t = random_layer(E, H, I, n_tier=26, e8m0=request.param == "e8m0", device="cuda", seed=2)
    g = torch.Generator(device="cuda").manual_seed(7)
    pattern = torch.as_tensor(X4_PATTERN, device="cuda")
    t["w13_table"] = (torch.rand((E, 2, 1), generator=g, device="cuda") + 0.5) * pattern
    t["w2_table"] = (torch.rand((E, 1), generator=g, device="cuda") + 0.5) * pattern
    return t


@pytest.mark.parametrize("form", ["fitted", "x4", "x4 base only"])
def test_warm_up_compiles_every_kernel_the_layer_launches(layer: dict, x4_layer: dict, form: str) -> None:
    """warm_up (at load) compiles every kernel fused_moe then launches for the layer at the first pair count of
    each of its form's decode and prefill steps: none is compiled afterwards (the compile caches emptied
    first, so that kernels other tests compiled do not hide one warm_up missed)."""
    t = layer if form == "fitted" else x4_layer
    if form == "x4 base only":
        t = {k: v for k, v in t.items() if "delta" not in k}
    t = prepare(t)
    planes = LayerPlanes.from_tensors(t)
    mma_moe.compiled.cache_clear()
    mma_prefill._kernel.cache_clear()
    assert warm_up(planes) == len(kernel_names(planes, planes.w13_base.device)) > 0
    compiled = mma_moe.compiled.cache_info().misses
    shape = layer_form(planes)
    config = config_for(planes.w13_base.device)  # what warm_up and fused_moe run with here (the H200's or not)
    starts = [(start, block) for start, block in config.decode_steps(**shape)]
    starts += [(start + (config.prefill_later.of(**shape) if i == 0 else 0), block)
               for i, (start, block) in enumerate(config.prefill)]
    for start, block in starts:
        T = max(1, -(-start // K))
        assert config.pick(T * K, **shape) == block
        x, w, ids = _tokens_to_tier(x4_layer, T, 40 + T)
        fused_moe(x, t, w, ids, swiglu_limit=7.0)
    torch.cuda.synchronize()
    assert mma_moe.compiled.cache_info().misses == compiled


@pytest.mark.parametrize("T,config", [(1, DEFAULT), (2, DEFAULT), (3, DEFAULT), (7, DEFAULT), (16, DEFAULT),
                                      (30, DEFAULT), (16, Config.only(Mma(1, 2, 2, True, True))),
                                      (16, Config.only(Mma(1, 2, 2, direct=True))), (16, Config.only(WHOLE)),
                                      (40, Config.only(Mma(1, 2, 2))), (64, DEFAULT), (300, DEFAULT),
                                      (300, Config.only(Prefill())), (300, Config.only(Prefill(4, 8, 4))),
                                      (300, Config.only(Prefill(16, 4, 2, True, 1))),
                                      (300, Config.only(Prefill(4, 4, 2, True, 2))),
                                      (2048, Config.only(Prefill(8, 4, 2, True, 2))), (4096, DEFAULT),
                                      (5, Config.only(Pairs(64, 8, 2)))])
def test_x4_layers_equal_reference(x4_layer: dict, T: int, config: Config, reference: Reference) -> None:
    """Planes repacked for the x4 decode (layout.prepare) through every kernel family: the decode
    blocks (direct, lean, sorted; DEFAULT at T = 1 and 3 takes direct blocks with their two accumulator
    sets, at T = 2 direct ones with K whole, at T = 7, 16 and 30 lean ones with e8m0 scales and ones with K
    whole with e4m3, and K whole at T = 16 for both; at T = 300 the prefill blocks with e8m0 scales and
    sorted lean ones with e4m3, DEFAULT.prefill_later), the prefill blocks, and Triton, which reads them put
    back; tier experts (their exact FP4 decode, x4_tier_reg) routed beside the base ones."""
    prepared = prepare(x4_layer)
    planes = LayerPlanes.from_tensors(prepared)
    assert planes.layout == X4
    x, w, ids = _tokens_to_tier(x4_layer, T, 700 + T)
    got = fused_moe_cuda(x, planes, w, ids, 7.0, config)
    _check(got, reference(x, x4_layer, w, ids, 7.0))


@pytest.mark.parametrize("T", [7, 16])
def test_x4_layer_without_a_tier_equals_reference(x4_layer: dict, T: int, reference: Reference) -> None:
    """An x4 layer with no tier takes its own decode steps (DEFAULT.mma_x4_base: K whole from 24 pairs
    with e8m0 scales)."""
    base = {k: v for k, v in x4_layer.items() if k not in ("w13_delta", "w2_delta", "delta_experts")}
    planes = LayerPlanes.from_tensors(prepare(base))
    assert planes.layout == X4 and not layer_form(planes)["tier"]
    x, w, ids = _tokens_to_tier(x4_layer, T, 750 + T)  # its tier experts are base ones here
    _check(fused_moe_cuda(x, planes, w, ids, 7.0, DEFAULT), reference(x, base, w, ids, 7.0))


@pytest.mark.parametrize("T,config", [(1, DEFAULT), (2, DEFAULT), (3, DEFAULT), (16, DEFAULT), (30, DEFAULT),
                                      (16, Config.only(Mma(1, 2, 2, True, True))), (40, Config.only(Mma(1, 2, 2))),
                                      (44, DEFAULT), (64, DEFAULT), (300, Config.only(Prefill())),
                                      (300, Config.only(Prefill(4, 8, 4))), (4096, DEFAULT),
                                      (5, Config.only(Pairs(64, 8, 2)))])
def test_tiled_fitted_layers_equal_reference(layer: dict, T: int, config: Config, reference: Reference) -> None:
    """A fitted-table layer as the vLLM method serves it, its planes and scales in tiles (tiles.py, the bits
    as loaded), through the decode blocks (direct, lean, sorted), the prefill blocks and Triton (which reads
    them put back), tier experts routed beside base ones; the output is the natural layout's bit for bit,
    or within ACC2_TOL of it where the tiled blocks sum in another order (e8m0 one-column blocks)."""
    t = {k: v.clone() for k, v in layer.items()}
    names = layout.prepare_in_place(t)
    assert names == TILED.names
    planes = LayerPlanes.from_tensors({names.get(k, k): v for k, v in t.items()})
    assert planes.layout == TILED
    x, w, ids = _tokens_to_tier(layer, T, 800 + T)
    got = fused_moe_cuda(x, planes, w, ids, 7.0, config)
    _check(got, reference(x, layer, w, ids, 7.0))
    form = layer_form(planes)
    block = config.pick(ids.numel(), **form)
    if isinstance(block, Pairs):
        return
    natural = fused_moe_cuda(x, LayerPlanes.from_tensors(layer), w, ids, 7.0, config)
    if isinstance(block, Mma) and two_accumulators(block, TILED, e8m0=not form["e4m3"]):
        # the tiled blocks sum into two accumulator sets where the natural layout's sum into one: the same
        # fp32 terms in another order, so the w13 outputs may round to a neighbouring bf16 and move the w2
        # sums with them
        _check(got, natural.float(), tol=ACC2_TOL)
    else:
        assert torch.equal(got, natural)


def test_x4_prepare_in_place_on_the_gpu(x4_layer: dict, reference: Reference) -> None:
    """The vLLM method's in-place repack gives what prepare gives, and fused_moe takes the result."""
    t = {k: v.clone() for k, v in x4_layer.items()}
    assert prepare_in_place(t) == X4_NAMES
    prepared = prepare(x4_layer)
    for natural, x4 in X4_NAMES.items():
        assert torch.equal(t[natural].view(torch.uint8), prepared[x4].view(torch.uint8))
    x = torch.randn((3, H), device="cuda").to(torch.bfloat16)
    w, ids = _routing(3, 5)
    _check(fused_moe(x, prepared, w, ids), reference(x, x4_layer, w, ids, None))


def test_x4_repack_kernel_equals_the_torch_bit_moves(x4_layer: dict) -> None:
    """The repack kernel (x4_repack.cu) moves the bits of base and delta planes as the torch ops of the CPU
    path do, and back."""
    for name in (n for n in X4_NAMES if x4_layer[n].dtype == torch.uint8):  # the planes (scales: tiles only)
        delta = name.endswith("_delta")
        plane = x4_layer[name]
        got = plane.clone()
        x4_table._relayout_(got, delta, inverse=False)
        want = x4_table._move_bits(plane.view(torch.int32), delta, inverse=False).view(torch.uint8)
        assert torch.equal(got, want) and not torch.equal(got, plane)
        x4_table._relayout_(got, delta, inverse=True)
        assert torch.equal(got, plane)


@pytest.mark.parametrize("T,config", [(1, DEFAULT), (16, DEFAULT), (64, DEFAULT), (300, Config.only(Prefill())),
                                      (300, Config.only(Prefill(16, 4, 2, True, 1)))])
def test_x4_layer_with_every_expert_in_the_tier(x4_layer: dict, T: int, config: Config,
                                                reference: Reference) -> None:
    """Every expert on the x4 tier decode (x4_tier_reg: exact FP4 through bf16 subnormals, the scale x
    2^118, the 2^8 in the epilogue), decode and prefill blocks. Codes 0.5 lost as flushed subnormals
    would be about 6% error: far over the bound."""
    full = dict(x4_layer, delta_experts=torch.arange(E, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(40)
    full["w13_delta"] = torch.randint(0, 256, (E, 2 * I, H // 4), generator=g, dtype=torch.uint8, device="cuda")
    full["w2_delta"] = torch.randint(0, 256, (E, H, I // 4), generator=g, dtype=torch.uint8, device="cuda")
    planes = LayerPlanes.from_tensors(prepare(full))
    assert planes.layout == X4
    x = torch.randn((T, H), generator=g, device="cuda").to(torch.bfloat16)
    w, ids = _routing(T, 40 + T, all_hot=T >= 64)
    _check(fused_moe_cuda(x, planes, w, ids, 7.0, config), reference(x, full, w, ids, 7.0))


@pytest.mark.parametrize("T,block", [(1, Mma(1, 2, 2, direct=True, pdl=True)),
                                     (16, Mma(1, 2, 2, direct=True, lean=True, pdl=True)),
                                     (64, Mma(1, 2, 2, lean=True, pdl=True))])
def test_dependent_launch_computes_the_same(x4_layer: dict, T: int, block: Mma) -> None:
    """Launched dependent (each kernel may start before the one ahead ends and waits for its output
    itself), a layer gives the same bits as launched plainly, eagerly and from CUDA graph replays (a
    missing wait would read the activations before they are written)."""
    prepared = LayerPlanes.from_tensors(prepare(x4_layer))
    x = torch.randn((T, H), device="cuda").to(torch.bfloat16)
    w, ids = _routing(T, 900 + T)
    ids[0, :2] = x4_layer["delta_experts"][:2]
    plain = dataclasses.replace(block, pdl=False)
    want = fused_moe_cuda(x, prepared, w, ids, 7.0, Config.only(plain))
    step = lambda: fused_moe_cuda(x, prepared, w, ids, 7.0, Config.only(block))  # noqa: E731
    assert torch.equal(step(), want)
    for _ in range(5):
        replayed(step)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pair_rows_kernel_equals_k_paired_and_zeroes_the_arrivals(dtype: torch.dtype) -> None:
    """The pair_rows kernel (mma_moe.cu) gives the torch k_paired's rows (the CPU definition, checked
    against the mma emulation in test_runtime_mma_bits.py), and zeroes the w2 kernel's arrival counts
    whether they are fewer or more than the groups of 16."""
    g = torch.Generator(device="cuda").manual_seed(3)
    for T, n_arrived in ((1, H // 16), (5, 7), (2, 3000)):
        x = torch.randn((T, H), generator=g, device="cuda").to(dtype)
        arrived = torch.full((n_arrived,), 77, dtype=torch.int32, device="cuda")
        assert torch.equal(mma_moe.paired_rows(x, arrived), mma_moe.k_paired(x))
        assert not arrived.any()


@pytest.mark.parametrize("T", [1, 2, 7, 16, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("lean", [False, True])
def test_w2_sum_equals_moe_sum(x4_layer: dict, T: int, dtype: torch.dtype, lean: bool) -> None:
    """`sum_in_w2`: the w2 kernel sums each token's top-k slots (sum_when_last: the block that completes
    a token's 16 rows sums them, in slot order), where otherwise moe_sum does: the same bits, eagerly and
    from graph replays. An arrival lost, counted twice, or a sum begun early would differ. A repeated
    expert in one row (_routing) sends two of a token's slots through one block."""
    planes = LayerPlanes.from_tensors(prepare(x4_layer))
    g = torch.Generator(device="cuda").manual_seed(60 + T)
    x = torch.randn((T, H), generator=g, device="cuda").to(dtype)
    w, ids = _routing(T, 60 + T)
    ids[0, :2] = x4_layer["delta_experts"][:2]
    block = Mma(1, 2, 2, direct=True, lean=lean, pdl=True)
    want = fused_moe_cuda(x, planes, w, ids, 7.0, Config.only(block))
    summed = Config.only(dataclasses.replace(block, sum_in_w2=True))
    got = fused_moe_cuda(x, planes, w, ids, 7.0, summed)
    assert got.dtype == dtype and torch.equal(got, want)
    for _ in range(3):
        replayed(lambda: fused_moe_cuda(x, planes, w, ids, 7.0, summed))


def test_kernels_loaded_from_kept_images_equal_compiled(x4_layer: dict, tmp_path, monkeypatch) -> None:
    """A start that finds the kernels' images kept (kernel_cache.py) loads them and compiles nothing, and
    its decode and prefill kernels (the latter with their shared-memory limit raised) give the bits of the
    kernels compiled in this process."""
    import torch.cuda._utils as cuda_utils

    from moet_cache.runtime import kernel_cache

    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path))
    t = prepare(x4_layer)
    runs = [_tokens_to_tier(x4_layer, T, 900 + T) for T in (1, 300)]

    def fresh_outputs() -> list[torch.Tensor]:
        mma_moe.compiled.cache_clear()
        mma_prefill._kernel.cache_clear()
        return [fused_moe(x, t, w, ids, swiglu_limit=7.0) for x, w, ids in runs]

    compiled = fresh_outputs()
    kept = sorted(tmp_path.iterdir())
    assert len(kept) >= 5  # pair_rows, the decode w13 / w2, the prefill w13 / w2

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled although its image was kept")

    monkeypatch.setattr(cuda_utils, "_nvrtc_compile", no_compile)
    loaded = fresh_outputs()
    assert sorted(tmp_path.iterdir()) == kept
    for a, b in zip(compiled, loaded):
        assert torch.equal(a, b)


#: batches padded as vLLM pads them (real rows, padding rows with expert id -1 in every slot, the block;
#: None: the one DEFAULT picks for the padded batch): decode to a CUDA-graph size, prefill to a chunk
PADDED = [(1, 3, dataclasses.replace(SPLIT, sum_in_w2=True)), (1, 1, None), (1, 7, None), (2, 6, None),
          (3, 1, None), (5, 3, None), (13, 3, None), (40, 8, None), (300, 212, None), (4000, 96, None),
          (1, 7, Pairs(64, 8, 2)), (20, 12, DEFAULT.mid), (300, 212, DEFAULT.large)]


@pytest.mark.parametrize("T,pad,block", PADDED)
def test_padding_rows_skipped_eagerly_and_in_cuda_graphs(layer: dict, T: int, pad: int, block,
                                                         reference: Reference) -> None:
    """vLLM 0.34's routers set the padding rows' expert ids to -1 (VLLM_MOE_SKIP_PADDING): on every path
    (the direct, whole-K, lean and sorted decode blocks, the prefill blocks, Triton's pairs and grouped
    kernels), with the kernels the padded batch takes, the real rows are bit-identical to the batch
    without the padding rows and the padding rows are 0, though their activations and weights are not
    finite; a CUDA graph replays it exactly (no host sync). A fitted-table layer, tiled as served."""
    _padding_rows_skipped(layer, T, pad, block, reference)


@pytest.mark.parametrize("T,pad,block", PADDED)
def test_padding_rows_skipped_eagerly_and_in_cuda_graphs_x4(x4_layer: dict, T: int, pad: int, block,
                                                            reference: Reference) -> None:
    """The same on an x4 layer, repacked as served (a test a form, so that each case runs once for each scale
    form of the layer it reads)."""
    _padding_rows_skipped(x4_layer, T, pad, block, reference)


def _padding_rows_skipped(raw: dict, T: int, pad: int, block, reference: Reference) -> None:
    planes = LayerPlanes.from_tensors(prepare(raw))
    config = Config.only(block or DEFAULT.pick((T + pad) * K, **layer_form(planes)))
    x, w, ids = _tokens_to_tier(raw, T, 1000 + T)
    ids = ids.int()  # as vLLM's routers give them
    want = fused_moe_cuda(x, planes, w, ids, 7.0, config)
    xp = torch.cat([x, torch.full((pad, H), float("nan"), dtype=x.dtype, device="cuda")])
    xp[T] = float("inf")
    wp = torch.cat([w, torch.full((pad, K), float("inf"), device="cuda")])
    ip = torch.cat([ids, torch.full((pad, K), -1, dtype=ids.dtype, device="cuda")])
    step = lambda: fused_moe_cuda(xp, planes, wp, ip, 7.0, config)  # noqa: E731
    got = step()
    assert torch.equal(got[:T], want)
    assert bool((got[T:] == 0).all())
    replayed(step)
    _check(want, reference(x, raw, w, ids, 7.0))
