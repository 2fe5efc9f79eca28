"""dequant_expert and fused_moe_reference (the CPU reference every kernel is checked against) give the plain
definitions' bits (tests/plain_dequant.py: each code unpacked, looked up and scaled on its own) on every layer
form: fitted and x4 tables, e4m3 and e8m0 block scales with their edge bytes, base, tier and mid-tier experts,
the natural, tiled and x4 layouts; float32 bit patterns compared, so -0.0, inf and NaN count. On the CPU, and on
CUDA where there is one (the GPU tests' reference runs there from 64 tokens)."""

from __future__ import annotations

import pytest
import torch

from moet_cache.codec.planes import X4_PATTERN
from moet_cache.errors import InputError
from moet_cache.runtime.dequant import LayerPlanes, dequant_expert
from moet_cache.runtime.layout import prepare
from moet_cache.runtime.plane_layout import NATURAL, TILED, X4
from moet_cache.runtime.reference import fused_moe_reference
from moet_cache.runtime.synthetic_layer import random_layer

from plain_dequant import plain_dequant_expert, plain_fused_moe_reference

E, H, I = 12, 512, 256  # K in whole chunks of 256 codes: the tiled layouts apply
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NO_CUDA])]

#: block-scale bytes at the forms' edges, written over expert 0's first groups: e4m3 zero, a subnormal, the
#: largest finite, NaN, -0 and -NaN; e8m0 2^-127, 2^127 (whose product with a code overflows float32 before
#: scale_2 brings it back: the order of the products shows) and NaN
EDGE_BYTES = {"e4m3": (0x00, 0x01, 0x7E, 0x7F, 0x80, 0xFF), "e8m0": (0x00, 0xFE, 0xFF)}


def _layer(scales: str, tables: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A layer with 3 tier experts and 3 mid-tier ones, x4 tables (a * (1, 4, -1, -4)) or fitted ones."""
    t = random_layer(E, H, I, n_tier=3, e8m0=scales == "e8m0", device=device, seed=5, n_mid=3)
    if tables == "x4":
        pattern = torch.as_tensor(X4_PATTERN, device=device)
        t["w13_table"] = t["w13_table"][..., :1].abs() * pattern
        t["w2_table"] = t["w2_table"][..., :1].abs() * pattern
    return t


def _with_edge_bytes(t: dict[str, torch.Tensor], scales: str) -> dict[str, torch.Tensor]:
    """t with expert 0's and the first tier and mid experts' first block scales set to EDGE_BYTES."""
    t = dict(t)
    edges = torch.tensor(EDGE_BYTES[scales], dtype=torch.uint8, device=t["w13_base"].device)
    for name in ("w13_weight_scale", "w2_weight_scale"):
        raw = t[name].view(torch.uint8).clone()
        for e in (0, int(t["delta_experts"][0]), int(t["mid_experts"][0])):
            raw[e, : edges.numel(), 0] = edges
            raw[e, 0, : edges.numel()] = edges
        t[name] = raw.view(t[name].dtype)
    return t


def _bits(w: torch.Tensor) -> torch.Tensor:
    return w.contiguous().view(torch.int32)


def _every_expert(planes: LayerPlanes) -> list[tuple[int, int | None]]:
    """(expert, tier row) for each expert, and each tier expert also without its tier row (its base)."""
    rows = planes.tier_rows()
    return [(e, rows.get(e)) for e in range(E)] + [(e, None) for e in rows]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scales", ["e4m3", "e8m0"])
@pytest.mark.parametrize("tables", ["fitted", "x4"])
def test_dequant_expert_gives_the_plain_definitions_bits(scales: str, tables: str, device: str) -> None:
    """Every expert of a natural layer (base, tier, mid) with the scale forms' edge bytes, then of the same
    layer laid out as the plane kernels take it (tiled, or x4), written fresh and into reused buffers."""
    natural = _layer(scales, tables, device)
    laid_out = prepare(natural)
    forms = [(LayerPlanes.from_tensors(_with_edge_bytes(natural, scales)), NATURAL),
             (LayerPlanes.from_tensors(laid_out), X4 if tables == "x4" else TILED)]
    buffers = (torch.full((2 * I, H), float("nan"), device=device), torch.full((H, I), float("nan"), device=device))
    for planes, layout in forms:
        assert planes.layout == layout and planes.has_mid
        seen = {"tier": 0, "mid": 0, "base": 0}
        for expert, row in _every_expert(planes):
            want = plain_dequant_expert(planes, expert, row)
            kind = "tier" if row is not None else "mid" if expert in planes.mid.rows() else "base"
            seen[kind] += 1
            for got in (dequant_expert(planes, expert, row), dequant_expert(planes, expert, row, out=buffers)):
                assert got[0].dtype == torch.float32 and got[0].shape == (2 * I, H) and got[1].shape == (H, I)
                assert torch.equal(_bits(got[0]), _bits(want[0])), (layout, expert, row)
                assert torch.equal(_bits(got[1]), _bits(want[1])), (layout, expert, row)
            assert got[0] is buffers[0] and got[1] is buffers[1]
        assert seen == {"tier": 3, "mid": 3, "base": E - 3}
    # the edge bytes reached the weights (a NaN; an infinity from e8m0's 2^127), and a tier expert's -0.0 codes
    w13, _ = dequant_expert(forms[0][0], 0, None)
    assert w13.isnan().any() and (scales == "e4m3" or w13.isinf().any())
    tier = forms[0][0].delta_experts[0]
    assert (_bits(dequant_expert(forms[0][0], int(tier), 0)[0]) == _bits(torch.tensor(-0.0, device=device))).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_moe_reference_gives_the_plain_definitions_bits(dtype: torch.dtype, device: str) -> None:
    """The reference on weights written into one pair of buffers and rounded in place gives the bits of the
    plain one on fresh weights: base, tier and mid experts routed, one twice in a row, padding pairs (-1)."""
    t = _layer("e4m3", "fitted", device)
    planes = LayerPlanes.from_tensors(t)
    g = torch.Generator().manual_seed(9)
    T = 6
    x = torch.randn((T, H), generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(T)])
    ids[0, :2] = t["delta_experts"][:2].cpu()
    ids[1, :2] = t["mid_experts"][0].cpu()
    ids[T - 1] = -1
    w = torch.rand((T, 4), generator=g)
    x, w, ids = x.to(device), w.to(device), ids.to(device)
    for limit in (None, 7.0):
        got = fused_moe_reference(x, planes, w, ids, limit)
        want = plain_fused_moe_reference(x, planes, w, ids, limit)
        assert torch.equal(_bits(got), _bits(want))
        assert got[: T - 1].abs().sum(dim=1).min() > 0 and not got[T - 1].any()


def test_dequant_expert_refuses_buffers_of_another_shape_or_dtype() -> None:
    planes = LayerPlanes.from_tensors(_layer("e8m0", "fitted"))
    good = (torch.empty((2 * I, H)), torch.empty((H, I)))
    for out in ((torch.empty((H, I)), good[1]), (good[0], torch.empty((H, I), dtype=torch.bfloat16)),
                (torch.empty((H, 2 * I)).T, good[1])):
        with pytest.raises(InputError, match="writes into contiguous float32"):
            dequant_expert(planes, 1, None, out=out)
