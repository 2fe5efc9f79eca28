"""Pairs whose expert id is -1 (the rows vLLM pads a batch with, VLLM_MOE_SKIP_PADDING) contribute nothing:
the reference skips them; the kernels' paths get them rewritten by padding.skip_padding, run here through
Triton's interpreter (the Triton kernels themselves, on the CPU); the real rows of a padded batch equal
those of the batch without padding rows bit for bit. The plane kernels' (CUDA) side, eagerly and under
graph capture, is tests/test_runtime_gpu.py::test_padding_rows_*."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from moet_cache.errors import InputError
from moet_cache.runtime import fused_moe
from moet_cache.runtime.padding import skip_padding
from moet_cache.runtime.synthetic_layer import random_layer

from triton_interpreter import run_interpreted

E, H, I, K = 8, 64, 32, 4


def _batch(T: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((T, H), generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[0, 1] = ids[0, 0]  # a repeated expert counts twice
    return x, torch.rand((T, K), generator=g) * 1.5, ids


def _padded(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, rows: int,
            fill: float = float("nan")) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch with `rows` padding rows after it, as vLLM pads: ids -1 in every slot; their activations
    and weights whatever was in the buffers (here non-finite, the worst case)."""
    T = x.shape[0]
    xp = torch.cat([x, torch.full((rows, H), fill, dtype=x.dtype)])
    xp[T + 1:T + 2] = float("inf") if rows > 1 else xp[T + 1:T + 2]
    wp = torch.cat([w, torch.full((rows, K), float("inf"))])
    ip = torch.cat([ids, torch.full((rows, K), -1, dtype=ids.dtype)])
    return xp, wp, ip


def test_skip_padding_rewrites_only_the_padding_pairs() -> None:
    x, w, ids = _batch(5, 1)
    ids = ids.int()
    xp, wp, ip = _padded(x, w, ids, 3)
    ip[1, 2] = -1  # one -1 slot beside real ones
    keep = (xp.clone(), wp.clone(), ip.clone())
    x2, w2, i2 = skip_padding(xp, wp, ip)
    assert all(torch.equal(a, b) for a, b in zip((xp, wp, ip), keep) if a.dtype != torch.float32) \
        and torch.equal(xp.isnan(), keep[0].isnan())  # the inputs are untouched
    pad = ip < 0
    assert i2.dtype == ip.dtype and bool(((i2 >= 0) & (i2 < E)).all())
    assert torch.equal(i2[~pad], ip[~pad]) and torch.equal(i2[5:], ip[:1].expand(3, K))  # row 0's experts
    assert i2[1, 2] == ip[0, 2]
    assert torch.equal(w2[~pad], wp[~pad]) and bool((w2[pad] == 0).all())
    assert torch.equal(x2[:5], xp[:5]) and bool((x2[5:] == 0).all())  # only rows of -1 alone are zeroed


def test_skip_padding_where_row_0_is_padding_too() -> None:
    x, w, ids = _batch(2, 2)
    x2, w2, i2 = skip_padding(x, w, torch.full_like(ids, -1))
    assert bool((i2 == 0).all()) and bool((w2 == 0).all()) and bool((x2 == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_skips_padding_rows_exactly(dtype: torch.dtype) -> None:
    t = random_layer(E, H, I, n_tier=3, e8m0=False, device="cpu", seed=3)
    x, w, ids = _batch(5, 4, dtype)
    want = fused_moe(x, t, w, ids, swiglu_limit=7.0)
    xp, wp, ip = _padded(x, w, ids, 3)
    got = fused_moe(xp, t, wp, ip, swiglu_limit=7.0)
    assert torch.equal(got[:5], want) and bool((got[5:] == 0).all())
    assert want.abs().sum() > 0


def test_reference_skips_a_padding_slot_beside_real_ones() -> None:
    t = random_layer(E, H, I, n_tier=3, e8m0=True, device="cpu", seed=5)
    x, w, ids = _batch(3, 6)
    want = fused_moe(x, t, w[:, :3], ids[:, :3])
    ids[:, 3] = -1  # each row: a -1 slot beside three real ones, counted as if absent
    assert torch.equal(fused_moe(x, t, w, ids), want)
    with pytest.raises(InputError, match="outside"):
        fused_moe(x, t, w, ids - 2)  # -2 and below are not padding
    with pytest.raises(InputError, match="outside"):
        fused_moe(x, t, w, ids.clamp(min=0) + E)


CHILD = textwrap.dedent("""
    import torch
    from moet_cache.runtime.dequant import LayerPlanes
    from moet_cache.runtime.launch import Config, Grouped, Pairs, fused_moe_cuda
    from moet_cache.runtime.reference import fused_moe_reference
    from moet_cache.runtime.synthetic_layer import random_layer

    E, H, I, K = 8, 64, 32, 4
    planes = LayerPlanes.from_tensors(random_layer(E, H, I, n_tier=3, e8m0=True, device="cpu", seed=4))
    for T, pad, cfg in ((3, 2, Config.only(Pairs(16, 2, 4))),
                        (5, 3, Config.only(Grouped(16, 16, 2, 4, 2, False))),
                        (9, 9, Config.only(Grouped(16, 16, 2, 4, 2, True)))):
        g = torch.Generator().manual_seed(T + pad)
        x = torch.randn((T, H), generator=g)
        ids = torch.randint(0, E, (T, K), generator=g).int()
        w = torch.rand((T, K), generator=g)
        want = fused_moe_cuda(x, planes, w, ids, 7.0, cfg)
        xp = torch.cat([x, torch.full((pad, H), float("nan"))])
        xp[T + 1] = float("inf")
        wp = torch.cat([w, torch.full((pad, K), float("inf"))])
        ip = torch.cat([ids, torch.full((pad, K), -1, dtype=ids.dtype)])
        ip[1, 2] = -1  # a -1 slot beside real ones: as if the pair were absent, up to the sum's rounding
        got = fused_moe_cuda(xp, planes, wp, ip, 7.0, cfg)
        real = [t for t in range(T) if t != 1]
        assert torch.equal(got[real], want[real]), (T, pad, cfg)
        assert bool((got[T:] == 0).all()), (T, pad, cfg)
        ref = fused_moe_reference(x[1:2], planes, w[1:2, [0, 1, 3]], ids[1:2, [0, 1, 3]], 7.0)[0]
        assert ((got[1] - ref).norm() / ref.norm()).item() < 1e-5, (T, pad, cfg)
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_triton_paths_skip_padding_rows_in_the_interpreter() -> None:
    """The pairs kernels and both grouped kernels (align.py's sort) through fused_moe_cuda's padding step:
    real rows bit-identical to the batch without padding rows, padding rows 0 even where their activations
    and weights are non-finite. The interpreter runs in a child: TRITON_INTERPRET must be set before Triton
    is first imported."""
    run_interpreted(CHILD)
