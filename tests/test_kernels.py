"""split_and_measure (the one-pass C kernel, moet_cache.codec._kernels, or its numpy fallback) against the
plain references: planes, histogram and table exactly; error and energy to rel 1e-9."""

from __future__ import annotations

import functools
import importlib.util
import os
import threading

import numpy as np
import pytest

from moet_cache.codec import planes as P
from moet_cache.format.fp4 import E2M1_VALUES, unpack_codes

HAVE_C = importlib.util.find_spec("moet_cache.codec._kernels") is not None

# (rows, packed bytes per row): odd sizes, one row, one block, many blocks
SHAPES = [(1, 8), (1, 24), (3, 8), (5, 40), (7, 56), (2, 1000), (64, 512), (33, 1784), (1, 8 * 4099)]


def _exact_sums(packed: np.ndarray, scales: np.ndarray, table: np.ndarray) -> tuple[float, float]:
    """Error and energy element by element in float64 (no float32 intermediate anywhere)."""
    c = unpack_codes(packed).astype(np.intp)
    v = E2M1_VALUES.astype(np.float64)[c]
    t = table.astype(np.float64)[c >> 2]
    s = np.repeat(scales.astype(np.float64), 16, axis=1)
    return float((((v - t) * s) ** 2).sum()), float(((v * s) ** 2).sum())


