"""Base and delta planes: the split of each FP4 code into its high 2 bits (base) and low 2 bits (delta).

Bit order (the contract with the runtime, docs/FORMAT.md): a plane packs four 2-bit codes per byte,
element 4k+j in bits 2j..2j+1, so the element with the lowest index sits in the lowest bits, the
same convention as the FP4 nibbles. code = (base << 2) | delta, for each element.

The mid plane (the mid tier) packs one bit a weight, the delta's high bit (code bit 1), element 8k+j in bit j
of byte k; base and mid give the 3-bit code (code >> 1) = (base << 1) | mid, and with the delta's low bit the
FP4 code: code = (base << 2) | (mid << 1) | (delta & 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..enums import BaseTable, StrEnum
from ..format.fp4 import BLOCK, E2M1_VALUES, E4M3_VALUES, unpack_codes

if TYPE_CHECKING:
    import torch

# Base code b stands for the FP4 codes 4b..4b+3: b=0 {0,.5,1,1.5}, b=1 {2,3,4,6}, b=2 and 3 negated.
DEFAULT_TABLE = np.array(
    [E2M1_VALUES[4 * b : 4 * b + 4].mean() for b in range(4)], dtype=np.float32
)


#: The x4 base table's form: a table a * X4_PATTERN (a > 0, float32) stands for +a, +4a, -a, -4a by base
#: code, the code's two bits being the FP4 sign and high exponent bit. A layer whose tables all have this
#: form is decoded by bit arithmetic instead of a table lookup (docs/RUNTIME.md, "The x4 base table").
X4_PATTERN = np.array([1.0, 4.0, -1.0, -4.0], dtype=np.float32)


def _make_split_luts() -> tuple[np.ndarray, np.ndarray]:
    """Lookup tables over a little-endian uint16 (two packed FP4 bytes = four codes)."""
    v = np.arange(1 << 16, dtype=np.uint32)
    codes = [(v >> (4 * j)) & 0xF for j in range(4)]
    base = sum(((c >> 2) << (2 * j)) for j, c in enumerate(codes))
    delta = sum(((c & 3) << (2 * j)) for j, c in enumerate(codes))
    return base.astype(np.uint8), delta.astype(np.uint8)


def _make_join_lut() -> np.ndarray:
    """uint16 index (base byte | delta byte << 8) -> the two packed FP4 bytes as a uint16."""
    v = np.arange(1 << 16, dtype=np.uint32)
    b, d = v & 0xFF, v >> 8
    out = np.zeros(1 << 16, dtype=np.uint32)
    for j in range(4):
        code = (((b >> (2 * j)) & 3) << 2) | ((d >> (2 * j)) & 3)
        out |= code << (4 * j)
    return out.astype(np.uint16)


_BASE_LUT, _DELTA_LUT = _make_split_luts()
_JOIN_LUT = _make_join_lut()


def _as_u16(packed: np.ndarray) -> np.ndarray:
    if packed.dtype != np.uint8 or packed.shape[-1] % 2:
        raise ValueError("packed FP4 codes must be uint8 with an even last dimension")
    return np.ascontiguousarray(packed).view("<u2")


# The fast split works on uint64 words in cache-sized chunks with in-place numpy bit ops (no lookups,
# no temporaries per chunk); numpy's ufunc loops release the GIL, so threads over tensors scale.
# The chunk sizes and the small-tensor threshold below are the defaults of keyword arguments (the tests pass
# small ones to cross chunk boundaries and to take both paths on the same bytes), never patched.
CHUNK_WORDS = 1 << 15  # 256 KiB of source per chunk: the scratch words stay in L2
_M33 = np.uint64(0x3333333333333333)
_M0F = np.uint64(0x0F0F0F0F0F0F0F0F)
_S2, _S4 = np.uint64(2), np.uint64(4)


def _compact_pairs(a: np.ndarray, b: np.ndarray) -> None:
    """In each 16-bit lane of `a` (2-bit fields at bits 0, 4, 8, 12): gather them into the lane's low byte."""
    np.right_shift(a, _S2, out=b)
    np.bitwise_or(a, b, out=a)
    np.bitwise_and(a, _M0F, out=a)  # nibbles at bits 0 and 8
    np.right_shift(a, _S4, out=b)
    np.bitwise_or(a, b, out=a)      # the byte sits in bits 0-7 of each 16-bit lane


