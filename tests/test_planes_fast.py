"""The fast plane kernels (split, histogram, error/energy) against their plain references, on random inputs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays


from moet_cache.codec import planes as P
from moet_cache.format.fp4 import BLOCK

# rows x (8 * blocks) bytes: whole FP8 blocks, as every NVFP4 tensor has
blocked = st.integers(1, 5).flatmap(lambda rows: st.integers(1, 6).flatmap(
    lambda blocks: arrays(np.uint8, (rows, 8 * blocks))))


@settings(max_examples=60, deadline=None)
@given(blocked)
def test_split_matches_reference(packed: np.ndarray) -> None:
    rbase, rdelta = P.split_planes_reference(packed)
    for split in (P.split_planes, P.split_planes_numpy):  # the C kernel where built, and numpy's
        base, delta = split(packed)
        assert base.dtype == rbase.dtype == np.uint8 and base.shape == rbase.shape
        assert np.array_equal(base, rbase) and np.array_equal(delta, rdelta)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.sampled_from([2, 4, 6, 10, 14]))
def test_split_of_rows_not_a_whole_word_falls_back_exactly(rows: int, cols: int) -> None:
    packed = np.random.default_rng(rows * 100 + cols).integers(0, 256, (rows, cols), dtype=np.uint8)
    base, delta = P.split_planes(packed)
    rbase, rdelta = P.split_planes_reference(packed)
    assert np.array_equal(base, rbase) and np.array_equal(delta, rdelta)


def test_split_crosses_chunk_boundaries() -> None:
    # several chunks and a short last one: every chunk boundary must land on the right output byte
    packed = np.random.default_rng(3).integers(0, 256, (9, 40), dtype=np.uint8)
    base, delta = P.split_planes_numpy(packed, chunk_words=7)
    rbase, rdelta = P.split_planes_reference(packed)
    assert np.array_equal(base, rbase) and np.array_equal(delta, rdelta)


def test_split_of_a_non_contiguous_view() -> None:
    packed = np.random.default_rng(4).integers(0, 256, (16, 64), dtype=np.uint8)[::2, 8:40]
    assert np.array_equal(P.split_planes(packed)[0], P.split_planes_reference(packed)[0])


def test_split_without_the_extension_is_the_same() -> None:
    packed = np.random.default_rng(5).integers(0, 256, (33, 256), dtype=np.uint8)
    want = P.split_planes(packed)
    got = P.split_planes(packed, kernel=P.HostKernel.NUMPY)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_c_split_argument_checks() -> None:
    kernels = pytest.importorskip("moet_cache.codec._kernels")
    packed = np.random.default_rng(6).integers(0, 256, 64, dtype=np.uint8)
    base, delta = np.empty(32, np.uint8), np.empty(32, np.uint8)
    assert kernels.split(packed, base, delta) is None
    assert np.array_equal(base, P.split_planes_reference(packed.reshape(1, -1))[0].reshape(-1))
    with pytest.raises(ValueError):
        kernels.split(packed[:12], base[:6], delta[:6])  # not whole 8-byte blocks
    with pytest.raises(ValueError):
        kernels.split(packed, base[:8], delta)
    ro = np.empty(32, np.uint8)
    ro.setflags(write=False)
    with pytest.raises(TypeError):
        kernels.split(packed, ro, delta)


@settings(max_examples=60, deadline=None)
@given(blocked)
def test_histogram_matches_reference(packed: np.ndarray) -> None:
    want = P.code_histogram_reference(packed).tolist()
    for small in (P.SMALL_BYTES, 0):  # the small-tensor path and the 64 Ki-bin path, on the same bytes
        hist = P.code_histogram(packed, small=small)
        assert hist.dtype == np.int64
        assert hist.tolist() == want


def test_histogram_odd_byte_count_and_chunks() -> None:
    odd = np.random.default_rng(5).integers(0, 256, (3, 5), dtype=np.uint8)
    assert P.code_histogram(odd).tolist() == P.code_histogram_reference(odd).tolist()
    packed = np.random.default_rng(6).integers(0, 256, (7, 24), dtype=np.uint8)
    assert P.code_histogram(packed, small=0, chunk=5).tolist() == P.code_histogram_reference(packed).tolist()


def test_histogram_of_one_code_everywhere_is_exact() -> None:
    # a skewed tensor: all 2^17 codes are 0x7 except one; counts must be exact, not approximate
    packed = np.full((64, 1024), 0x77, dtype=np.uint8)
    packed[5, 9] = 0x7A
    hist = P.code_histogram(packed)
    assert hist[7] == 2 * packed.size - 1 and hist[0xA] == 1 and hist.sum() == 2 * packed.size


def _scales(rng: np.random.Generator, packed: np.ndarray) -> np.ndarray:
    return rng.uniform(0.01, 4.0, (packed.shape[0], packed.shape[1] * 2 // BLOCK)).astype(np.float32)


@settings(max_examples=50, deadline=None)
@given(blocked, st.integers(0, 2**32 - 1))
def test_error_and_energy_match_reference(packed: np.ndarray, seed: int) -> None:
    rng = np.random.default_rng(seed)
    scales = _scales(rng, packed)
    table = P.fit_table(P.code_histogram(packed))
    rerr, renergy = P.error_and_energy_reference(packed, scales, table)
    for small in (P.SMALL_BYTES, 0):  # the small-tensor path and the word-lookup path
        err, energy = P.error_and_energy(packed, scales, table, small=small)
        assert err == pytest.approx(rerr, rel=1e-5, abs=1e-6)
        assert energy == pytest.approx(renergy, rel=1e-5, abs=1e-6)


def test_error_with_a_foreign_table_and_chunks() -> None:
    # a table that is not the fitted one (the error must follow the table given), over several chunks
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 256, (6, 32), dtype=np.uint8)
    scales = _scales(rng, packed)
    table = np.array([0.3, 5.0, -0.9, -2.5], dtype=np.float32)
    err, energy = P.error_and_energy(packed, scales, table, small=0, chunk=12)
    rerr, renergy = P.error_and_energy_reference(packed, scales, table)
    assert err == pytest.approx(rerr, rel=1e-6) and energy == pytest.approx(renergy, rel=1e-6)
    # and a direct float64 sum from the unpacked values, independent of both lookups
    from moet_cache.format.fp4 import E2M1_VALUES, unpack_codes
    codes = unpack_codes(packed).astype(np.int64)
    v = E2M1_VALUES[codes].astype(np.float64)
    s = np.repeat(scales.astype(np.float64), BLOCK, axis=1)
    assert err == pytest.approx(float((((v - table[codes >> 2]) * s) ** 2).sum()), rel=1e-5)
    assert energy == pytest.approx(float(((v * s) ** 2).sum()), rel=1e-5)


def test_fast_kernels_on_a_real_sized_tensor() -> None:
    # one tensor the size of a small expert projection (1 MiB), several chunks of each kernel
    rng = np.random.default_rng(9)
    packed = rng.integers(0, 256, (512, 2048), dtype=np.uint8)
    scales = _scales(rng, packed)
    base, delta = P.split_planes(packed)
    assert np.array_equal(P.join_planes(base, delta), packed)
    rbase, rdelta = P.split_planes_reference(packed)
    assert np.array_equal(base, rbase) and np.array_equal(delta, rdelta)
    hist = P.code_histogram(packed)
    assert hist.tolist() == P.code_histogram_reference(packed).tolist()
    table = P.fit_table(hist)
    assert np.array_equal(table, P.fit_table(P.code_histogram_reference(packed)))
    got, want = P.error_and_energy(packed, scales, table), P.error_and_energy_reference(packed, scales, table)
    assert got == pytest.approx(want, rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(blocked)
def test_torch_split_on_the_cpu_matches_reference(packed: np.ndarray) -> None:
    torch = pytest.importorskip("torch")
    base, delta = P.split_planes_torch(torch.from_numpy(packed))
    rbase, rdelta = P.split_planes_reference(packed)
    assert np.array_equal(base.numpy(), rbase) and np.array_equal(delta.numpy(), rdelta)


@pytest.mark.gpu
def test_gpu_split_is_bit_identical_to_the_cpu_split() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(11)
    for shape in [(1, 8), (7, 24), (2048, 3584)]:
        packed = rng.integers(0, 256, shape, dtype=np.uint8)
        base, delta = P.split_planes_torch(torch.from_numpy(packed).cuda())
        cbase, cdelta = P.split_planes(packed)
        assert np.array_equal(base.cpu().numpy(), cbase) and np.array_equal(delta.cpu().numpy(), cdelta)


@settings(max_examples=60, deadline=None)
@given(blocked, st.integers(0, 2**32 - 1))
def test_torch_histogram_and_error_on_the_cpu_match_reference(packed: np.ndarray, seed: int) -> None:
    torch = pytest.importorskip("torch")
    scales = _scales(np.random.default_rng(seed), packed)
    t = torch.from_numpy(packed)
    hist = P.code_histogram_torch(t)
    assert hist.dtype == np.int64 and hist.tolist() == P.code_histogram_reference(packed).tolist()
    table = P.fit_table(hist)
    got = P.error_and_energy_torch(t, torch.from_numpy(scales), table)
    want = P.error_and_energy_reference(packed, scales, table)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9)  # the reference sums float32 per-code terms


@pytest.mark.gpu
def test_gpu_histogram_and_error_match_the_cpu() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(12)
    packed = rng.integers(0, 256, (1024, 2048), dtype=np.uint8)
    scales = _scales(rng, packed)
    t = torch.from_numpy(packed).cuda()
    hist = P.code_histogram_torch(t)
    assert hist.tolist() == P.code_histogram(packed).tolist()
    table = P.fit_table(hist)
    got = P.error_and_energy_torch(t, torch.from_numpy(scales).cuda(), table)
    assert got == pytest.approx(P.error_and_energy_reference(packed, scales, table), rel=1e-6)
