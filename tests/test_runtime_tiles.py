"""The plane kernels' tiles (moet_cache/runtime/tiles.py) and the load-time layout a layer takes
(runtime/layout.py): every layer the kernels take is tiled, an x4 one also repacked; on the CPU. The
kernels on tiled fitted-table layers run in tests/test_runtime_gpu.py."""

from __future__ import annotations

import pytest
import torch

from moet_cache.codec.planes import X4_PATTERN
from moet_cache.runtime import fused_moe, layout
from moet_cache.runtime.dequant import LayerPlanes, dequant_expert
from moet_cache.runtime.plane_layout import NATURAL, TILED, X4, to_layout
from moet_cache.runtime.synthetic_layer import random_layer
from moet_cache.runtime.tiles import CHUNK_CODES, TILE_ROWS, tile, tiles_fit

TILED_NAMES, X4_NAMES = TILED.names, X4.names

E, H, I = 8, 512, 256  # the smallest dims whose planes split into tiles: K in whole chunks


@pytest.fixture(params=["e8m0", "e4m3"])
def layer(request: pytest.FixtureRequest) -> dict[str, torch.Tensor]:
    """A fitted-table layer (random tables, no x4 form) with a tier of 3."""
    return random_layer(E, H, I, n_tier=3, e8m0=request.param == "e8m0", device="cpu", seed=4)


@pytest.mark.parametrize("dtype,chunk_bytes", [(torch.uint8, 64), (torch.float8_e8m0fnu, 8),
                                               (torch.float8_e4m3fn, 16)])
def test_tile_puts_each_chunk_of_a_tiles_rows_together(dtype: torch.dtype, chunk_bytes: int) -> None:
    """tiles.tile, element by element against its definition: byte b of chunk c of row i of tile k sits
    at [chunk][row][byte] within the tile (mma_bits.cu tiled_at reads it there); planes take 64 bytes a
    chunk (256 codes), e8m0 scales 8 (a byte per 32 codes), e4m3 scales 16."""
    n, rows, chunks = 2, 2 * TILE_ROWS, 3
    assert chunk_bytes * {torch.uint8: 4, torch.float8_e8m0fnu: 32, torch.float8_e4m3fn: 16}[dtype] == CHUNK_CODES
    src = torch.randint(0, 256, (n, rows, chunks * chunk_bytes), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(3))
    got = tile(src.view(dtype))
    assert got.dtype == dtype and got.shape == src.shape
    flat = got.view(torch.uint8).reshape(n, -1)
    for e in range(n):
        for row in range(rows):
            k, i = divmod(row, TILE_ROWS)
            for c in range(chunks):
                for b in range(chunk_bytes):
                    at = k * TILE_ROWS * chunks * chunk_bytes + (c * TILE_ROWS + i) * chunk_bytes + b
                    assert flat[e, at] == src[e, row, c * chunk_bytes + b]
    assert torch.equal(tile(got, inverse=True).view(torch.uint8), src)
    with pytest.raises(ValueError, match="tiles"):
        tile(src[:, :TILE_ROWS - 1].view(dtype))