def split_planes(packed: np.ndarray, *, kernel: HostKernel | None = None) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [..., n/2] packed FP4 -> (base, delta), each uint8 [..., n/4]. `kernel`: HostKernel (default
    KERNEL, the fastest this install has)."""
    words = _as_u16(packed)
    if words.size % 4:  # rows not a whole number of uint64 words: the lookup path
        return np.take(_BASE_LUT, words), np.take(_DELTA_LUT, words)
    c = _c_kernels(kernel)
    if c is not None and hasattr(c, "split"):  # the same planes at ~3x the speed, GIL released
        base = np.empty(words.size, dtype=np.uint8)
        delta = np.empty(words.size, dtype=np.uint8)
        c.split(np.ascontiguousarray(packed).reshape(-1), base, delta)
        return base.reshape(words.shape), delta.reshape(words.shape)
    return split_planes_numpy(packed)


def split_planes_numpy(packed: np.ndarray, *, chunk_words: int = CHUNK_WORDS) -> tuple[np.ndarray, np.ndarray]:
    """split_planes in numpy alone (where moet_cache.codec._kernels is not built), whole uint64 words only, in
    chunks of `chunk_words` words."""
    words = _as_u16(packed)
    w64 = words.reshape(-1).view(np.uint64)
    base = np.empty(words.size, dtype=np.uint8)
    delta = np.empty(words.size, dtype=np.uint8)
    n = w64.size
    a = np.empty(min(n, chunk_words), dtype=np.uint64)
    b = np.empty_like(a)
    for i in range(0, n, chunk_words):
        c = w64[i : i + chunk_words]
        k = c.size
        ak, bk = a[:k], b[:k]
        # A 16-bit lane holds 4 codes; the delta bits of code j sit at 4j..4j+1, the base bits at 4j+2..4j+3.
        np.bitwise_and(c, _M33, out=ak)
        _compact_pairs(ak, bk)
        delta[4 * i : 4 * (i + k)] = ak.view(np.uint16)  # keeps the low byte of each lane
        np.right_shift(c, _S2, out=ak)
        np.bitwise_and(ak, _M33, out=ak)
        _compact_pairs(ak, bk)
        base[4 * i : 4 * (i + k)] = ak.view(np.uint16)
    return base.reshape(words.shape), delta.reshape(words.shape)


def join_planes(base: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """(base, delta) uint8 [..., n/4] -> packed FP4 uint8 [..., n/2]; the exact inverse of split_planes."""
    idx = base.astype(np.uint16) | (delta.astype(np.uint16) << 8)
    out = np.take(_JOIN_LUT, idx)
    return out.view(np.uint8).reshape(base.shape[:-1] + (base.shape[-1] * 2,))


def split_planes_reference(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The plain bit-by-bit split, kept as the reference the fast split is tested against."""
    lo, hi = packed & 0xF, packed >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (-1, 4))
    base = np.zeros(codes.shape[:-1], dtype=np.uint8)
    delta = np.zeros(codes.shape[:-1], dtype=np.uint8)
    for j in range(4):
        base |= ((codes[..., j] >> 2) << (2 * j)).astype(np.uint8)
        delta |= ((codes[..., j] & 3) << (2 * j)).astype(np.uint8)
    return base, delta


HIST_CHUNK = 1 << 16  # uint16 words per bincount call: the intp copy numpy makes stays in L2
SMALL_BYTES = 1 << 15  # below this, per-call set-up (64 Ki-entry tables) outweighs the data


