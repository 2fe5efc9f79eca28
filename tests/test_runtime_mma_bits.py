"""The bit arithmetic of the tensor-core kernels (moet_cache/runtime/mma_moe.cu), emulated on the CPU
op by op: PRMT table lookups, the tier's exact E2M1, the scale bytes as bf16, and the K permutation
against the mma.sync m16n8k16 fragment layout of the PTX ISA. The kernels themselves run only on a
GPU (tests/test_runtime_gpu.py); this proves the algebra they rest on in CI."""

from __future__ import annotations

import itertools
import math
import random

import torch

from moet_cache.runtime.dequant import E2M1
from moet_cache.runtime.mma_moe import k_paired
from moet_cache.runtime.mma_prefill import k_permuted

M32 = 0xFFFFFFFF


def prmt(a: int, b: int, s: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte s[4i..4i+2] of {b, a}, or with
    s[4i+3] set that byte's sign bit replicated."""
    pool = (a & M32) | ((b & M32) << 32)
    out = 0
    for i in range(4):
        sel = (s >> (4 * i)) & 15
        byte = (pool >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def bf16_bits(v: float) -> int:
    return int(torch.tensor([v], dtype=torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def bf16_value(bits: int) -> float:
    return torch.tensor([bits if bits < 0x8000 else bits - 0x10000], dtype=torch.int16).view(torch.bfloat16).item()


def bmul2(a: int, b: int) -> int:
    """fma.rn.bf16x2 a * b + (-0), per half."""
    lo = bf16_bits(bf16_value(a & 0xFFFF) * bf16_value(b & 0xFFFF))
    hi = bf16_bits(bf16_value(a >> 16) * bf16_value(b >> 16))
    return lo | hi << 16


BF16X2_2P120 = 0x7B807B80  # mma_bits.cu: 2^120 in both halves


def e4m3_bits(x: int) -> int:
    """mma_bits.cu e4m3_bits: the e4m3 byte in each half moved into bf16's places (value x 2^-120)."""
    return (((x << 4) & 0x07F007F0) | ((x << 8) & 0x80008000)) & M32


def base_regs(ws: int, tlo: int, thi: int) -> tuple[int, int]:
    """mma_moe.cu base_regs: the word already shifted by 2q."""
    sel = ((ws & 0x03030303) * 0x22 + 0x10101010) & M32
    return prmt(tlo, thi, sel), prmt(tlo, thi, sel >> 16)


def tier_regs(wb: int, wd: int, sc: int) -> tuple[int, int]:
    """mma_moe.cu tier_regs: base and delta words already shifted by 2q."""
    mb = wb & 0x03030303
    sel = ((wd & 0x03030303) * 0x22 + 0x10101010) & M32
    m7, m6 = (mb << 7) & M32, (mb << 6) & M32
    out = []
    for s_, big_sel in ((sel, 0x9988), (sel >> 16, 0xBBAA)):
        small, large = prmt(0x3F000000, 0x3FC03F80, s_), prmt(0x40404000, 0x40C04080, s_)
        big, neg = prmt(m7, 0, big_sel), prmt(m6, 0, big_sel)
        out.append(bmul2((large & big) | (small & ~big & M32) | (neg & 0x80008000), sc))
    return out[0], out[1]


def scale_pair(byte: int, e8: bool) -> int:
    if e8:
        return (byte * 0x00800080) & M32
    e, m = (byte >> 3) & 15, byte & 7
    if e:
        bits = ((e + 120) << 7) | (m << 4)
    else:
        bits = bf16_bits(m * 0.001953125)
    bits |= (byte & 128) << 8
    return bits | bits << 16


def test_base_regs_are_the_table_for_every_code() -> None:
    table = [0.8125, 3.25, -0.75, -3.5]
    tlo = bf16_bits(table[0]) | bf16_bits(table[1]) << 16
    thi = bf16_bits(table[2]) | bf16_bits(table[3]) << 16
    rng = random.Random(5)
    for _ in range(2000):
        w, q = rng.getrandbits(32), rng.randrange(4)
        lo, hi = base_regs(w >> (2 * q), tlo, thi)
        # lo: codes q, q + 4 of the word; hi: codes q + 8, q + 12 (low half first)
        for reg, (ca, cb) in ((lo, (q, q + 4)), (hi, (q + 8, q + 12))):
            assert bf16_value(reg & 0xFFFF) == bf16_value(bf16_bits(table[(w >> (2 * ca)) & 3]))
            assert bf16_value(reg >> 16) == bf16_value(bf16_bits(table[(w >> (2 * cb)) & 3]))


def test_tier_regs_are_exact_e2m1_times_the_scale() -> None:
    rng = random.Random(6)
    for byte, e8 in ((127, True), (120, True), (133, True), (0x38, False), (0x3B, False), (0x05, False)):
        sc = scale_pair(byte, e8)
        s = bf16_value(sc & 0xFFFF)
        for _ in range(600):
            wb, wd, q = rng.getrandbits(32), rng.getrandbits(32), rng.randrange(4)
            lo, hi = tier_regs(wb >> (2 * q), wd >> (2 * q), sc)
            for reg, (ca, cb) in ((lo, (q, q + 4)), (hi, (q + 8, q + 12))):
                code_a = ((wb >> (2 * ca)) & 3) << 2 | (wd >> (2 * ca)) & 3
                code_b = ((wb >> (2 * cb)) & 3) << 2 | (wd >> (2 * cb)) & 3
                assert bf16_value(reg & 0xFFFF) == E2M1[code_a] * s, (code_a, byte)
                assert bf16_value(reg >> 16) == E2M1[code_b] * s, (code_b, byte)


def test_scale_pairs_are_the_scale_values() -> None:
    for byte in range(1, 255):  # e8m0 0 (2^-127) is taken as 0 by the kernel; 255 is NaN
        want = torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e8m0fnu).float().item()
        sp = scale_pair(byte, True)
        assert bf16_value(sp & 0xFFFF) == want and sp >> 16 == sp & 0xFFFF
    for byte in range(256):
        want = torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()
        if want != want:  # NaN codes
            continue
        sp = scale_pair(byte, False)
        assert bf16_value(sp & 0xFFFF) == want, byte


def x4_reg(r: int, w: int, sc: int) -> int:
    """mma_bits.cu x4_reg, op by op in 32 bits."""
    if r < 7:
        return ((w & (0x81008100 >> r)) * ((0x01000001 << r) & M32) + sc) & M32
    return ((((w & 0x00030003) * 0x4100) & 0x81008100) * 0x01000001 + sc) & M32


def x4_reg_rt(r: int, w: int, sc: int) -> int:
    """mma_bits.cu x4_consts + x4_reg_rt (mma_prefill.cu's run-time register index)."""
    m1, k1, m2, k2 = ((0x81008100 >> r, (0x01000001 << r) & M32, M32, 1) if r < 7
                      else (0x00030003, 0x4100, 0x81008100, 0x01000001))
    return (((((w & m1) * k1) & M32 & m2) * k2) + sc) & M32


def x4_scale_e8(sreg: int, byte: int) -> int:
    """mma_bits.cu x4_scale_e8."""
    return (prmt(sreg, 0, 0x4040 | byte << 8 | byte) << 7) & M32


def test_x4_regs_are_sign_and_x4_times_the_scale_for_every_code() -> None:
    """A word with its bits moved by x4_table (to_x4 then tiles the words) gives, in register r = j + 4h, the
    codes j + 8h (low half) and j + 4 + 8h (high half) as +-{1, 4} x the block scale, bit for bit (the
    natural lookup's order)."""
    from moet_cache.runtime.x4_table import _move_bits
    rng = random.Random(9)
    words = [rng.getrandbits(32) for _ in range(300)] + [0, M32, 0x55555555, 0xAAAAAAAA]
    plane = torch.tensor([[[w - (1 << 32) if w >= 1 << 31 else w for w in words]]], dtype=torch.int32)
    packed = _move_bits(plane, delta=False, inverse=False).reshape(-1).tolist()
    pattern = (1.0, 4.0, -1.0, -4.0)
    for byte, e8 in ((127, True), (1, True), (252, True), (120, True), (0x38, False), (0x7E, False), (0x03, False)):
        sreg = byte << 16 | 0x5A  # the byte in position 2 of its scale word
        sc = x4_scale_e8(sreg, 2) if e8 else scale_pair(byte, e8)
        assert sc == scale_pair(byte, e8)  # the PRMT + shift form is the multiply's value
        s = bf16_value(sc & 0xFFFF)
        for w, rw in zip(words, packed):
            for r in range(8):
                j, h = r & 3, r >> 2
                reg = x4_reg(r, rw & M32, sc)
                assert reg == x4_reg_rt(r, rw & M32, sc)
                for half, code in ((reg & 0xFFFF, j + 8 * h), (reg >> 16, j + 4 + 8 * h)):
                    assert bf16_value(half) == pattern[(w >> (2 * code)) & 3] * s, (r, code, byte)


def x4_tier_reg(r: int, wb: int, wd: int, sc: int) -> int:
    """mma_bits.cu x4_tier_consts + x4_tier_reg, op by op in 32 bits."""
    k = r >> 1
    mb, kb, mb2, md, s, dshift = ((0x81008100 >> r, 1 << (r & 1), M32, 0x00C000C0 >> (2 * k), 2 * k, 8 * (r & 1))
                                  if r < 7 else (0x00030003, 0x104, 0x02040204, 0x00030003, 6, 8))
    return bmul2((((((wb & mb) * kb) & M32 & mb2) | ((wd >> dshift) & md)) << s) & M32, sc)


def x4_tier_scale(sc: int, e8: bool) -> int:
    """mma_bits.cu x4_tier_scale."""
    return (sc + 0x3B003B00) & M32 if e8 else bmul2(sc, 0x7A807A80)


def test_x4_tier_regs_are_the_exact_fp4_values_for_every_code() -> None:
    """A tier expert's base and delta words with their bits moved by x4_table give, in register r = j + 4h, the
    exact E2M1 values of the codes j + 8h (low half) and j + 4 + 8h (high half) x the block scale x 2^-8
    (X4_TIER_POST), bit for bit: every code, -0 included, for e8m0 bytes from 3 to MAX_TIER_E8M0_BYTE and
    e4m3 bytes from a subnormal to 448. The codes 0 and 0.5 pass through bf16 subnormals. (Bytes 0 to 2,
    scales of 2^-125 and less, lose their small codes below bf16's subnormals.)"""
    from moet_cache.runtime.x4_table import MAX_TIER_E8M0_BYTE, _move_bits
    rng = random.Random(11)
    n = 200
    wb = [rng.getrandbits(32) for _ in range(n)] + [0, M32, 0x55555555, 0xAAAAAAAA]
    wd = [rng.getrandbits(32) for _ in range(n)] + [M32, 0, 0xAAAAAAAA, 0x55555555]

    def packed(words: list[int], delta: bool) -> list[int]:
        plane = torch.tensor([[[w - (1 << 32) if w >= 1 << 31 else w for w in words]]], dtype=torch.int32)
        return [w & M32 for w in _move_bits(plane, delta, inverse=False).reshape(-1).tolist()]

    pb, pd = packed(wb, False), packed(wd, True)
    for byte, e8 in ((3, True), (4, True), (100, True), (127, True), (MAX_TIER_E8M0_BYTE, True),
                     (0x01, False), (0x03, False), (0x38, False), (0x7E, False), (0x35, False)):
        scale = 2.0 ** (byte - 127) if e8 else float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn))
        sc = x4_tier_scale(scale_pair(byte, e8), e8)
        for b, d, rb, rd in zip(wb, wd, pb, pd):
            for r in range(8):
                j, h = r & 3, r >> 2
                reg = x4_tier_reg(r, rb, rd, sc)
                for half, code in ((reg & 0xFFFF, j + 8 * h), (reg >> 16, j + 4 + 8 * h)):
                    c = ((b >> (2 * code)) & 3) << 2 | ((d >> (2 * code)) & 3)
                    got, want = bf16_value(half) * 256.0, E2M1[c] * scale
                    assert got == want and math.copysign(1, got) == math.copysign(1, want), (byte, r, c)


def test_chunk_fragments_give_w_times_x() -> None:
    """One chunk (256 codes of 16 rows) as the kernel feeds it to 64 m16n8k16 steps: thread (g, q)
    loads words 4q .. 4q + 3 of rows g and g + 8 and, for sub-step (i, j), builds a0..a3 by base_regs
    of word 4q + i shifted by 2j; B is that word's 16 activations K-paired (k_paired, the thread's two
    16-byte loads), b0 and b1 being u32 2j and 2j + 1. C follows the PTX ISA fragment layout; the sum
    over the chunk must equal W @ x."""
    g0 = torch.Generator().manual_seed(3)
    table = [0.75, 3.0, -1.0, -2.5]  # exact in bf16
    tlo = bf16_bits(table[0]) | bf16_bits(table[1]) << 16
    thi = bf16_bits(table[2]) | bf16_bits(table[3]) << 16
    words = torch.randint(0, 1 << 31, (16, 16), generator=g0).tolist()       # [row, word of the chunk]
    W = torch.tensor([[table[(w >> (2 * c)) & 3] for w in row for c in range(16)] for row in words])
    x = torch.randn((8, 256), generator=g0).to(torch.bfloat16)                # 8 tokens, natural order
    xb = k_paired(x).view(torch.int16).to(torch.int64) & 0xFFFF
    xu32 = [[int(xb[n, 2 * k]) | int(xb[n, 2 * k + 1]) << 16 for k in range(128)] for n in range(8)]

    def b_regs(n: int, q: int, i: int, j: int) -> tuple[int, int]:
        u = xu32[n][8 * (4 * q + i):8 * (4 * q + i) + 8]  # the word's 16 values as 8 u32
        return u[2 * j], u[2 * j + 1]

    C = torch.zeros((16, 8), dtype=torch.float64)
    for i in range(4):
        for j in range(4):
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                a0, a2 = base_regs(words[g][4 * q + i] >> (2 * j), tlo, thi)
                a1, a3 = base_regs(words[g + 8][4 * q + i] >> (2 * j), tlo, thi)
                # A fragment (PTX ISA, m16n8k16 .bf16): a0 (row g, cols 2q, 2q+1), a1 (row g+8, same),
                # a2 (row g, cols 2q+8, 2q+9), a3 (row g+8, same); B: lane (n, q) holds b0 (k 2q, 2q+1)
                # and b1 (k 2q+8, 2q+9) of token n. Column k pairs A's column k with B's row k.
                for reg, row, h in ((a0, g, 0), (a1, g + 8, 0), (a2, g, 1), (a3, g + 8, 1)):
                    for n in range(8):
                        b = b_regs(n, q, i, j)[h]
                        C[row, n] += bf16_value(reg & 0xFFFF) * bf16_value(b & 0xFFFF)
                        C[row, n] += bf16_value(reg >> 16) * bf16_value(b >> 16)
    want = W.double() @ x.double().T
    assert torch.allclose(C, want, atol=1e-9)


def _prefill_stage_smem(xp: torch.Tensor, words: list[list[int]], scales: list[bytes], warps: int, nt: int) -> bytearray:
    """One stage of mma_prefill.cu's shared memory as its cp.async copies write it: x rows (pairs, 16
    chunks of 16 B, chunk c of row r at c ^ (r & 7)), then the words of each weight row (half h at
    h ^ ((r >> 2) & 1)), the delta words (unused here), then 8 scale bytes a row."""
    bm, rows = 8 * nt, 32 * warps
    xb, wb = bm * 256, rows * 32
    smem = bytearray(xb + 2 * wb + rows * 8)
    xbytes = xp.contiguous().view(torch.int16).numpy().tobytes()  # [bm, 128] bf16, K-permuted
    xc = bm * 16 // rows
    for t in range(rows):  # thread t: x chunks t & 15 of rows (t >> 4) + 16 c, its own weight row t
        for c in range(xc):
            row, chunk = (t >> 4) + c * (rows // 16), t & 15
            src = row * 256 + chunk * 16
            dst = row * 256 + ((chunk ^ (row & 7)) << 4)
            smem[dst:dst + 16] = xbytes[src:src + 16]
        for h in range(2):
            dst = xb + t * 32 + ((h ^ ((t >> 2) & 1)) << 4)
            smem[dst:dst + 16] = b"".join(w.to_bytes(4, "little") for w in words[t][4 * h:4 * h + 4])
        smem[xb + 2 * wb + t * 8:xb + 2 * wb + t * 8 + 8] = scales[t]
    return smem


def _ldmatrix_x4(smem: bytearray, addrs: list[int]) -> list[list[int]]:
    """PTX ldmatrix .m8n8.x4 .b16: lane l gives the row address of row l % 8 of matrix l // 8; register
    m of lane l holds elements 2 (l % 4), 2 (l % 4) + 1 of row l // 4 of matrix m."""
    out = []
    for lane in range(32):
        regs = []
        for m in range(4):
            a = addrs[8 * m + (lane >> 2)] + 4 * (lane & 3)
            regs.append(int.from_bytes(smem[a:a + 4], "little"))
        out.append(regs)
    return out


def test_prefill_stage_layout_gives_w_times_x() -> None:
    """One whole stage (K 128) of mma_prefill.cu's base-only compute, e8m0 scales, as its threads read
    shared memory: the weight words through the half swizzle, the scale bytes, the tables pre-scaled,
    A by base_regs, B by ldmatrix.x4 through the chunk swizzle (n-tiles 2p, 2p + 1), C by the PTX
    fragment layout. Equals (table[code] * scale) @ x over the stage in natural K order."""
    warps, nt = 2, 4  # a small CTA: the layouts do not depend on the size beyond the XC split
    bm, rows = 8 * nt, 32 * warps
    rng = random.Random(11)
    table = [0.75, 3.0, -1.0, -2.5]
    tlo = bf16_bits(table[0]) | bf16_bits(table[1]) << 16
    thi = bf16_bits(table[2]) | bf16_bits(table[3]) << 16
    words = [[rng.getrandbits(32) for _ in range(8)] for _ in range(rows)]
    sbytes = [bytes([rng.randrange(124, 130) for _ in range(4)]) + bytes(4) for _ in range(rows)]
    x = torch.randn((bm, 128), generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    smem = _prefill_stage_smem(k_permuted(x), words, sbytes, warps, nt)
    xb, wb = bm * 256, rows * 32
    C = torch.zeros((rows, bm), dtype=torch.float64)
    for warp in range(warps):
        for j in range(8):
            a_frag = []
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                regs = {}
                for i in range(2):
                    for rr in range(2):
                        lr = 32 * warp + 16 * i + g + 8 * rr
                        off = xb + lr * 32 + (((j >> 2) ^ ((g >> 2) & 1)) << 4) + 4 * (j & 3)
                        w = int.from_bytes(smem[off:off + 4], "little")
                        sreg = int.from_bytes(smem[xb + 2 * wb + lr * 8:xb + 2 * wb + lr * 8 + 4], "little")
                        byte = j >> 1
                        sc = scale_pair(prmt(sreg, 0, 0x4440 | (byte & 3)), True)
                        lo, hi = base_regs(w >> (2 * q), bmul2(tlo, sc), bmul2(thi, sc))
                        regs[(i, rr)] = (lo, hi)
                # a0 (row g, low), a1 (row g + 8, low), a2 (row g, high), a3 (row g + 8, high)
                a_frag.append({i: (regs[(i, 0)][0], regs[(i, 1)][0], regs[(i, 0)][1], regs[(i, 1)][1])
                               for i in range(2)})
            for p in range(nt // 2):
                addrs = []
                for lane in range(32):
                    xr = (lane & 7) + ((lane >> 4) << 3)
                    x_chunk = (((lane >> 3) & 1) ^ (lane & 7)) << 4
                    addrs.append(xr * 256 + (x_chunk ^ (32 * j)) + p * 16 * 256)
                b = _ldmatrix_x4(smem, addrs)
                for lane in range(32):
                    g, q = lane >> 2, lane & 3
                    for i in range(2):
                        a0, a1, a2, a3 = a_frag[lane][i]
                        # thread (g', q) holds B[k 2q, 2q + 1][n g'] (b0) and B[k 2q + 8, 2q + 9][n g'] (b1):
                        # the k columns of thread (g, q)'s A registers against every column n
                        for gn, half in itertools.product(range(8), range(2)):
                            b0, b1 = b[4 * gn + q][2 * half:2 * half + 2]
                            n = 16 * p + 8 * half + gn
                            for reg_a, reg_b, row in ((a0, b0, g), (a2, b1, g), (a1, b0, g + 8), (a3, b1, g + 8)):
                                lr = 32 * warp + 16 * i + row
                                C[lr, n] += (bf16_value(reg_a & 0xFFFF) * bf16_value(reg_b & 0xFFFF)
                                             + bf16_value(reg_a >> 16) * bf16_value(reg_b >> 16))
    codes = torch.tensor([[(w >> (2 * c)) & 3 for w in row for c in range(16)] for row in words])
    scale = torch.tensor([[2.0 ** (s[k // 32] - 127) for k in range(128)] for s in sbytes])
    W = torch.tensor(table, dtype=torch.float64)[codes] * scale.double()
    assert torch.allclose(C, W @ x.double().T, rtol=1e-9, atol=1e-9)


def test_decode_act_columns_are_the_k_pairing() -> None:
    """The decode w13 epilogue writes intermediate column n at pair_col(n); w2 reads it as K-paired x."""
    def pair_col(n: int) -> int:
        o = n & 15
        return (n & ~15) | ((o & 3) << 2) | ((o >> 3) << 1) | ((o >> 2) & 1)

    x = torch.randn((1, 64))
    placed = torch.empty(64)
    for n in range(64):
        placed[pair_col(n)] = x[0, n]
    assert torch.equal(placed.to(torch.bfloat16), k_paired(x)[0])


def test_pair_rows_words_are_the_k_pairing() -> None:
    """mma_moe.cu pair_rows: out word m = prmt(in[lo / 2], in[hi / 2], selector) with lo = m / 2 + 8 (m % 2),
    hi = lo + 4, the half of each input word picked by lo % 2, hi % 2: emulated on random groups of 16
    against k_paired, the rows the decode kernels read."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn((3, 64), generator=g).to(torch.bfloat16)
    words = [int(w) & M32 for w in x.view(torch.int32).reshape(-1)]
    out = []
    for group in range(len(words) // 8):
        inw = words[8 * group:8 * group + 8]
        for m in range(8):
            lo = (m >> 1) + 8 * (m & 1)
            hi = lo + 4
            sel = (0x32 if lo & 1 else 0x10) | (0x7600 if hi & 1 else 0x5400)
            out.append(prmt(inw[lo >> 1], inw[hi >> 1], sel))
    got = torch.tensor([w - (1 << 32) if w >> 31 else w for w in out], dtype=torch.int32)
    assert torch.equal(got.view(torch.bfloat16).view(3, 64), k_paired(x))


def test_prefill_act_columns_are_the_k_permutation() -> None:
    """w13's epilogue writes intermediate column n at perm_col(n); w2 reads it as K-permuted x."""
    def perm_col(n: int) -> int:
        o = n & 15
        return (n & ~15) | ((o & 3) << 1) | ((o >> 2) & 1) | (o & 8)
    x = torch.arange(64, dtype=torch.float32).view(1, 64)
    placed = torch.zeros(64)
    for n in range(64):
        placed[perm_col(n)] = x[0, n]
    assert torch.equal(placed.to(torch.bfloat16), k_permuted(x)[0])


def test_prefill_e4m3_scale_times_2p120_is_the_scale() -> None:
    """mma_bits.cu e4m3_pair_lo: the e4m3 byte's bits moved into bf16's places give value x 2^-120
    (subnormal scales included); the tables carry 2^120, so table x scale is the same bf16 as with
    scale_pair, and e4m3_pair (x 2^120 back: the fitted prefill's tier scale) is scale_pair's
    exactly."""
    two120 = BF16X2_2P120
    assert bf16_value(two120 & 0xFFFF) == 2.0 ** 120
    table = [0.8125, 3.25, -0.75, -3.5, 5.9, -0.0078125]
    for byte in range(256):
        if torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().isnan().item():
            continue
        for k in range(4):
            sreg = (byte << (8 * k)) | (0x5A << (8 * ((k + 1) & 3)))  # another byte beside it
            x = prmt(sreg, 0, 0x4040 | (k << 8) | k)
            lo = e4m3_bits(x)
            assert bmul2(lo, two120) == scale_pair(byte, False), byte
            for v in table:
                t = bf16_bits(v) | bf16_bits(-v) << 16
                assert bmul2(bmul2(t, two120), lo) == bmul2(t, scale_pair(byte, False)), (byte, v)


def test_e4m3_two_then_prmt_is_e4m3_pair_of_each_byte() -> None:
    """mma_bits.cu e4m3_two: two scale bytes converted at once, one a half; x4_scale_e4 (decode and
    prefill) then takes group i's pair by prmt(., 0, 0x1010) (even i) or 0x3232 (odd i). Each must be
    scale_pair's value of its own byte, bit for bit, for every pair of finite e4m3 bytes in every byte
    slot, subnormals and the sign included."""
    finite = [b for b in range(256)
              if not torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float().isnan().item()]
    rng = random.Random(5)
    for lo_byte in finite:
        for hi_byte in rng.sample(finite, 12) + [lo_byte, 0, 0x80, 0x7E]:
            for h in range(2):
                other = rng.randrange(1 << 16)  # the other two bytes of the register
                sreg = (lo_byte | hi_byte << 8) << (16 * h) | other << (16 * (1 - h))
                x = prmt(sreg, 0, 0x4342 if h else 0x4140)
                two = bmul2(e4m3_bits(x), BF16X2_2P120)
                assert prmt(two, 0, 0x1010) == scale_pair(lo_byte, False), (lo_byte, hi_byte, h)
                assert prmt(two, 0, 0x3232) == scale_pair(hi_byte, False), (lo_byte, hi_byte, h)


def group_pair(ids: list[int], e: int, p: int, bm: int = 8) -> tuple[bool, list[int]]:
    """mma_moe.cu group_pair, round by round as one warp runs it: whether block p leads, and the pair
    of each lane's slot (lane % bm), -1 for none."""
    P, slots = len(ids), [-1] * 32
    before, rank = 0, -1
    for i0 in range(0, P, 32):
        m = sum(1 << lane for lane in range(32) if i0 + lane < P and ids[i0 + lane] == e)  # __ballot_sync
        if rank < 0 and p < i0 + 32:
            rank = before + bin(m & ((1 << (p - i0)) - 1)).count("1")
            if rank % bm:
                return False, slots
        if rank >= 0:
            for lane in range(32):
                k = rank + (lane & (bm - 1)) - before
                if 0 <= k < bin(m).count("1"):
                    b = m
                    for _ in range(k):
                        b &= b - 1
                    slots[lane] = i0 + (b & -b).bit_length() - 1  # __ffs(b) - 1
            if before + bin(m).count("1") >= rank + bm:
                break
        before += bin(m).count("1")
    return True, slots


def test_direct_blocks_take_each_pair_once_in_groups_of_8() -> None:
    """The direct blocks' grouping: every pair lands in exactly one led block, each expert's pairs in
    pair order 8 to a block, the leader first; across round edges (P not a multiple of 32), hot experts
    (many groups) and experts routed once."""
    rng = random.Random(5)
    for P, E in [(6, 256), (96, 256), (97, 4), (200, 3), (33, 1), (288, 64), (1, 1)]:
        ids = [rng.randrange(E) for _ in range(P)]
        taken: list[int] = []
        for p in range(P):
            lead, slots = group_pair(ids, ids[p], p)
            if not lead:
                continue
            group = [slots[s] for s in range(8) if slots[s] >= 0]
            assert slots[8:] == slots[:8] * 3  # every lane with the same slot agrees
            mine = [i for i in range(P) if ids[i] == ids[p]]
            start = mine.index(p)
            assert start % 8 == 0 and group == mine[start:start + 8]
            assert slots[:8] == group + [-1] * (8 - len(group))
            taken += group
        assert sorted(taken) == list(range(P))

