"""fused_moe on the CPU (the reference path) against references computed independently from the
source checkpoint's FP4 codes: every delta plane, base only, a mixed tier, both block-scale forms."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from moet_cache.errors import InputError
from moet_cache.format.fp4 import E2M1_VALUES, unpack_codes
from moet_cache.load import open_cache
from moet_cache.runtime import fused_moe

PROJ = ("gate_proj", "up_proj", "down_proj")


class Source:
    """The source checkpoint's routed experts, read with safetensors alone (ModelOpt layout)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]

    def _get(self, name: str) -> torch.Tensor:
        with safe_open(str(self.root / self.index[name]), framework="pt") as f:
            return f.get_tensor(name)

    def codes(self, layer: int, e: int, proj: str) -> tuple[np.ndarray, np.ndarray, float]:
        """(codes uint8 [out, in], block scales float64 [out, in/16], global scale) of one projection."""
        p = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
        codes = unpack_codes(self._get(f"{p}.weight").numpy())
        scale = self._get(f"{p}.weight_scale").float().numpy().astype(np.float64)
        return codes, scale, float(self._get(f"{p}.weight_scale_2"))


def _weight(codes: np.ndarray, scale: np.ndarray, gscale: float, table: np.ndarray | None) -> np.ndarray:
    """float64 [out, in]: E2M1[code] (table None) or table[code >> 2], times block and global scales."""
    v = E2M1_VALUES.astype(np.float64)[codes] if table is None else table.astype(np.float64)[codes >> 2]
    return v * np.repeat(scale, codes.shape[1] // scale.shape[1], axis=1) * gscale


def moe_reference(src: Source, layer: int, tensors: dict[str, torch.Tensor], x: np.ndarray,
                  weights: np.ndarray, ids: np.ndarray, fp4_experts: set[int],
                  limit: float | None = None) -> np.ndarray:
    """float64 MoE output from the source's codes: fp4_experts at FP4, the rest through the cache's tables."""
    out = np.zeros((x.shape[0], x.shape[1]))
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            tab = None if e in fp4_experts else tensors["w13_table"][e].numpy()
            g = _weight(*src.codes(layer, e, "gate_proj"), None if tab is None else tab[0]) @ x[t]
            u = _weight(*src.codes(layer, e, "up_proj"), None if tab is None else tab[1]) @ x[t]
            if limit is not None:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            act = g / (1 + np.exp(-g)) * u
            t2 = None if e in fp4_experts else tensors["w2_table"][e].numpy()
            out[t] += weights[t, k] * (_weight(*src.codes(layer, e, "down_proj"), t2) @ act)
    return out


def _routing(T: int, E: int, k: int, seed: int, repeat: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if repeat and T > 1:
        ids[1, 1] = ids[1, 0]  # the same expert twice in one row counts twice
    w = torch.rand((T, k), generator=g) * 1.5  # weights as given, routed_scaling_factor folded in
    return w, ids


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def layers(lossless: tuple[Path, Path]) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
    cache = open_cache(lossless[1])
    return {d: {x.index: x.tensors for x in cache.load(device="cpu", delta=d, workers=1)}
            for d in ("all", "none", "tier")}


def _case(layers: dict, lossless: tuple[Path, Path], delta: str, seed: int = 0, T: int = 5):
    src = Source(lossless[0])
    L = min(layers[delta])
    t = layers[delta][L]
    E, H = t["w13_base"].shape[0], t["w13_base"].shape[2] * 4
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((T, H), generator=g)
    w, ids = _routing(T, E, 6, seed)
    return src, L, t, x, w, ids


def test_delta_all_equals_fp4_layer(layers, lossless) -> None:
    src, L, t, x, w, ids = _case(layers, lossless, "all")
    got = fused_moe(x, t, w, ids)
    assert got.dtype == torch.float32 and got.shape == x.shape
    ref = moe_reference(src, L, t, x.double().numpy(), w.double().numpy(), ids.numpy(), set(range(16)))
    assert _rel(got.double().numpy(), ref) < 1e-5


def test_base_only_equals_table_layer(layers, lossless) -> None:
    src, L, t, x, w, ids = _case(layers, lossless, "none", seed=1)
    assert "delta_experts" not in t
    got = fused_moe(x, t, w, ids.int())  # int32 ids, as a router may give
    ref = moe_reference(src, L, t, x.double().numpy(), w.double().numpy(), ids.numpy(), set())
    assert _rel(got.double().numpy(), ref) < 1e-5
    fp4 = moe_reference(src, L, t, x.double().numpy(), w.double().numpy(), ids.numpy(), set(range(16)))
    assert 0.05 < _rel(ref, fp4) < 1.0  # the tables are not the FP4 values: the test can tell them apart


def test_mixed_tier(layers, lossless) -> None:
    src, L, t, x, w, ids = _case(layers, lossless, "tier", seed=2, T=8)
    tier = set(t["delta_experts"].tolist())
    assert 0 < len(tier) < 16
    ids[0, 0] = next(iter(tier))  # at least one tier and one base-only expert routed
    ids[0, 1] = next(e for e in range(16) if e not in tier and e not in ids[0].tolist())
    got = fused_moe(x, t, w, ids, swiglu_limit=None)
    ref = moe_reference(src, L, t, x.double().numpy(), w.double().numpy(), ids.numpy(), tier)
    assert _rel(got.double().numpy(), ref) < 1e-5


def test_empty_and_full_tier(layers, lossless) -> None:
    _, L, t_all, x, w, ids = _case(layers, lossless, "all", seed=3)
    empty = dict(t_all, w13_delta=t_all["w13_delta"][:0], w2_delta=t_all["w2_delta"][:0],
                 delta_experts=t_all["delta_experts"][:0])
    assert torch.equal(fused_moe(x, empty, w, ids), fused_moe(x, layers["none"][L], w, ids))
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(5))  # tier rows in any order
    full = dict(t_all, w13_delta=t_all["w13_delta"][perm], w2_delta=t_all["w2_delta"][perm],
                delta_experts=t_all["delta_experts"][perm])
    torch.testing.assert_close(fused_moe(x, full, w, ids), fused_moe(x, t_all, w, ids), rtol=1e-6, atol=1e-6)


def test_zero_tokens_and_dtype(layers) -> None:
    t = next(iter(layers["tier"].values()))
    H = t["w13_base"].shape[2] * 4
    out = fused_moe(torch.empty((0, H), dtype=torch.bfloat16), t, torch.empty((0, 6)),
                    torch.empty((0, 6), dtype=torch.int64))
    assert out.shape == (0, H) and out.dtype == torch.bfloat16
    x = torch.randn((3, H), dtype=torch.bfloat16)
    w, ids = _routing(3, 16, 6, 4)
    got = fused_moe(x, t, w, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), fused_moe(x.float(), t, w, ids), rtol=1e-2, atol=1e-2)