def _inputs(rows: int, cols: int, kind: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if kind == "random":
        packed = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    elif kind == "zeros":
        packed = np.zeros((rows, cols), dtype=np.uint8)
    elif kind == "fifteens":
        packed = np.full((rows, cols), 0xFF, dtype=np.uint8)
    else:  # "skewed": mostly small magnitudes, like real weights
        codes = rng.choice(16, size=(rows, 2 * cols), p=np.array(
            [8, 10, 6, 3, 1, .5, .2, .1, 2, 10, 6, 3, 1, .5, .2, .1]) / 51.6)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scales = (rng.random((rows, cols // 8)) * 4 + rng.random((rows, cols // 8)) * 1e-3).astype(np.float32)
    return packed, scales


def _check(fn, packed: np.ndarray, scales: np.ndarray, err_rel: float = 1e-9) -> None:
    base, delta, table, err, energy = fn(packed, scales)
    rbase, rdelta = P.split_planes_reference(packed)
    rtable = P.fit_table(P.code_histogram_reference(packed))
    assert base.dtype == delta.dtype == np.uint8 and base.shape == rbase.shape
    assert np.array_equal(base, rbase) and np.array_equal(delta, rdelta)
    assert table.dtype == rtable.dtype and np.array_equal(table, rtable)
    rerr, renergy = P.error_and_energy_reference(packed, scales, rtable)
    xerr, xenergy = _exact_sums(packed, scales, rtable)
    # energy: the reference's float32 per-code terms (v^2) are exact, so it must agree to 1e-9
    assert energy == pytest.approx(renergy, rel=1e-9, abs=1e-12)
    assert energy == pytest.approx(xenergy, rel=1e-9, abs=1e-12)
    # error: the reference rounds (v - t)^2 and its four-code word sums to float32 (~1e-8 relative),
    # so 1e-9 is held against the float64 element-by-element sum and 1e-6 against the reference
    assert err == pytest.approx(xerr, rel=err_rel, abs=1e-12)
    assert err == pytest.approx(rerr, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("kind", ["random", "skewed", "zeros", "fifteens"])
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_split_and_measure_matches_references(rows: int, cols: int, kind: str) -> None:
    packed, scales = _inputs(rows, cols, kind, seed=rows * 7919 + cols)
    _check(P.split_and_measure, packed, scales, err_rel=1e-9 if P.KERNEL == "c" else 1e-6)


@pytest.mark.parametrize("kind", ["random", "skewed", "zeros", "fifteens"])
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_numpy_fallback_matches_references(rows: int, cols: int, kind: str) -> None:
    packed, scales = _inputs(rows, cols, kind, seed=rows * 7919 + cols + 1)
    # the numpy error_and_energy sums float32 word terms: ~1e-8 relative, as tests/test_planes_fast.py allows
    _check(P.split_and_measure_numpy, packed, scales, err_rel=1e-6)


def test_fallback_when_the_extension_is_absent() -> None:
    packed, scales = _inputs(9, 96, "random", seed=5)
    want = P.split_and_measure(packed, scales)
    numpy_only = functools.partial(P.split_and_measure, kernel=P.HostKernel.NUMPY)
    got = numpy_only(packed, scales)
    _check(numpy_only, packed, scales, err_rel=1e-6)  # the numpy path
    for a, b in zip(want[:3], got[:3]):
        assert np.array_equal(a, b)
    assert got[3] == pytest.approx(want[3], rel=1e-6) and got[4] == pytest.approx(want[4], rel=1e-9)


def test_which_path_is_active() -> None:
    """KERNEL names the path. CI (CI=true: .ci/run's machines have a C compiler) or
    MOET_CACHE_REQUIRE_KERNELS=1 demands the C kernels, so a silent build failure of the optional
    extension fails the run."""
    assert P.KERNEL == ("c" if HAVE_C else "numpy")
    assert (P._kernels is not None) == HAVE_C
    if os.environ.get("MOET_CACHE_REQUIRE_KERNELS") == "1" or os.environ.get("CI") == "true":
        assert P.KERNEL == "c", "moet_cache.codec._kernels was not built (no C compiler at install time?)"


def test_shapes_the_kernel_does_not_take_fall_back() -> None:
    # a non-contiguous view and float64 scales still go through (copied); planes must match exactly
    packed, scales = _inputs(6, 64, "random", seed=11)
    view = packed[::2]
    _check(P.split_and_measure, view, scales[::2])
    base, delta, table, err, energy = P.split_and_measure(packed, scales.astype(np.float64))
    assert np.array_equal(base, P.split_planes_reference(packed)[0])


@pytest.mark.skipif(not HAVE_C, reason="the C extension is not built")
def test_kernel_argument_checks() -> None:
    from moet_cache.codec import _kernels
    packed, scales = _inputs(2, 16, "random", seed=3)
    base = np.empty((2, 8), np.uint8)
    delta = np.empty_like(base)
    counts, weighted = _kernels.split_measure(packed, scales, base, delta)
    assert sum(counts) == packed.size * 2 and len(weighted) == 16
    with pytest.raises(TypeError):
        _kernels.split_measure(packed, scales.astype(np.float64), base, delta)
    with pytest.raises(ValueError):
        _kernels.split_measure(packed, scales[:1], base, delta)
    with pytest.raises(ValueError):
        _kernels.split_measure(packed, scales, base[:1], delta)
    with pytest.raises(ValueError):
        _kernels.split_measure(np.ascontiguousarray(packed[:, :12]), scales, base, delta)
    with pytest.raises(TypeError):  # not contiguous
        _kernels.split_measure(packed[:, :8], scales[:, :1].copy(), base[:, :4].copy(), delta[:, :4].copy())
    with pytest.raises(TypeError):  # read-only output
        ro = np.empty_like(base)
        ro.setflags(write=False)
        _kernels.split_measure(packed, scales, ro, delta)


@pytest.mark.skipif(not HAVE_C, reason="the C extension is not built")
def test_kernel_from_threads_is_exact() -> None:
    # the loop runs without the GIL: concurrent calls must not share any state
    packed, scales = _inputs(256, 1024, "skewed", seed=17)
    want = P.split_and_measure(packed, scales)
    got: list = [None] * 4

    def work(i: int) -> None:
        got[i] = P.split_and_measure(packed, scales)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g in got:
        assert all(np.array_equal(a, b) for a, b in zip(g[:3], want[:3])) and g[3:] == want[3:]


def _e4m3_inputs(rows: int, cols: int, kind: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    packed, _ = _inputs(rows, cols, kind, seed)
    rng = np.random.default_rng(seed + 1)
    scale_bytes = rng.integers(0, 0x7F, (rows, cols // 8), dtype=np.uint8)  # finite, either sign bit
    scale_bytes |= (rng.random(scale_bytes.shape) < 0.3).astype(np.uint8) << 7
    return packed, scale_bytes


def test_e4m3_value_table_is_torchs() -> None:
    torch = pytest.importorskip("torch")
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(P.E4M3_VALUES, want, equal_nan=True)
    assert np.array_equal(P.E4M3_VALUES.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])


@pytest.mark.parametrize("kind", ["random", "skewed", "zeros", "fifteens"])
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_split_and_measure_e4m3_matches_references(rows: int, cols: int, kind: str) -> None:
    # the raw-scale-byte kernel against the float32-scale kernel and the plain references
    packed, scale_bytes = _e4m3_inputs(rows, cols, kind, seed=rows * 31 + cols)
    scales = P.E4M3_VALUES[scale_bytes]
    _check(lambda p, _s: P.split_and_measure_e4m3(p, scale_bytes), packed, scales,
           err_rel=1e-9 if P.KERNEL == "c" else 1e-6)
    got, want = P.split_and_measure_e4m3(packed, scale_bytes), P.split_and_measure(packed, scales)
    assert all(np.array_equal(a, b) for a, b in zip(got[:3], want[:3]))
    assert got[3] == pytest.approx(want[3], rel=1e-12, abs=1e-300)
    assert got[4] == pytest.approx(want[4], rel=1e-12, abs=1e-300)


def test_e4m3_nan_scale_poisons_the_sums_like_float32() -> None:
    packed, scale_bytes = _e4m3_inputs(4, 64, "random", seed=3)
    scale_bytes[2, 3] = 0x7F  # NaN
    for path in P.HostKernel:
        base, _, _, err, energy = P.split_and_measure_e4m3(packed, scale_bytes, kernel=path)
        assert np.isnan(err) and np.isnan(energy)
        assert np.array_equal(base, P.split_planes_reference(packed)[0])


def test_e4m3_fallback_when_the_extension_is_absent() -> None:
    packed, scale_bytes = _e4m3_inputs(9, 96, "skewed", seed=5)
    want = P.split_and_measure_e4m3(packed, scale_bytes)
    got = P.split_and_measure_e4m3(packed, scale_bytes, kernel=P.HostKernel.NUMPY)
    assert all(np.array_equal(a, b) for a, b in zip(got[:3], want[:3]))
    assert got[3] == pytest.approx(want[3], rel=1e-6) and got[4] == pytest.approx(want[4], rel=1e-9)


@pytest.mark.skipif(not HAVE_C, reason="the C extension is not built")
def test_e4m3_kernel_argument_checks() -> None:
    from moet_cache.codec import _kernels
    packed, scale_bytes = _e4m3_inputs(2, 16, "random", seed=3)
    base = np.empty((2, 8), np.uint8)
    delta = np.empty_like(base)
    counts, weighted = _kernels.split_measure_e4m3(packed, scale_bytes, base, delta)
    assert sum(counts) == packed.size * 2 and len(weighted) == 16
    with pytest.raises(ValueError):
        _kernels.split_measure_e4m3(packed, scale_bytes[:1], base, delta)
    with pytest.raises(ValueError):
        _kernels.split_measure_e4m3(packed, scale_bytes, base[:1], delta)
    with pytest.raises(TypeError):  # read-only output
        ro = np.empty_like(base)
        ro.setflags(write=False)
        _kernels.split_measure_e4m3(packed, scale_bytes, ro, delta)
