import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from moet_cache.format.fp4 import E2M1_VALUES, pack_codes, quantize_to_codes, unpack_codes
from moet_cache.enums import BaseTable
from moet_cache.codec.planes import (DEFAULT_TABLE, E4M3_VALUES, X4_PATTERN, HostKernel, base_values, code_histogram,
                               error_and_energy, fit_base_table, fit_table, fit_table_x4, fit_table_x4_reference,
                               has_x4_form, join_planes, nearest_code_for_table, split_and_measure_e4m3,
                               split_planes, split_planes_reference)

packed_arrays = st.integers(1, 6).flatmap(
    lambda rows: st.integers(1, 8).flatmap(
        lambda words: arrays(np.uint8, (rows, 8 * words))))


@settings(max_examples=200, deadline=None)
@given(packed_arrays)
def test_fast_split_matches_reference_and_joins_back(packed: np.ndarray) -> None:
    base, delta = split_planes(packed)
    rbase, rdelta = split_planes_reference(packed)
    assert np.array_equal(base, rbase) and np.array_equal(delta, rdelta)
    assert np.array_equal(join_planes(base, delta), packed)


def test_bit_order_is_documented_order() -> None:
    # codes 0..3 of a row: 0b1011, 0b0110, 0b1100, 0b0001 -> base 10, 01, 11, 00; delta 11, 10, 00, 01
    codes = np.array([[0b1011, 0b0110, 0b1100, 0b0001]], dtype=np.uint8)
    base, delta = split_planes(pack_codes(codes))
    assert base[0, 0] == 0b10 | (0b01 << 2) | (0b11 << 4) | (0b00 << 6)
    assert delta[0, 0] == 0b11 | (0b10 << 2) | (0b00 << 4) | (0b01 << 6)


def test_pack_even_index_low_nibble() -> None:
    codes = np.array([[1, 2, 15, 0]], dtype=np.uint8)
    assert pack_codes(codes).tolist() == [[0x21, 0x0F]]
    assert np.array_equal(unpack_codes(pack_codes(codes)), codes)


def test_histogram_and_table() -> None:
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (32, 64), dtype=np.uint8)
    hist = code_histogram(pack_codes(codes))
    assert hist.tolist() == np.bincount(codes.ravel(), minlength=16).tolist()
    table = fit_table(hist)
    for b in range(4):
        sel = (codes >> 2) == b
        assert table[b] == pytest.approx(E2M1_VALUES[codes[sel]].mean(), rel=1e-6)