def code_histogram(packed: np.ndarray, *, small: int = SMALL_BYTES, chunk: int = HIST_CHUNK) -> np.ndarray:
    """Counts of each of the 16 FP4 codes in a packed tensor (int64[16]); a tensor under `small` bytes is
    counted per byte, a larger one per uint16 word, `chunk` words per bincount call."""
    if packed.dtype != np.uint8:
        raise ValueError("packed FP4 codes must be uint8")
    flat = np.ascontiguousarray(packed).reshape(-1)
    if flat.size % 2 or flat.size < small:  # a 64 Ki-bin count costs more than a small tensor's bytes
        byte_counts = np.bincount(flat, minlength=256).reshape(16, 16)  # [high nibble, low nibble]
        return (byte_counts.sum(axis=0) + byte_counts.sum(axis=1)).astype(np.int64)
    # One count per uint16 word (four codes) halves the counting work of a per-byte bincount.
    words = flat.view("<u2")
    counts = np.zeros(1 << 16, dtype=np.int64)
    for i in range(0, words.size, chunk):
        counts += np.bincount(words[i : i + chunk], minlength=1 << 16)
    grid = counts.reshape(256, 256)  # [high byte, low byte]
    byte_counts = (grid.sum(axis=0) + grid.sum(axis=1)).reshape(16, 16)  # [high nibble, low nibble]
    return byte_counts.sum(axis=0) + byte_counts.sum(axis=1)


def code_histogram_reference(packed: np.ndarray) -> np.ndarray:
    """The plain histogram of the unpacked codes, kept as the reference for code_histogram."""
    return np.bincount(unpack_codes(packed).reshape(-1), minlength=16).astype(np.int64)


def fit_table(hist: np.ndarray) -> np.ndarray:
    """The 4-entry reconstruction table: the mean FP4 value each base code stands for.

    A base code that never occurs gets the plain mean of its four values, so the table is always finite.
    """
    counts = hist.reshape(4, 4).astype(np.float64)
    sums = (counts * E2M1_VALUES.reshape(4, 4)).sum(axis=1)
    n = counts.sum(axis=1)
    table = np.where(n > 0, sums / np.maximum(n, 1), DEFAULT_TABLE)
    return table.astype(np.float32)


# Per FP4 code c: the x4 form's pattern entry p = X4_PATTERN[c >> 2], and v * p and p^2 for the least squares.
_X4_P = np.repeat(X4_PATTERN.astype(np.float64), 4)
_X4_VP = E2M1_VALUES.astype(np.float64) * _X4_P
_X4_PP = _X4_P**2
#: a for a histogram with nothing to fit (no codes, or only +-0): the a of a uniform histogram (126/136).
X4_UNIFORM_A = float(_X4_VP.sum() / _X4_PP.sum())


def x4_table(a: float) -> np.ndarray:
    """The float32 table a * X4_PATTERN; exactly table[0] * X4_PATTERN in float32 (x1 and x4 are exact)."""
    return np.float32(a) * X4_PATTERN


def fit_table_x4(hist: np.ndarray) -> np.ndarray:
    """The x4 table a * X4_PATTERN nearest the FP4 values in least squares over the code histogram:
    a = sum(count * v * p) / sum(count * p^2), p = X4_PATTERN[c >> 2].

    Every v * p is >= 0 (sign and pattern agree), so a > 0 unless the histogram is empty or holds only
    +-0; then a is X4_UNIFORM_A (any a > 0 decodes those weights equally badly; the runtime needs a > 0).
    """
    counts = hist.reshape(16).astype(np.float64)
    num = float(counts @ _X4_VP)
    return x4_table(num / float(counts @ _X4_PP) if num > 0 else X4_UNIFORM_A)


def fit_table_x4_reference(hist: np.ndarray) -> np.ndarray:
    """fit_table_x4 written out code by code from its definition, kept as its reference."""
    num = den = 0.0
    for c in range(16):
        p = float(X4_PATTERN[c >> 2])
        num += int(hist[c]) * float(E2M1_VALUES[c]) * p
        den += int(hist[c]) * p * p
    return x4_table(num / den if num > 0 else X4_UNIFORM_A)