def test_tile_is_always_a_copy() -> None:
    """Where a row is one chunk the tiles are the rows themselves: tile still hands back a copy, so that
    moving bits in it (plane_layout.to_natural) leaves the layer's planes as they are."""
    src = torch.randint(0, 256, (2, TILE_ROWS, CHUNK_CODES // 4), dtype=torch.uint8)
    for inverse in (False, True):
        out = tile(src, inverse)
        assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()


def test_a_fitted_layer_is_tiled_and_an_x4_one_repacked(layer: dict) -> None:
    """layout.prepare: a fitted-table layer's planes and scales tiled under TILED_NAMES, the tier experts'
    base rows and the delta planes with their bits moved as an x4 layer's (x4_table.relayout_rows_), the other
    experts' bits as loaded; the same layer with x4 tables repacked under X4_NAMES; LayerPlanes reads which,
    and puts either back."""
    tiled = layout.prepare(layer)
    assert set(tiled) == (set(layer) - set(TILED_NAMES)) | set(TILED_NAMES.values())
    tier = set(layer["delta_experts"].tolist())
    for natural, name in TILED_NAMES.items():
        got, src = tiled[name], layer[natural]
        assert got.dtype == src.dtype and got.shape == src.shape
        for row in range(src.shape[0]):
            moved = src.dtype == torch.uint8 and (natural.endswith("_delta") or row in tier)
            want = to_layout(src[row : row + 1], [0] if moved else [], natural.endswith("_delta"))
            assert torch.equal(got[row : row + 1].view(torch.uint8), want.view(torch.uint8)), (name, row)
        if natural.startswith("w13"):  # K = H, two chunks (w2's one chunk a row tiles onto itself)
            assert not torch.equal(got.view(torch.uint8), src.view(torch.uint8))
    planes = LayerPlanes.from_tensors(tiled)
    assert planes.layout == TILED
    natural = planes.natural()
    assert natural.layout == NATURAL
    for name, loaded in (("w13_base", "w13_base"), ("w2_base", "w2_base"), ("w13_delta", "w13_delta"),
                         ("w2_delta", "w2_delta"), ("w13_scale", "w13_weight_scale"), ("w2_scale", "w2_weight_scale")):
        assert torch.equal(getattr(natural, name).view(torch.uint8), layer[loaded].view(torch.uint8))
    flat = LayerPlanes.from_tensors(layer)
    tier = int(layer["delta_experts"][1])
    for expert, row in ((0 if tier else 1, None), (tier, 1)):  # a base expert, a tier one
        for got, want in zip(dequant_expert(planes, expert, row), dequant_expert(flat, expert, row)):
            assert torch.equal(got, want)
    pattern = torch.as_tensor(X4_PATTERN)
    x4 = layout.prepare(dict(layer, w13_table=layer["w13_table"][..., :1].abs() * pattern,
                             w2_table=layer["w2_table"][..., :1].abs() * pattern))
    assert set(X4_NAMES.values()) <= set(x4) and not set(TILED_NAMES.values()) & set(x4)
    x4_planes = LayerPlanes.from_tensors(x4)
    assert x4_planes.layout == X4
    # planes that do not split into tiles (K under 256) stay as they are
    small = random_layer(E, 128, 128, n_tier=0, e8m0=True, device="cpu", seed=4)
    assert not tiles_fit(small) and layout.prepare(small) is small


@pytest.mark.parametrize("x4", [False, True])
def test_a_laid_out_layer_computes_the_same_on_the_reference(layer: dict, x4: bool) -> None:
    """The CPU reference on a layer in either layout (it puts each routed expert back) gives the bits it
    gives on the layer as loaded, a tier expert routed."""
    if x4:
        pattern = torch.as_tensor(X4_PATTERN)
        layer = dict(layer, w13_table=layer["w13_table"][..., :1].abs() * pattern,
                     w2_table=layer["w2_table"][..., :1].abs() * pattern)
    prepared = layout.prepare(layer)
    assert ("w13_base_x4" if x4 else "w13_base_tiled") in prepared
    g = torch.Generator().manual_seed(2)
    T = 9
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(T)])
    ids[0, 0] = int(layer["delta_experts"][0])  # a tier expert routed
    w = torch.rand((T, 3), generator=g)
    assert torch.equal(fused_moe(x, prepared, w, ids, swiglu_limit=7.0), fused_moe(x, layer, w, ids, swiglu_limit=7.0))


def test_prepare_in_place_only_where_the_kernels_run(layer: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU (no plane kernels) the vLLM method's layout step leaves the planes as loaded; where the
    kernels take the layer it tiles them once and returns the names to hand them on under (a second
    call, on those names, moves nothing). A layer loaded with delta="none" has its base planes tiled."""
    before = {n: layer[n].clone() for n in TILED_NAMES}
    assert not layout.kernels_take(layer) and layout.prepare_in_place(layer) == {}
    assert all(torch.equal(layer[n], before[n]) for n in TILED_NAMES)
    monkeypatch.setattr(layout, "kernels_take", lambda tensors: True)
    base_only = {k: v.clone() for k, v in layer.items() if k not in ("w13_delta", "w2_delta", "delta_experts")}
    assert layout.prepare_in_place(layer) == TILED_NAMES
    want = layout.prepare(before | {k: v for k, v in layer.items() if k not in TILED_NAMES})
    for natural, name in TILED_NAMES.items():
        assert torch.equal(layer[natural].view(torch.uint8), want[name].view(torch.uint8))
    renamed = {TILED_NAMES.get(k, k): v for k, v in layer.items()}
    assert layout.prepare_in_place(renamed) == {}
    assert layout.prepare_in_place(base_only) == TILED_NAMES
    assert LayerPlanes.from_tensors({TILED_NAMES.get(k, k): v for k, v in base_only.items()}).delta_experts.numel() == 0