def test_swiglu_limit_clamps_like_vllm(layers, lossless) -> None:
    src, L, t, x, w, ids = _case(layers, lossless, "all", seed=6, T=4)
    x = x * 50  # large activations so that gate and up pass the limit
    limit = 0.5
    got = fused_moe(x, t, w, ids, swiglu_limit=limit)
    ref = moe_reference(src, L, t, x.double().numpy(), w.double().numpy(), ids.numpy(), set(range(16)), limit)
    plain = moe_reference(src, L, t, x.double().numpy(), w.double().numpy(), ids.numpy(), set(range(16)))
    assert _rel(got.double().numpy(), ref) < 1e-5
    assert _rel(ref, plain) > 0.1  # the clamp was active


def _e8m0_layer(t: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The compact form: e8m0 block scales per 32 (random powers of two), built directly."""
    g = torch.Generator().manual_seed(seed)
    out = dict(t)
    for name, base in (("w13_weight_scale", "w13_base"), ("w2_weight_scale", "w2_base")):
        E, rows, cols4 = t[base].shape
        exps = torch.randint(120, 130, (E, rows, cols4 * 4 // 32), generator=g, dtype=torch.uint8)
        out[name] = exps.view(torch.float8_e8m0fnu)
    return out


def _dequant_ref(t: dict[str, torch.Tensor], e: int, proj: str, fp4: bool) -> np.ndarray:
    """float64 [out, in] of one expert's w13 or w2 from the planes (independent numpy bit maths)."""
    base = t[f"{proj}_base"][e].numpy()
    codes = np.stack([(base >> (2 * j)) & 3 for j in range(4)], axis=-1).reshape(base.shape[0], -1)
    if fp4:
        row = t["delta_experts"].tolist().index(e)
        d = t[f"{proj}_delta"][row].numpy()
        delta = np.stack([(d >> (2 * j)) & 3 for j in range(4)], axis=-1).reshape(d.shape[0], -1)
        v = E2M1_VALUES.astype(np.float64)[(codes << 2) | delta]
    else:
        tab = t[f"{proj}_table"][e].double().numpy()
        tab = np.repeat(tab, codes.shape[0] // 2, axis=0) if proj == "w13" else np.tile(tab, (codes.shape[0], 1))
        v = np.take_along_axis(tab, codes.astype(np.int64), axis=1)
    s = t[f"{proj}_weight_scale"][e].float().double().numpy()
    s2 = t[f"{proj}_weight_scale_2"][e].double().numpy().reshape(-1)
    s2 = np.repeat(s2, codes.shape[0] // s2.size)[:, None]
    return v * np.repeat(s, codes.shape[1] // s.shape[1], axis=1) * s2


@pytest.mark.parametrize("delta", ["tier", "none"])
def test_e8m0_compact_scales(layers, lossless, delta: str) -> None:
    _, _, t, x, w, ids = _case(layers, lossless, delta, seed=7)
    t = _e8m0_layer(t, 9)
    assert t["w13_weight_scale"].shape[-1] * 32 == x.shape[1]
    got = fused_moe(x, t, w, ids).double().numpy()
    tier = set(t["delta_experts"].tolist()) if "delta_experts" in t else set()
    I = t["w13_base"].shape[1] // 2
    ref = np.zeros_like(got)
    xd = x.double().numpy()
    for ti in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[ti, k])
            gu = _dequant_ref(t, e, "w13", e in tier) @ xd[ti]
            g, u = gu[:I], gu[I:]
            ref[ti] += float(w[ti, k]) * (_dequant_ref(t, e, "w2", e in tier) @ (g / (1 + np.exp(-g)) * u))
    assert _rel(got, ref) < 1e-5


def test_e8m0_equals_paired_e4m3(layers, lossless) -> None:
    """The MXFP4->NVFP4 cast: e4m3 power-of-two scales equal in pairs give the e8m0 form's output."""
    _, _, t, x, w, ids = _case(layers, lossless, "tier", seed=8)
    t8 = _e8m0_layer(t, 10)
    t4 = dict(t8)
    for name in ("w13_weight_scale", "w2_weight_scale"):
        t4[name] = t8[name].float().repeat_interleave(2, dim=-1).to(torch.float8_e4m3fn)
        assert torch.equal(t4[name].float(), t8[name].float().repeat_interleave(2, dim=-1))
    assert torch.equal(fused_moe(x, t4, w, ids), fused_moe(x, t8, w, ids))


def test_refuses_bad_input(layers) -> None:
    t = next(iter(layers["tier"].values()))
    H = t["w13_base"].shape[2] * 4
    x = torch.randn((2, H))
    w, ids = _routing(2, 16, 6, 0)
    with pytest.raises(InputError, match="w2_table"):
        fused_moe(x, {k: v for k, v in t.items() if k != "w2_table"}, w, ids)
    with pytest.raises(InputError, match="top_k"):
        fused_moe(x, t, w[:, :3], ids)
    with pytest.raises(InputError, match="outside"):
        fused_moe(x, t, w, ids + 16)
    with pytest.raises(InputError, match="tokens"):
        fused_moe(x[:, :8], t, w, ids)


# ---- DeepSeek-V4 caches: the compact e8m0 form as the build stores it ------------------------------

class V4Source(Source):
    """V4 routed experts (layers.L.ffn.experts.E.{w1,w3,w2}), MXFP4 (.weight int8, .scale e8m0 per 32,
    no global scale) or ModelOpt NVFP4 (.weight uint8, .weight_scale e4m3 per 16, .weight_scale_2)."""

    NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

    def codes(self, layer: int, e: int, proj: str) -> tuple[np.ndarray, np.ndarray, float]:
        p = f"layers.{layer}.ffn.experts.{e}.{self.NAMES[proj]}"
        codes = unpack_codes(self._get(f"{p}.weight").view(torch.uint8).numpy())
        if f"{p}.scale" in self.index:
            return codes, self._get(f"{p}.scale").float().double().numpy(), 1.0
        scale = self._get(f"{p}.weight_scale").float().double().numpy()
        return codes, scale, float(self._get(f"{p}.weight_scale_2"))


@pytest.fixture(scope="module", params=["mxfp4", "hybrid"])
def v4_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from moet_cache import BuildOptions, build_cache
    from moet_cache.source.synthetic import make_v4_checkpoint, small_v4_spec

    work = tmp_path_factory.mktemp(f"v4{request.param}")
    spec = small_v4_spec(request.param, num_hidden_layers=2, mtp_blocks=0, num_nextn_predict_layers=0,
                         num_experts_per_tok=6)
    src = make_v4_checkpoint(work / "src", spec)
    build_cache(src, work / "cache", BuildOptions(lossless=True, delta_budget="25%"))
    cache = open_cache(work / "cache")
    layers = {d: {x.index: x.tensors for x in cache.load(device="cpu", delta=d, workers=1)}
              for d in ("all", "none", "tier")}
    return V4Source(src), layers


@pytest.mark.parametrize("delta", ["all", "none", "tier"])
def test_v4_cache_compact_scales(v4_cache, delta: str) -> None:
    src, layers = v4_cache
    L = max(layers[delta])
    t = layers[delta][L]
    assert t["w13_weight_scale"].dtype == torch.float8_e8m0fnu  # the compact form, group 32
    E, H = t["w13_base"].shape[0], t["w13_base"].shape[2] * 4
    g = torch.Generator().manual_seed(L)
    x = torch.randn((6, H), generator=g)
    w, ids = _routing(6, E, 6, L)
    fp4 = {"all": set(range(E)), "none": set(), "tier": set(t.get("delta_experts", torch.empty(0)).tolist())}[delta]
    if delta == "tier":
        assert 0 < len(fp4) < E
    got = fused_moe(x, t, w, ids, swiglu_limit=10.0)
    ref = moe_reference(src, L, t, x.double().numpy(), w.double().numpy(), ids.numpy(), fp4, 10.0)
    assert _rel(got.double().numpy(), ref) < 1e-5


def test_config_picks_each_regime_by_pairs() -> None:
    """launch.Config: decode kernels below the first prefill step, each prefill step from its pair count,
    Triton where neither tensor-core family runs, and Config.only pinning one block."""
    from moet_cache.runtime.launch import DEFAULT, LEAN, WHOLE, Config, Grouped, Mma, Pairs, PrefillLater, Prefill

    # DEFAULT: the H200's steps (configs/NVIDIA_H200.json)
    MMA_STEPS, MMA_STEPS_X4, MMA_STEPS_X4_BASE = DEFAULT.mma, DEFAULT.mma_x4, DEFAULT.mma_x4_base
    MMA_STEPS_X4_E4M3, PREFILL_STEPS, PREFILL_LATER = DEFAULT.mma_x4_e4m3, DEFAULT.prefill, DEFAULT.prefill_later
    SUM_IN_W2_BELOW, WHOLE_K_BELOW = 12, 18

    starts = [start for start, _ in PREFILL_STEPS]
    assert starts == sorted(starts) and starts[0] <= DEFAULT.large_from
    for steps, form in ((MMA_STEPS, {}), (MMA_STEPS_X4, {"x4": True}), (MMA_STEPS_X4_E4M3, {"x4": True, "e4m3": True}),
                        (MMA_STEPS, {"e4m3": True}), (MMA_STEPS_X4_BASE, {"x4": True, "tier": False}),
                        (MMA_STEPS_X4_E4M3, {"x4": True, "e4m3": True, "tier": False}),
                        (MMA_STEPS, {"tier": False})):
        mma_starts = [start for start, _ in steps]
        assert mma_starts[0] == 0 and mma_starts == sorted(mma_starts) and mma_starts[-1] < starts[0]
        for (start, block), nxt in zip(steps, mma_starts[1:] + starts[:1]):
            assert DEFAULT.pick(start, **form) == block and DEFAULT.pick(nxt - 1, **form) == block
        # decode: direct blocks, no align kernels; every decode block launched dependent; below
        # SUM_IN_W2_BELOW pairs (T = 1) the w2 kernel sums the top-k slots, where moe_sum does from there;
        # K whole from there to WHOLE_K_BELOW (T = 2: one wave), split in two before and after
        assert DEFAULT.pick(6, **form) == Mma(1, 2, 2, direct=True, pdl=True, sum_in_w2=True)
        assert DEFAULT.pick(SUM_IN_W2_BELOW, **form) == WHOLE == Mma(1, 1, 1, direct=True, pdl=True)
        assert DEFAULT.pick(WHOLE_K_BELOW, **form) == Mma(1, 2, 2, direct=True, pdl=True)
        assert SUM_IN_W2_BELOW <= 12 < WHOLE_K_BELOW <= 18
        assert DEFAULT.pick(starts[0] - 1, **form) == Mma(1, 2, 2, lean=True, pdl=True)
        assert all(block.pdl for _, block in steps)
    # each form's steps past T = 3 (the H200 crossovers): fitted tables K whole from 36 pairs to 287, sorted
    # from 288; x4 with e8m0 scales lean from 24 (without a tier K whole from 24, lean from 72), x4 with e4m3
    # scales K whole from 24; the x4 forms sorted from 224
    split = Mma(1, 2, 2, direct=True, pdl=True)
    sorted_lean = Mma(1, 2, 2, lean=True, pdl=True)
    for e4m3 in (False, True):
        assert DEFAULT.pick(35, e4m3=e4m3) == split and DEFAULT.pick(36, e4m3=e4m3) == WHOLE
        assert DEFAULT.pick(287, e4m3=e4m3) == WHOLE and DEFAULT.pick(288, e4m3=e4m3) == sorted_lean
        assert DEFAULT.pick(224, x4=True, e4m3=e4m3) == sorted_lean
    assert DEFAULT.pick(23, x4=True) == split and DEFAULT.pick(24, x4=True) == LEAN
    assert DEFAULT.pick(24, x4=True, tier=False) == WHOLE and DEFAULT.pick(72, x4=True, tier=False) == LEAN
    assert DEFAULT.pick(23, x4=True, e4m3=True) == split and DEFAULT.pick(24, x4=True, e4m3=True) == WHOLE
    assert DEFAULT.pick(223, x4=True, e4m3=True, tier=False) == WHOLE
    for (start, block), nxt in zip(PREFILL_STEPS, starts[1:] + [1 << 40]):
        assert DEFAULT.pick(start, tier=False) == block and DEFAULT.pick(nxt - 1, tier=False) == block
    # the first prefill step comes later by form (PREFILL_LATER: a tier 112, e4m3 160 pairs), the sorted lean
    # blocks before it; the steps after it stay where they are
    for x4, e4m3, tier in itertools.product((False, True), repeat=3):
        form = {"x4": x4, "e4m3": e4m3, "tier": tier}
        first = starts[0] + 112 * tier + 160 * e4m3
        assert first == starts[0] + PREFILL_LATER.of(**form) < starts[1]
        assert DEFAULT.pick(first - 1, **form) == Mma(1, 2, 2, lean=True, pdl=True)
        assert DEFAULT.pick(first, **form) == PREFILL_STEPS[0][1]
        assert DEFAULT.pick(starts[1], **form) == PREFILL_STEPS[1][1]
    assert Config(prefill_later=PrefillLater()).pick(starts[0], x4=True, e4m3=True) == PREFILL_STEPS[0][1]
    assert isinstance(DEFAULT.pick(starts[0], prefill_runs=False), Mma)
    assert isinstance(DEFAULT.pick(DEFAULT.large_from, prefill_runs=False), Grouped)
    assert isinstance(DEFAULT.pick(6, mma_runs=False, prefill_runs=False), Pairs)
    only = Prefill(4, 8, 4)
    assert Config.only(only).pick(1) == only and Config(prefill=()).pick(1 << 20) == DEFAULT.large
    assert Config.only(Mma(1, 1, 1)).pick(5, x4=True) == Mma(1, 1, 1)
    with pytest.raises(ValueError):
        Prefill(16, 2, 3)  # 2 warps: not a tested shape
    with pytest.raises(ValueError):
        Mma(2, 2, 2, direct=True)  # direct blocks are one column of 8 pairs
    with pytest.raises(ValueError):
        Mma(1, 2, 2, sum_in_w2=True)  # the w2 kernel's sum needs the direct blocks' groups
    assert Config(mma=()).pick(6) == DEFAULT.tiny  # no decode kernels: Triton
    assert Config(mma_x4=()).pick(6, x4=True) == DEFAULT.tiny
    assert Config(mma_x4_e4m3=()).pick(6, x4=True, e4m3=True) == DEFAULT.tiny
    assert Config(mma_x4_base=()).pick(6, x4=True, tier=False) == DEFAULT.tiny
    assert Config.only(Mma(1, 1, 1)).pick(5, x4=True, e4m3=True) == Mma(1, 1, 1)


def test_prefill_blocks_fit_each_cards_shared_memory() -> None:
    """mma_prefill.within: on a card whose CTAs may take less shared memory than the H200's 227 KB (99 KB on
    sm_86, sm_89 and sm_120, the RTX PRO 6000), every prefill step still runs on the prefill kernels, with
    fewer stages where it must; at the H200's limit every step is as measured."""
    from moet_cache.runtime.launch import DEFAULT, Config
    from moet_cache.runtime.mma_prefill import Prefill, within

    h200, rtx_pro_6000 = 227 * 1024, 99 * 1024
    for _, block in DEFAULT.prefill + Config().prefill:  # the H200's steps and an unknown device's
        assert within(block, h200) == block
        fit = within(block, rtx_pro_6000)
        assert fit is not None and fit.smem_bytes() <= rtx_pro_6000
        assert dataclasses.replace(fit, stages=block.stages) == block
        assert fit == block or dataclasses.replace(fit, stages=fit.stages + 1).smem_bytes() > rtx_pro_6000
    # an 8-warp step that needs it: 104 KB with 4 stages, 78 KB with 3
    assert Prefill(4, 8, 4).smem_bytes() == 106496 and within(Prefill(4, 8, 4), rtx_pro_6000) == Prefill(4, 8, 3)
    assert within(Prefill(4, 8, 4), Prefill(4, 8, 2).smem_bytes() - 1) is None  # not even two stages


def test_layer_form_reads_the_layout_and_the_scales() -> None:
    """launch.layer_form: what fused_moe_cuda hands Config.pick for a layer (x4 layout, e4m3 scales, a
    tier)."""
    from moet_cache.codec.planes import X4_PATTERN
    from moet_cache.runtime import layout
    from moet_cache.runtime.dequant import LayerPlanes
    from moet_cache.runtime.launch import layer_form
    from moet_cache.runtime.synthetic_layer import random_layer

    for e8m0, n_tier in ((True, 0), (False, 0), (True, 1)):
        t = random_layer(4, 256, 256, n_tier=n_tier, e8m0=e8m0, device="cpu", seed=1)
        form = {"e4m3": not e8m0, "tier": n_tier > 0}
        assert layer_form(LayerPlanes.from_tensors(t)) == {"x4": False, **form}
        pattern = torch.as_tensor(X4_PATTERN)
        x4 = layout.prepare(dict(t, w13_table=t["w13_table"][..., :1].abs() * pattern,
                                 w2_table=t["w2_table"][..., :1].abs() * pattern))
        assert layer_form(LayerPlanes.from_tensors(x4)) == {"x4": True, **form}


def test_warm_up_compiles_nothing_where_the_plane_kernels_do_not_run() -> None:
    """runtime.warm_up on a CPU layer (vLLM's CPU build calls it at load): no kernels, nothing compiled."""
    from moet_cache.runtime.dequant import LayerPlanes
    from moet_cache.runtime.synthetic_layer import random_layer
    from moet_cache.runtime.warm_up import kernel_names, warm_up

    planes = LayerPlanes.from_tensors(random_layer(8, 256, 128, n_tier=2, e8m0=True, device="cpu", seed=3))
    assert kernel_names(planes, planes.w13_base.device) == [] and warm_up(planes) == 0