def fit_base_table(hist: np.ndarray, form: BaseTable | str = BaseTable.FITTED) -> np.ndarray:
    """The base table of `form` (BaseTable) for a code histogram: fit_table or fit_table_x4. Every place
    that fits or recomputes a table (the build's kernels, verify --against) goes through here."""
    return fit_table_x4(hist) if form == BaseTable.X4 else fit_table(hist)


def has_x4_form(tables: np.ndarray) -> bool:
    """Every table in float32 [..., 4] is a * X4_PATTERN, bit for bit, with a finite a > 0: the form the
    GPU runtime decodes by bit arithmetic (what a build with --base-table x4 writes)."""
    t = np.asarray(tables)
    if t.dtype != np.float32 or t.ndim < 1 or t.shape[-1] != 4 or t.size == 0:
        return False
    a = t[..., :1]
    return bool(np.all(np.isfinite(a)) and np.all(a > 0) and np.array_equal(t, a * X4_PATTERN))


def _word_sums(per_code: np.ndarray) -> np.ndarray:
    """For each uint16 word (four codes), the sum of per_code over its codes."""
    v = np.arange(1 << 16)
    return sum(per_code[(v >> (4 * j)) & 0xF] for j in range(4)).astype(np.float32)


def _word_table(per_code: np.ndarray) -> np.ndarray:
    """float64 [65536]: per_code summed over the four codes of each little-endian uint16 word."""
    per_byte = (per_code[:, None] + per_code[None, :]).reshape(256)  # index: high nibble * 16 + low
    return (per_byte[:, None] + per_byte[None, :]).reshape(1 << 16)  # index: high byte * 256 + low


ERR_CHUNK = 1 << 16  # uint16 words per chunk (16384 blocks)