def test_table_of_absent_code_is_the_plain_mean() -> None:
    hist = np.zeros(16, dtype=np.int64)
    hist[5] = 10  # only base code 1 occurs
    table = fit_table(hist)
    assert table[1] == 3.0
    assert table[0] == DEFAULT_TABLE[0] and table[3] == DEFAULT_TABLE[3]


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_error_and_energy_match_dense_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, n = int(rng.integers(1, 5)), 16 * int(rng.integers(1, 5))
    codes = rng.integers(0, 16, (rows, n), dtype=np.uint8)
    packed = pack_codes(codes)
    scales = rng.uniform(0.1, 4.0, (rows, n // 16)).astype(np.float32)
    table = fit_table(code_histogram(packed))
    err, energy = error_and_energy(packed, scales, table)
    s = np.repeat(scales.astype(np.float64), 16, axis=1)
    w = E2M1_VALUES[codes].astype(np.float64) * s
    wb = base_values(split_planes(packed)[0], table).astype(np.float64) * s
    assert err == pytest.approx(((w - wb) ** 2).sum(), rel=1e-5)
    assert energy == pytest.approx((w**2).sum(), rel=1e-5)


def test_nearest_code_for_table_stays_in_group() -> None:
    table = np.array([0.74, 3.6, -0.2, -5.9], dtype=np.float32)
    codes = nearest_code_for_table(table)
    assert codes.tolist() == [1, 4 + 2, 8 + 0, 12 + 3]  # 0.5, 4, -0 (nearest -0.2), -6
    assert all(c >> 2 == b for b, c in enumerate(codes))


def test_quantize_to_codes_round_trips_values() -> None:
    assert np.array_equal(quantize_to_codes(E2M1_VALUES[[1, 2, 3, 4, 5, 6, 7, 9, 15]]),
                          np.array([1, 2, 3, 4, 5, 6, 7, 9, 15], dtype=np.uint8))


def _x4_objective(hist: np.ndarray, a: np.ndarray) -> np.ndarray:
    """sum_c count[c] * (v_c - a * X4_PATTERN[c >> 2])^2 for each a (float64)."""
    p = np.repeat(X4_PATTERN.astype(np.float64), 4)
    return ((E2M1_VALUES.astype(np.float64)[None, :] - a[:, None] * p[None, :]) ** 2) @ hist.astype(np.float64)


@settings(max_examples=200, deadline=None)
@given(arrays(np.int64, 16, elements=st.integers(0, 10**9)))
def test_x4_table_has_the_exact_form_and_matches_its_reference(hist: np.ndarray) -> None:
    table = fit_table_x4(hist)
    # what the runtime checks before it decodes a layer by bit arithmetic: bit for bit, a > 0
    assert table.dtype == np.float32 and table[0] > 0 and np.isfinite(table).all()
    assert np.array_equal(table, table[0] * X4_PATTERN) and has_x4_form(table)
    assert np.allclose(table, fit_table_x4_reference(hist), rtol=1e-6, atol=0)
    assert np.array_equal(fit_base_table(hist, BaseTable.X4), table)
    assert np.array_equal(fit_base_table(hist, "fitted"), fit_table(hist))


@settings(max_examples=50, deadline=None)
@given(arrays(np.int64, 16, elements=st.integers(0, 10**6)))
def test_x4_table_is_the_least_squares_minimum(hist: np.ndarray) -> None:
    if hist[[0, 8]].sum() == hist.sum():  # nothing to fit (no codes, or only +-0): the uniform a (its own test)
        return
    a = float(fit_table_x4(hist)[0])
    grid = np.linspace(0.01, 6.0, 6000)  # a's best is a weighted mean of v / p: within [0, 1.5]
    best = _x4_objective(hist, grid).min()
    got = _x4_objective(hist, np.array([a]))[0]
    assert got <= best * (1 + 1e-6) + 1e-9
    near = _x4_objective(hist, np.array([a * (1 - 1e-3), a * (1 + 1e-3)]))  # a is the stationary point
    assert (near >= got * (1 - 1e-9)).all()


def test_x4_table_of_nothing_to_fit_is_the_uniform_one() -> None:
    uniform = fit_table_x4(np.ones(16, dtype=np.int64))
    assert float(uniform[0]) == pytest.approx(126 / 136)
    only_zeros = np.zeros(16, dtype=np.int64)
    only_zeros[[0, 8]] = 7  # +0 and -0: every a > 0 is as bad as another, and the runtime needs a > 0
    for hist in (np.zeros(16, dtype=np.int64), only_zeros):
        assert np.array_equal(fit_table_x4(hist), uniform) and np.array_equal(fit_table_x4_reference(hist), uniform)


def test_has_x4_form_refuses_other_tables() -> None:
    t = fit_table_x4(np.arange(16, dtype=np.int64))
    assert has_x4_form(t) and has_x4_form(np.stack([t, 2 * t]).reshape(2, 1, 4))
    assert not has_x4_form(fit_table(np.arange(16, dtype=np.int64)))
    assert not has_x4_form(-t) and not has_x4_form(0 * t) and not has_x4_form(t.astype(np.float64))
    bumped = t.copy()
    bumped[1] = np.nextafter(bumped[1], np.float32(np.inf))  # one ulp off in one entry
    assert not has_x4_form(bumped) and not has_x4_form(np.stack([t, bumped]))


@pytest.mark.parametrize("form", ["fitted", "x4"])
def test_split_and_measure_fits_and_measures_in_the_form(form: str) -> None:
    rng = np.random.default_rng(3)
    packed = pack_codes(rng.integers(0, 16, (8, 64), dtype=np.uint8))
    scale_bytes = rng.integers(0x30, 0x48, (8, 4), dtype=np.uint8)  # e4m3 bytes, finite and positive
    want = fit_base_table(code_histogram(packed), form)
    want_err = error_and_energy(packed, E4M3_VALUES[scale_bytes], want)
    for kernel in HostKernel:
        _, _, table, er, eg = split_and_measure_e4m3(packed, scale_bytes, kernel=kernel, form=form)
        assert np.array_equal(table, want)
        assert (er, eg) == pytest.approx(want_err, rel=1e-5)
