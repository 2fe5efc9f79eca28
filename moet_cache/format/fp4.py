"""NVFP4 (E2M1) code maths: the value table and nibble packing (even index = low nibble); the value table of
its FP8 (E4M3) block scales."""

from __future__ import annotations

import numpy as np

#: E2M1 value of each 4-bit code: bit 3 is the sign, bits 0-2 index the magnitudes.
E2M1_VALUES = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32
)
BLOCK = 16  # elements per FP8 block scale, along the input dimension


def _e4m3_table() -> np.ndarray:
    """float32 [256]: the value of each float8_e4m3fn byte (sign, 4 exponent bits of bias 7, 3 mantissa
    bits; exponent 0 is subnormal; S.1111.111 is NaN; no infinities)."""
    v = np.arange(256)
    e, m = (v >> 3) & 15, (v & 7).astype(np.float64)
    mag = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * np.exp2(e - 7.0))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(v & 0x80, -mag, mag).astype(np.float32)


E4M3_VALUES = _e4m3_table()


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n/2] packed codes -> uint8 [..., n] codes (reference, not fast)."""
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """uint8 [..., n] codes (0..15) -> uint8 [..., n/2], the even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError("the last dimension must be even to pack FP4 codes")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def quantize_to_codes(x: np.ndarray) -> np.ndarray:
    """Nearest E2M1 code for each value of x (already divided by its scales); ties go to the even code."""
    mags = E2M1_VALUES[:8]
    a = np.minimum(np.abs(x), 6.0)
    idx = np.abs(a[..., None] - mags).argmin(axis=-1).astype(np.uint8)
    sign = (np.signbit(x) & (idx > 0)).astype(np.uint8) << 3
    return idx | sign