def per_code(table: np.ndarray) -> np.ndarray:
    """A reconstruction table by base code (4 entries) or by 3-bit code (8 entries) -> its value for each
    of the 16 FP4 codes (code >> 2, or code >> 1)."""
    t = np.asarray(table).reshape(-1)
    if t.size not in (4, 8):
        raise ValueError("a reconstruction table has 4 entries (base code) or 8 (3-bit code)")
    return np.repeat(t, 16 // t.size)


def error_and_energy(packed: np.ndarray, block_scales: np.ndarray, table: np.ndarray, *, small: int = SMALL_BYTES,
                     chunk: int = ERR_CHUNK) -> tuple[float, float]:
    """(sum of (FP4 - table[base])^2 * s^2, sum of FP4^2 * s^2) over a tensor, before the global scale.
    `table`: 4 entries by base code, or 8 by 3-bit code (the mid tier's; per_code).

    packed: uint8 [rows, n/2]; block_scales: float32 [rows, n/16]. Under `small` bytes per code, else per
    uint16 word through a 64 Ki-entry table, `chunk` words (a multiple of 4: whole blocks) at a time.
    """
    rows = packed.shape[0]
    if packed.dtype != np.uint8 or packed.ndim != 2 or packed.shape[1] % (BLOCK // 2) \
            or block_scales.shape != (rows, packed.shape[1] * 2 // BLOCK):
        return error_and_energy_reference(packed, block_scales, table)
    values = E2M1_VALUES.astype(np.float64)
    per_err = (values - per_code(table).astype(np.float64)) ** 2
    s2 = block_scales.reshape(-1).astype(np.float64) ** 2
    if packed.size < small:  # per code through a 16-entry table: no 64 Ki-entry table to build
        codes = np.empty((packed.size, 2), dtype=np.intp)
        flat = np.ascontiguousarray(packed).reshape(-1)
        codes[:, 0], codes[:, 1] = flat & 0xF, flat >> 4
        per_block = np.stack([per_err[codes], values[codes] ** 2], axis=-1).reshape(-1, BLOCK, 2).sum(axis=1)
        return float(s2 @ per_block[:, 0]), float(s2 @ per_block[:, 1])
    # One 8-byte lookup per word gives both sums: (error, energy) as two float32 side by side.
    # One 8-byte lookup per word gives both sums, packed as a complex64 (real: error, imag: energy), so
    # the block sums are 1-D strided complex adds (numpy's fast path; 2-D [.., 2] slices are ~25x slower).
    lut = (_word_table(per_err) + 1j * _word_table(values**2)).astype(np.complex64)
    words = np.ascontiguousarray(packed).reshape(-1).view("<u2")
    total = np.zeros(2, dtype=np.float64)
    got = np.empty(min(words.size, chunk), dtype=np.complex64)
    for i in range(0, words.size, chunk):
        part = words[i : i + chunk]
        g = np.take(lut, part, out=got[: part.size])
        per_block = g[0::4] + g[1::4] + g[2::4] + g[3::4]  # four words make one block of 16 codes
        # float64 on both sides: a float64 @ float32 product leaves BLAS and is ~500x slower.
        total += per_block.view(np.float32).reshape(-1, 2).T.astype(np.float64) @ s2[i // 4 : (i + part.size) // 4]
    return float(total[0]), float(total[1])


def error_and_energy_reference(packed: np.ndarray, block_scales: np.ndarray,
                               table: np.ndarray) -> tuple[float, float]:
    """The plain float64 version of error_and_energy, kept as its reference."""
    per_code_err = np.stack([(E2M1_VALUES - per_code(table)) ** 2, E2M1_VALUES**2], axis=-1)  # [16, 2]
    lut = np.stack([_word_sums(per_code_err[:, 0]), _word_sums(per_code_err[:, 1])], axis=-1)  # [65536, 2]
    rows = packed.shape[0]
    per_word = np.take(lut, _as_u16(packed).reshape(-1), axis=0).reshape(rows, -1, BLOCK // 4, 2)
    per_block = per_word.sum(axis=2, dtype=np.float64)  # [rows, n/16, 2]
    s2 = block_scales.astype(np.float64) ** 2
    return float((per_block[..., 0] * s2).sum()), float((per_block[..., 1] * s2).sum())


def fit_mid_table(hist: np.ndarray) -> np.ndarray:
    """The mid tier's 8-entry table, fitted as fit_table fits the base's: for 3-bit code m (code >> 1), the
    mean FP4 value of the codes 2m, 2m+1 weighted by how often each occurs (their plain mean if neither does)."""
    counts = hist.reshape(8, 2).astype(np.float64)
    pairs = E2M1_VALUES.reshape(8, 2).astype(np.float64)
    n = counts.sum(axis=1)
    table = np.where(n > 0, (counts * pairs).sum(axis=1) / np.maximum(n, 1), pairs.mean(axis=1))
    return table.astype(np.float32)


def _make_mid_lut() -> np.ndarray:
    """delta-plane byte (four 2-bit codes) -> the nibble of their high bits, element j in bit j."""
    d = np.arange(256)
    return sum(((d >> (2 * j + 1)) & 1) << j for j in range(4)).astype(np.uint8)


_MID_LUT = _make_mid_lut()


def mid_plane(delta: np.ndarray) -> np.ndarray:
    """Delta plane uint8 [..., n/4] -> mid plane uint8 [..., n/8]: each element's delta high bit, element 8k+j
    in bit j of byte k (each row on its own: a row of n elements is n/8 bytes)."""
    if delta.dtype != np.uint8 or delta.shape[-1] % 2:
        raise ValueError("a delta plane must be uint8 with an even last dimension (rows of a multiple of 8)")
    nib = np.take(_MID_LUT, delta)
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)


def mid_plane_reference(packed: np.ndarray) -> np.ndarray:
    """The mid plane straight from packed FP4 codes, bit by bit: kept as mid_plane's reference."""
    bits = (unpack_codes(packed) >> 1) & 1
    return np.packbits(bits, axis=-1, bitorder="little")


def unpack_mid(mid: np.ndarray) -> np.ndarray:
    """Mid plane uint8 [..., n/8] -> its bits uint8 [..., n] (0 or 1)."""
    return np.unpackbits(mid, axis=-1, bitorder="little")


def unpack_base(base: np.ndarray) -> np.ndarray:
    """Base (or delta) plane uint8 [..., n/4] -> its 2-bit codes uint8 [..., n]."""
    parts = [(base >> (2 * j)) & 3 for j in range(4)]
    return np.stack(parts, axis=-1).reshape(base.shape[:-1] + (base.shape[-1] * 4,)).astype(np.uint8)


def three_bit_codes(base: np.ndarray, mid: np.ndarray) -> np.ndarray:
    """Base plane [..., n/4] and mid plane [..., n/8] -> the 3-bit codes (code >> 1) uint8 [..., n]."""
    return (unpack_base(base) << 1) | unpack_mid(mid)


def base_values(base: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Base plane uint8 [..., n/4] -> float32 [..., n] table values (before scales)."""
    parts = [table[(base >> (2 * j)) & 3] for j in range(4)]
    return np.stack(parts, axis=-1).reshape(base.shape[:-1] + (base.shape[-1] * 4,))


def nearest_code_for_table(table: np.ndarray) -> np.ndarray:
    """For each base code, the FP4 code (within its group of four) whose value is nearest the table's."""
    out = np.zeros(4, dtype=np.uint8)
    for b in range(4):
        group = E2M1_VALUES[4 * b : 4 * b + 4]
        out[b] = 4 * b + int(np.abs(group - table[b]).argmin())
    return out


_TORCH_M33 = 0x3333333333333333
_TORCH_M0F = 0x0F0F0F0F0F0F0F0F
_TORCH_M00FF = 0x00FF00FF00FF00FF


def split_planes_torch(packed: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """split_planes for a torch uint8 tensor on any device (the GPU split); bit-identical to split_planes.

    The same uint64-word bit ops as the numpy split, on int64 views: a right shift of a negative int64
    fills the top bits with ones, but every shift here is followed by a mask whose top bits are zero.
    """
    import torch
    if packed.dtype != torch.uint8 or packed.shape[-1] % 8:
        raise ValueError("packed FP4 codes must be uint8 with a last dimension divisible by 8")
    w = packed.contiguous().view(torch.int64)

    def compact(a: "torch.Tensor") -> "torch.Tensor":
        a = (a | (a >> 2)) & _TORCH_M0F
        a = (a | (a >> 4)) & _TORCH_M00FF
        return a.view(torch.uint8)[..., 0::2].contiguous()  # the low byte of each 16-bit lane

    delta = compact(w & _TORCH_M33)
    base = compact((w >> 2) & _TORCH_M33)
    return base, delta


def code_histogram_torch(packed: "torch.Tensor") -> np.ndarray:
    """code_histogram for a torch uint8 tensor on any device; exact (integer counts), int64[16] on the host."""
    import torch
    if packed.dtype != torch.uint8 or packed.numel() % 2:
        raise ValueError("packed FP4 codes must be uint8 with an even number of bytes")
    pairs = packed.reshape(-1, 2).to(torch.int32)
    counts = torch.bincount(pairs[:, 0] | (pairs[:, 1] << 8), minlength=1 << 16)
    grid = counts.view(256, 256)  # [high byte, low byte]
    nibbles = (grid.sum(dim=0) + grid.sum(dim=1)).view(16, 16)  # [high nibble, low nibble]
    return (nibbles.sum(dim=0) + nibbles.sum(dim=1)).cpu().numpy().astype(np.int64)


def error_and_energy_torch(packed: "torch.Tensor", block_scales: "torch.Tensor",
                           table: np.ndarray) -> tuple[float, float]:
    """error_and_energy for torch tensors on any device (float64 sums); block_scales: [rows, n/16], any float."""
    import torch
    rows = packed.shape[0]
    if packed.dim() != 2 or packed.shape[1] % (BLOCK // 2) or tuple(block_scales.shape) != (rows, packed.shape[1] * 2 // BLOCK):
        raise ValueError("packed must be [rows, n/2] and block_scales [rows, n/16]")
    values = E2M1_VALUES.astype(np.float64)
    per_err = (values - np.repeat(table.astype(np.float64), 4)) ** 2
    lut = torch.from_numpy(np.stack([_word_table(per_err), _word_table(values**2)], axis=-1)).to(packed.device)
    pairs = packed.reshape(-1, 2).to(torch.int64)
    per_word = lut[pairs[:, 0] | (pairs[:, 1] << 8)]  # [words, 2]
    per_block = per_word.view(-1, BLOCK // 4, 2).sum(dim=1)  # four words make one block
    s2 = block_scales.reshape(-1).to(torch.float64) ** 2
    total = (per_block * s2[:, None]).sum(dim=0).cpu()
    return float(total[0]), float(total[1])


# --- the one-pass kernel: planes, histogram and error/energy sums from one read of the codes ---------

try:  # the optional C extension (setup.py builds it where a C compiler is present)
    from . import _kernels
except ImportError:  # pragma: no cover - depends on the install
    _kernels = None


class HostKernel(StrEnum):
    """Which host kernels split and measure: the C extension or numpy (the same planes and tables; the
    sums agree to float rounding). Every kernel function takes one as `kernel`; the tests ask for numpy."""

    C = "c"
    NUMPY = "numpy"


#: Which path split_and_measure takes by default: "c" (moet_cache.codec._kernels, where it is built) or "numpy".
#: A build asks for its own (BuildTuning.host_kernel; the CLI's MOET_CACHE_KERNELS=numpy).
KERNEL = HostKernel.C if _kernels is not None else HostKernel.NUMPY


def _c_kernels(kernel: HostKernel | None) -> Any:
    """The C extension when `kernel` asks for it (None: KERNEL, the default) and it is built; else None."""
    return _kernels if (kernel or KERNEL) == HostKernel.C else None


def _sums_from_weighted(weighted: np.ndarray, table: np.ndarray) -> tuple[float, float]:
    """(error, energy) from the scale^2-weighted code histogram W: sum W_c (v_c - t[c>>2])^2, sum W_c v_c^2
    (an 8-entry table: t[c>>1]; per_code)."""
    v = E2M1_VALUES.astype(np.float64)
    t = per_code(table).astype(np.float64)
    return float(weighted @ ((v - t) ** 2)), float(weighted @ (v**2))


def split_and_measure(packed: np.ndarray, block_scales: np.ndarray, *, kernel: HostKernel | None = None,
                      form: BaseTable | str = BaseTable.FITTED
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    """(base, delta, table, error, energy) for one tensor: split_planes, fit_base_table(code_histogram,
    form) and error_and_energy (against that table) together, in one pass through moet_cache.codec._kernels
    where it is built (the GIL is released while it runs); otherwise, or for shapes it does not take,
    the numpy kernels.

    packed: uint8 [rows, n/2]; block_scales: [rows, n/16] (any float dtype, taken as float32).
    """
    c = _c_kernels(kernel)
    if c is not None and packed.dtype == np.uint8 and packed.ndim == 2 \
            and packed.shape[1] % (BLOCK // 2) == 0 \
            and block_scales.shape == (packed.shape[0], packed.shape[1] * 2 // BLOCK):
        src = np.ascontiguousarray(packed)
        scales = np.ascontiguousarray(block_scales, dtype=np.float32)
        base = np.empty((src.shape[0], src.shape[1] // 2), dtype=np.uint8)
        delta = np.empty_like(base)
        counts, weighted = c.split_measure(src, scales, base, delta)
        table = fit_base_table(np.array(counts, dtype=np.int64), form)
        er, eg = _sums_from_weighted(np.array(weighted, dtype=np.float64), table)
        return base, delta, table, er, eg
    return split_and_measure_numpy(packed, block_scales, kernel=kernel, form=form)


def split_and_measure_numpy(packed: np.ndarray, block_scales: np.ndarray, *, kernel: HostKernel | None = None,
                            form: BaseTable | str = BaseTable.FITTED
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    """split_and_measure through the numpy kernels (the fallback when the C extension is absent; its split
    still takes the C one where `kernel` allows it)."""
    base, delta = split_planes(packed, kernel=kernel)
    table = fit_base_table(code_histogram(packed), form)
    er, eg = error_and_energy(packed, np.asarray(block_scales, dtype=np.float32), table)
    return base, delta, table, er, eg


def split_and_measure_e4m3(packed: np.ndarray, scale_bytes: np.ndarray, *, kernel: HostKernel | None = None,
                           form: BaseTable | str = BaseTable.FITTED
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    """split_and_measure with the block scales as their raw float8_e4m3fn bytes (uint8 [rows, n/16]).

    The C kernel counts (scale byte, code byte) pairs and weights them once at the end: no float32
    copy of the scales and a cheaper inner loop. Planes and table are identical to split_and_measure's;
    error and energy agree to float rounding (the sums are taken in another order).
    """
    got = _split_counts_e4m3(packed, scale_bytes, kernel)
    if got is not None:
        base, delta, counts, weighted = got
        table = fit_base_table(counts, form)
        er, eg = _sums_from_weighted(weighted, table)
        return base, delta, table, er, eg
    return split_and_measure(packed, E4M3_VALUES[scale_bytes], kernel=kernel, form=form)


def _split_counts_e4m3(packed: np.ndarray, scale_bytes: np.ndarray, kernel: HostKernel | None
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(base, delta, code counts int64[16], scale^2-weighted counts float64[16]) from the C kernel's one pass,
    or None where it does not run (not built, not asked for, or shapes it does not take)."""
    c = _c_kernels(kernel)
    if c is None or not hasattr(c, "split_measure_e4m3") or packed.dtype != np.uint8 or packed.ndim != 2 \
            or packed.shape[1] % (BLOCK // 2) or scale_bytes.dtype != np.uint8 \
            or scale_bytes.shape != (packed.shape[0], packed.shape[1] * 2 // BLOCK):
        return None
    src = np.ascontiguousarray(packed)
    base = np.empty((src.shape[0], src.shape[1] // 2), dtype=np.uint8)
    delta = np.empty_like(base)
    counts, weighted = c.split_measure_e4m3(src, np.ascontiguousarray(scale_bytes), base, delta)
    return base, delta, np.array(counts, dtype=np.int64), np.array(weighted, dtype=np.float64)


def split_and_measure_mid_e4m3(packed: np.ndarray, scale_bytes: np.ndarray, *, kernel: HostKernel | None = None,
                               form: BaseTable | str = BaseTable.FITTED
                               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float, float]:
    """split_and_measure_e4m3 and the mid tier's squared error (the 3-bit codes through fit_mid_table, against
    the FP4 values, before the global scale): from the same counts on the C kernel's one pass; two more
    numpy passes over the codes where it does not run."""
    got = _split_counts_e4m3(packed, scale_bytes, kernel)
    if got is not None:
        base, delta, counts, weighted = got
        table = fit_base_table(counts, form)
        er, eg = _sums_from_weighted(weighted, table)
        return base, delta, table, er, eg, _sums_from_weighted(weighted, fit_mid_table(counts))[0]
    base, delta, table, er, eg = split_and_measure(packed, E4M3_VALUES[scale_bytes], kernel=kernel, form=form)
    mid = error_and_energy(packed, E4M3_VALUES[scale_bytes], fit_mid_table(code_histogram(packed)))[0]
    return base, delta, table, er, eg, mid
