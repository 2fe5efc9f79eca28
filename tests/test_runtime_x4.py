"""The x4 base table on the runtime side (moet_cache/runtime/x4_table.py): the bit layout's round trip,
which layers take it, the prepared tensors through the reference and the vLLM method's repack, on the
CPU. The decode itself is emulated in tests/test_runtime_mma_bits.py and run in tests/test_runtime_gpu.py."""

from __future__ import annotations

import pytest
import torch

from moet_cache.codec.planes import X4_PATTERN
from moet_cache.runtime import layout, plane_layout, x4_table
from moet_cache.runtime.dequant import LayerPlanes, unpack_plane
from moet_cache.runtime.layout import prepare, prepare_in_place
from moet_cache.runtime.plane_layout import NATURAL, TILED, X4, moved_rows
from moet_cache.runtime.synthetic_layer import random_layer
from moet_cache.runtime.tiles import tile, tiles_fit
from moet_cache.runtime.x4_table import MAX_TIER_E8M0_BYTE, bit_moves, delta_bit_moves, is_x4, scales_fit

TILED_NAMES, X4_NAMES = TILED.names, X4.names

E, H, I = 8, 512, 256  # the smallest dims whose planes split into the x4 layout's tiles: K in whole chunks


def x4_tables(t: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """t with every table a * X4_PATTERN, a random and positive."""
    g = torch.Generator().manual_seed(seed)
    pattern = torch.as_tensor(X4_PATTERN)
    out = dict(t)
    out["w13_table"] = (torch.rand((E, 2, 1), generator=g) + 0.5) * pattern
    out["w2_table"] = (torch.rand((E, 1), generator=g) + 0.5) * pattern
    return out


def to_x4(t: torch.Tensor, delta: bool = False) -> torch.Tensor:
    """A plane or block-scale tensor in the x4 layout (plane_layout.py: every plane row's bits moved, then tiles)."""
    return plane_layout.to_layout(t, moved_rows(t, delta, [], set(), X4), delta)


def to_natural(t: torch.Tensor, delta: bool = False) -> torch.Tensor:
    """to_x4's inverse."""
    return plane_layout.to_natural(t, moved_rows(t, delta, [], set(), X4), delta)


@pytest.fixture(params=["e8m0", "e4m3"])
def layer(request: pytest.FixtureRequest) -> dict[str, torch.Tensor]:
    return x4_tables(random_layer(E, H, I, n_tier=3, e8m0=request.param == "e8m0", device="cpu", seed=4))


@pytest.mark.parametrize("moves", [bit_moves, delta_bit_moves])
def test_bit_moves_are_a_permutation_of_the_word(moves) -> None:
    src, dst = zip(*moves())
    assert sorted(src) == sorted(dst) == list(range(32))


@pytest.mark.parametrize("delta", [False, True])
def test_to_x4_round_trips_every_expert(delta: bool) -> None:
    plane = torch.randint(0, 256, (5, 32, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = to_x4(plane, delta)
    assert all(not torch.equal(packed[e], plane[e]) for e in range(5))
    assert torch.equal(to_natural(packed, delta), plane)
    assert not torch.equal(to_x4(plane, not delta), packed)  # the two layouts differ
    # every code's two bits went where the moves say, word by word, once the tiles are put back
    rows = tile(packed, inverse=True)
    w, pw = plane.view(torch.int32)[3].reshape(-1).tolist(), rows.view(torch.int32)[3].reshape(-1).tolist()
    for a, b in zip(w, pw):
        for s, d in (delta_bit_moves() if delta else bit_moves()):
            assert (a >> s) & 1 == (b >> d) & 1


def test_relayout_rows_moves_those_rows_only() -> None:
    """x4_table.relayout_rows_ moves the bits of the rows it is given, in runs of consecutive rows or alone,
    and no other row's; back again with inverse."""
    plane = torch.randint(0, 256, (6, 32, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    for delta in (False, True):
        got = plane.clone()
        x4_table.relayout_rows_(got, [4, 0, 1, 3, 0], delta, inverse=False)
        for r in range(6):
            moved = x4_table._move_bits(plane[r].view(torch.int32), delta, inverse=False).view(torch.uint8)
            assert torch.equal(got[r], moved if r in (0, 1, 3, 4) else plane[r]), (delta, r)
        x4_table.relayout_rows_(got, [0, 1, 3, 4], delta, inverse=True)
        assert torch.equal(got, plane)


def test_is_x4_takes_layers_whose_tables_all_have_the_form(layer: dict) -> None:
    assert is_x4(layer)
    off = dict(layer, w2_table=layer["w2_table"].clone())
    off["w2_table"][3, 1] = torch.nextafter(off["w2_table"][3, 1], torch.tensor(0.0))
    assert not is_x4(off)  # one table off by an ulp


def test_prepare_tiles_fitted_layers_and_repacks_x4_ones(layer: dict) -> None:
    fitted = random_layer(E, H, I, n_tier=3, e8m0=True, device="cpu", seed=4)
    assert not is_x4(fitted) and "w13_base_tiled" in prepare(fitted)
    prepared = prepare(layer)
    assert set(prepared) == (set(layer) - set(X4_NAMES)) | set(X4_NAMES.values())
    for natural, x4 in X4_NAMES.items():  # every expert's base plane and scales, every tier row's delta plane
        delta = natural.endswith("_delta")
        assert torch.equal(prepared[x4].view(torch.uint8), to_x4(layer[natural], delta).view(torch.uint8))
        assert torch.equal(to_natural(prepared[x4], delta).view(torch.uint8), layer[natural].view(torch.uint8))
        assert prepared[x4].dtype == layer[natural].dtype and prepared[x4].shape == layer[natural].shape
    planes = LayerPlanes.from_tensors(prepared)
    assert planes.layout == X4 and LayerPlanes.from_tensors(layer).layout == NATURAL
    natural = planes.natural()
    for name, loaded in (("w13_base", "w13_base"), ("w2_base", "w2_base"), ("w13_delta", "w13_delta"),
                         ("w2_delta", "w2_delta"), ("w13_scale", "w13_weight_scale"), ("w2_scale", "w2_weight_scale")):
        assert torch.equal(getattr(natural, name).view(torch.uint8), layer[loaded].view(torch.uint8))
    # a layer loaded with delta="none" has base planes only
    base_only = {k: v for k, v in layer.items() if k not in ("w13_delta", "w2_delta", "delta_experts")}
    repacked = {"w13_base", "w2_base", "w13_weight_scale", "w2_weight_scale"}
    assert set(prepare(base_only)) == (set(base_only) - repacked) | {X4_NAMES[n] for n in repacked}
    assert LayerPlanes.from_tensors(prepare(base_only)).delta_experts.numel() == 0
    # planes that do not split into tiles (the kernels never take them: K under 512) stay as they are
    small = x4_tables(random_layer(E, 256, 128, n_tier=3, e8m0=True, device="cpu", seed=4))
    assert is_x4(small) and not tiles_fit(small) and prepare(small) is small


def test_x4_tables_are_a_times_the_pattern_by_base_code(layer: dict) -> None:
    """What a base expert computes from (a prepared layer on the reference: test_runtime_tiles.py): a * {1, 4,
    -1, -4} by base code."""
    base = unpack_plane(layer["w2_base"][1]).long()
    a = float(layer["w2_table"][1, 0])
    values = torch.as_tensor(X4_PATTERN)[base] * a
    assert torch.equal(values, layer["w2_table"][1][base])


def test_scales_too_large_for_x4_keep_the_natural_layout() -> None:
    t = x4_tables(random_layer(E, H, I, n_tier=0, e8m0=True, device="cpu", seed=5))
    assert scales_fit(t)
    big = t["w2_weight_scale"].view(torch.uint8).clone()
    big[0, 0, 0] = 253  # 2^126: x4 would overflow bf16's exponent
    t["w2_weight_scale"] = big.view(torch.float8_e8m0fnu)
    assert not scales_fit(t) and set(TILED_NAMES.values()) <= set(prepare(t))  # tiled, its bits as loaded


def test_a_tier_expert_takes_smaller_scales_than_a_base_one(layer: dict) -> None:
    """A tier expert's scale x 2^118 must stay a finite bf16 (mma_bits.cu x4_tier_scale): 2^9 at most."""
    if layer["w13_weight_scale"].dtype != torch.float8_e8m0fnu:
        assert scales_fit(layer)  # e4m3 tops out at 448
        return
    tier, base = int(layer["delta_experts"][0]), min(set(range(E)) - set(layer["delta_experts"].tolist()))
    for expert, fits in ((base, True), (tier, True), (tier, False)):
        s = layer["w13_weight_scale"].view(torch.uint8).clone()
        s[expert, 1, 0] = MAX_TIER_E8M0_BYTE + (0 if fits and expert == tier else 1)
        assert scales_fit(dict(layer, w13_weight_scale=s.view(torch.float8_e8m0fnu))) == fits


def test_prepare_in_place_only_where_the_kernels_run(layer: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU (no plane kernels) the vLLM method's repack leaves the planes as loaded; where the kernels
    take the layer it repacks them once (a second call, on the x4 names, moves nothing)."""
    before = layer["w13_base"].clone()
    assert not layout.kernels_take(layer) and prepare_in_place(layer) == {}
    assert torch.equal(layer["w13_base"], before)
    monkeypatch.setattr(layout, "kernels_take", lambda tensors: True)
    assert prepare_in_place(layer) == X4_NAMES
    assert torch.equal(layer["w13_base"], prepare({**layer, "w13_base": before})["w13_base_x4"])
    renamed = {X4_NAMES.get(k, k): v for k, v in layer.items()}
    assert prepare_in_place(renamed) == {}


def _bench_moe(monkeypatch: pytest.MonkeyPatch):
    """benchmarks/bench_moe.py as a module (it is a script, not part of the package)."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_moe", Path(__file__).resolve().parents[1] / "benchmarks" / "bench_moe.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_moe", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


def test_bench_moe_stream_copies_touch_no_expert_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_moe's stream harness: the copies of a routing are relabeled onto experts no other copy uses,
    so no layer of the stream finds its weights left in the L2 by another, and each keeps the routing's
    pattern (which slots share an expert), so each reads as many experts; 8 copies, fewer where E runs
    out."""
    bench = _bench_moe(monkeypatch)
    g = torch.Generator().manual_seed(9)
    for T, want in ((1, 8), (4, 8), (16, None)):
        ids = torch.rand((T, bench.E), generator=g).topk(bench.TOPK, dim=1).indices.to(torch.int32)
        ids[0, 1] = ids[0, 0]  # a repeated expert in one row
        copies = bench.disjoint_routings(ids)
        distinct = torch.unique(ids).numel()
        assert len(copies) == (want or bench.E // distinct) and len(copies) * distinct <= bench.E
        seen: set[int] = set()
        for c in copies:
            assert c.dtype == ids.dtype and c.shape == ids.shape
            experts = set(c.reshape(-1).tolist())
            assert not experts & seen and len(experts) == distinct
            seen |= experts
            same = ids.reshape(-1, 1) == ids.reshape(1, -1)
            assert torch.equal(c.reshape(-1, 1) == c.reshape(1, -1), same)


def test_bench_moe_counts_an_x4_layers_bytes_as_its_natural_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/bench_moe.py's bytes read (its GB/s and % of copy): an x4 layer, whose planes go by
    X4_NAMES, counts what the same layer in the natural layout does, the tier's delta planes included
    (the tier layers' rows had failed on the renamed planes)."""
    bench = _bench_moe(monkeypatch)
    t = x4_tables(random_layer(E, H, I, n_tier=3, e8m0=False, device="cpu", seed=4))
    x4 = prepare(t)
    assert "w13_delta_x4" in x4 and "w13_delta" not in x4
    tier = t["delta_experts"].tolist()
    other = next(e for e in range(E) if e not in tier)
    ids = torch.tensor([[tier[0], tier[1]], [tier[0], other]])
    per_expert = sum(t[n][0].numel() * t[n].element_size()
                     for n in ("w13_base", "w2_base", "w13_weight_scale", "w2_weight_scale"))
    delta = t["w13_delta"][0].numel() + t["w2_delta"][0].numel()
    assert bench.bytes_read(t, ids) == 3 * per_expert + 2 * delta
    assert bench.bytes_read(x4, ids) == bench.bytes_read(t, ids)
    assert bench.bytes_read({k: v for k, v in x4.items() if k != "delta_experts"}, ids) == 3 * per_expert


def test_bench_moe_goals_mark_each_miss(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """bench_moe's goals table: a served form's decode row misses on speed below 1.3x Humming and on copy
    below 50%, a prefill row only above 1.25x Humming's time; the Triton and untiled extras count for
    nothing, and the resident bytes are judged within 1%."""
    bench = _bench_moe(monkeypatch)

    def row(name: str, T: int, x: float, frac: float, harness: str = "stream") -> dict:
        served = name in ("planes x4 e8m0 tier10%", "planes fitted e8m0 base-only")  # speed_at's `form` rows
        return {"what": "speed", "harness": harness, "name": name, "tokens": T, "speedup_vs_humming": x,
                "copy_frac": frac, "form": name.removeprefix("planes ") if served else ""}

    rows = [{"what": "vram", "allocated_MiB": 100.5, "planes_e8m0_tier_MiB": 100.0},
            row("planes x4 e8m0 tier10%", 1, 2.3, 0.41), row("planes x4 e8m0 tier10%", 16, 1.29, 0.62),
            row("planes fitted e8m0 base-only", 16, 1.45, 0.5), row("planes x4 e8m0 tier10%", 64, 1.0, 0.3),
            row("planes x4 e8m0 tier10%", 4096, 0.81, 0.9), row("planes fitted e8m0 base-only", 4096, 0.79, 0.9),
            row("planes fitted e8m0 base-only, Triton", 1, 0.2, 0.1, "write"), row("humming mxfp4", 1, 1.0, 0.2)]
    bench.print_goals(rows, 4250.0)
    out = capsys.readouterr().out
    assert "missed (stream copy): 1: x4 e8m0 tier10% T=1" in out
    assert "missed (stream speed): 2: x4 e8m0 tier10% T=16, fitted e8m0 base-only T=4096" in out
    assert "Triton" not in out and "humming" not in out.split("\n", 2)[2] and "write" not in out
    assert "(0.50% off: met)" in out
    bench.print_goals([r for r in rows if r.get("tokens") in (None, 64)], 4250.0)  # no goal at T = 64
    assert "no speed goal checked" in capsys.readouterr().out
    bench.print_goals(rows[:1] + [row("planes x4 e8m0 tier10%", 8, 1.8, 0.6), rows[5]], 4250.0)
    assert "missed" not in (out := capsys.readouterr().out) and "every speed goal met (2 form" in out


def test_bench_moe_prefill_goal_at_both_chunks_names_hummings_glue(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """The prefill goal is read at T = 2048 (the v4-flash-96g preset's chunk) and at 4096, and the table
    says which glue Humming ran with (vLLM's, where vLLM imports)."""
    bench = _bench_moe(monkeypatch)
    rows = [{"what": "humming_glue", "glue": "vLLM's glue"}]
    for T, x in ((2048, 1 / 1.31), (4096, 1 / 1.2)):
        rows.append({"what": "speed", "harness": "write", "name": "planes x4 e8m0 tier10%", "tokens": T,
                     "speedup_vs_humming": x, "copy_frac": 0.9, "form": "x4 e8m0 tier10%"})
    bench.print_goals(rows, 4250.0)
    out = capsys.readouterr().out
    assert "prefill T = 2048 and 4096 <= 1.25x Humming's time; Humming with vLLM's glue" in out
    assert "missed (write speed): 1: x4 e8m0 tier10% T=2048" in out


def test_bench_moe_humming_glues(monkeypatch: pytest.MonkeyPatch) -> None:
    """Humming's glue: vLLM's own first (the baseline row, named plainly) where vLLM imports, torch's as a
    labelled second line; alone, torch's is the baseline. Both compute the SwiGLU and the weighted top-k sum
    (vLLM's silu_and_mul op on the CPU here; its moe_fused_mul_sum is a Triton kernel, GPU only)."""
    bench = _bench_moe(monkeypatch)
    g = torch.Generator().manual_seed(3)
    gate_up = torch.randn((5, 128), generator=g)
    plain = torch.nn.functional.silu(gate_up[:, :64]) * gate_up[:, 64:]
    torch_glue = bench.torch_glue()
    act = torch.empty((5, 64))
    torch_glue.swiglu(gate_up, act)
    assert torch.equal(act, plain)
    down = torch.randn((3, 4, 16), generator=g).to(torch.bfloat16)
    w = torch.rand((3, 4), generator=g)
    want = sum(down[:, k].float() * w[:, k:k + 1] for k in range(4)).to(torch.bfloat16)
    got = torch_glue.weighted_sum(down, w, torch.zeros((3, 4), dtype=torch.int32), torch.empty((3, 16)))
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    vllm_glue = bench.vllm_glue()
    if vllm_glue is not None:  # the vLLM CPU build of the test environment
        act = torch.empty((5, 64))
        vllm_glue.swiglu(gate_up, act)
        torch.testing.assert_close(act, plain, rtol=1e-5, atol=1e-5)
        glues = bench.humming_glues()
        assert [x.name for x in glues] == ["vLLM's glue", "torch glue"]
        assert bench.humming_row("humming mxfp4", glues[0], glues) == "humming mxfp4"
        assert bench.humming_row("humming mxfp4", glues[1], glues) == "humming mxfp4, torch glue"
    monkeypatch.setattr(bench, "vllm_glue", lambda: None)
    glues = bench.humming_glues()
    assert [x.name for x in glues] == ["torch glue"]
    assert bench.humming_row("humming nvfp4", glues[0], glues) == "humming nvfp4"
