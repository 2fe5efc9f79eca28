"""Triton kernels for one routed-expert layer on the planes (CUDA; the Triton interpreter on CPU).

Two regimes (docs/RUNTIME.md has the figures that chose them):
- pairs (decode): one program per (token, slot) pair and block of output rows; a GEMV on the CUDA
  cores. No sorting by expert at all: a pair reads its expert's rows (pairs of one expert read the
  same rows, which the L2 mostly absorbs at these sizes).
- grouped (prefill): pairs sorted by expert into blocks of BM (`align.py`), one program per block and
  block of output rows, the dequantized tile fed to tensor cores (tl.dot, bf16) in the K loop.

Dequantization, per element, on int32 words of 16 codes (element 16w+j in bits 2j..2j+1):
base-only experts: c = (word >> 2j) & 3 becomes a float by the 2^23 trick (c | 0x4B000000, minus
2^23) and the table by a cubic through its 4 points (Horner, 3 FMAs): exact at c = 0..3 up to fp32
rounding. Tier experts: the 4-bit code (base << 2 | delta) becomes its E2M1 value by placing its bits
into an fp32 (exact). Mid-tier experts: the 3-bit code (base << 1) | mid through the 8-entry table, as
two cubics in the base code (through the table's even and odd entries) and the mid bit choosing between
them: lo(c) + mid * (hi(c) - lo(c)), exact at the 8 codes up to fp32 rounding; the mid plane is read as
int16 words, 16 bits for the 16 codes of a base word. The block scale multiplies once per 16 codes
(pairs: the per-word partial sum) or per element (grouped: the tile before the dot); scale_2 multiplies
the result once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scale_value(s_u8, E8M0: tl.constexpr):
    """float32 value of block-scale bytes: e8m0 (2^(s-127)) or float8_e4m3fn. NaN codes are not special-cased."""
    s = s_u8.to(tl.int32)
    if E8M0:
        v = (s << 23).to(tl.float32, bitcast=True)
        v = tl.where(s == 0, 5.877471754111438e-39, v)  # 2^-127, an fp32 subnormal
    else:
        e = (s >> 3) & 15
        m = s & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
        v = tl.where((s & 128) != 0, -v, v)
    return v


@triton.jit
def _cubic(tab_ptr):
    """Horner coefficients of the cubic through (c, table[c]), c = 0..3."""
    t0 = tl.load(tab_ptr)
    t1 = tl.load(tab_ptr + 1)
    t2 = tl.load(tab_ptr + 2)
    t3 = tl.load(tab_ptr + 3)
    b = t1 - t0
    c = (t2 - 2.0 * t1 + t0) * 0.5
    d = (t3 - 3.0 * t2 + 3.0 * t1 - t0) * (1.0 / 6.0)
    return t0, b - c + 2.0 * d, c - 3.0 * d, d


@triton.jit
def _cubic_mid(tab_ptr, odd):
    """Horner coefficients of the cubic through (c, table8[2c + odd]), c = 0..3 (a mid table's even or odd
    entries)."""
    t0 = tl.load(tab_ptr + odd)
    t1 = tl.load(tab_ptr + 2 + odd)
    t2 = tl.load(tab_ptr + 4 + odd)
    t3 = tl.load(tab_ptr + 6 + odd)
    b = t1 - t0
    c = (t2 - 2.0 * t1 + t0) * 0.5
    d = (t3 - 3.0 * t2 + 3.0 * t1 - t0) * (1.0 / 6.0)
    return t0, b - c + 2.0 * d, c - 3.0 * d, d


@triton.jit
def _mid_values(w, m, sh, j, l0, l1, l2, l3, h0, h1, h2, h3):
    """[.., 16] mid-table values of the 3-bit codes (base << 1) | mid: base code at shift sh of words w,
    mid bit j of the 16-bit words m."""
    cf = (((w >> sh) & 3) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    lo = l0 + cf * (l1 + cf * (l2 + cf * l3))
    hi = h0 + cf * (h1 + cf * (h2 + cf * h3))
    return tl.where(((m >> j) & 1) != 0, hi, lo)


@triton.jit
def _base_values(w, sh, k0, k1, k2, k3):
    """[.., 16] table values of the 2-bit codes at shifts sh of words w (broadcast)."""
    cf = (((w >> sh) & 3) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return k0 + cf * (k1 + cf * (k2 + cf * k3))


@triton.jit
def _fp4_values(w, d, sh):
    """[.., 16] exact E2M1 values of the 4-bit codes (base << 2) | delta."""
    code = (((w >> sh) & 3) << 2) | ((d >> sh) & 3)
    k = code & 7
    bits = tl.where(k >= 2, (((k >> 1) + 126) << 23) | ((k & 1) << 22), k * 0x3F000000)
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_rows(xrow_ptr, base_ptr, delta_ptr, scale_ptr, tab_ptr, rows, is_tier, K: tl.constexpr,
               stride_bn, stride_sn, GROUP: tl.constexpr, E8M0: tl.constexpr, BN: tl.constexpr,
               BKW: tl.constexpr, mid_ptr, mtab_ptr, is_mid, stride_mn):
    """sum_k W[rows, k] * x[k] in float32 for one expert's BN rows, without scale_2.

    2-D tiles only ([BN, BKW] words; the 16 codes of a word in an unrolled loop with constant
    shifts), the table as scalars, the block scale once per word (16 codes), no reduction inside
    the K loop: Triton keeps every tile in registers, with no layout conversion.
    """
    acc = tl.zeros([BN, BKW], dtype=tl.float32)
    k0, k1, k2, k3 = _cubic(tab_ptr)
    l0, l1, l2, l3 = _cubic_mid(mtab_ptr, 0)
    h0, h1, h2, h3 = _cubic_mid(mtab_ptr, 1)
    for kw in range(0, K // 16, BKW):
        wi = kw + tl.arange(0, BKW)
        w = tl.load(base_ptr + rows[:, None] * stride_bn + wi[None, :])
        part = tl.zeros([BN, BKW], dtype=tl.float32)
        if is_tier:
            d = tl.load(delta_ptr + rows[:, None] * stride_bn + wi[None, :])
            for j in tl.static_range(16):
                xj = tl.load(xrow_ptr + wi * 16 + j).to(tl.float32)
                part += _fp4_values(w, d, 2 * j) * xj[None, :]
        elif is_mid:
            m = tl.load(mid_ptr + rows[:, None] * stride_mn + wi[None, :]).to(tl.int32) & 0xFFFF
            for j in tl.static_range(16):
                xj = tl.load(xrow_ptr + wi * 16 + j).to(tl.float32)
                part += _mid_values(w, m, 2 * j, j, l0, l1, l2, l3, h0, h1, h2, h3) * xj[None, :]
        else:
            for j in tl.static_range(16):
                xj = tl.load(xrow_ptr + wi * 16 + j).to(tl.float32)
                part += _base_values(w, 2 * j, k0, k1, k2, k3) * xj[None, :]
        s = _scale_value(tl.load(scale_ptr + rows[:, None] * stride_sn + ((wi * 16) // GROUP)[None, :]), E8M0)
        acc += part * s
    return tl.sum(acc, axis=1)


@triton.jit
def _swiglu(g, u, limit, HAS_LIMIT: tl.constexpr):
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def w13_pairs_kernel(x_ptr, ids_ptr, tier_ptr, b_ptr, d_ptr, s_ptr, s2_ptr, tab_ptr, act_ptr,
                     top_k, H: tl.constexpr, I: tl.constexpr, limit, stride_be, stride_bn, stride_se, stride_sn,
                     mids_ptr, m_ptr, mtab_ptr, stride_me, stride_mn,
                     GROUP: tl.constexpr, E8M0: tl.constexpr, HAS_LIMIT: tl.constexpr,
                     BN: tl.constexpr, BKW: tl.constexpr):
    """act[p, n] = swiglu(gate_e x_t, up_e x_t)[n] for pair p = (t, slot), e = ids[p]."""
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    e = tl.load(ids_ptr + p).to(tl.int64)
    t = p // top_k
    row = tl.load(tier_ptr + e)
    is_tier = row >= 0
    rowc = tl.maximum(row, 0).to(tl.int64)
    mrow = tl.load(mids_ptr + e)
    mrowc = tl.maximum(mrow, 0).to(tl.int64)
    mp = m_ptr + mrowc * stride_me
    xrow = x_ptr + t.to(tl.int64) * H
    g = _gemv_rows(xrow, b_ptr + e * stride_be, d_ptr + rowc * stride_be, s_ptr + e * stride_se,
                   tab_ptr + e * 8, n, is_tier, H, stride_bn, stride_sn, GROUP, E8M0, BN, BKW,
                   mp, mtab_ptr + mrowc * 16, mrow >= 0, stride_mn)
    u = _gemv_rows(xrow, b_ptr + e * stride_be, d_ptr + rowc * stride_be, s_ptr + e * stride_se,
                   tab_ptr + e * 8 + 4, n + I, is_tier, H, stride_bn, stride_sn, GROUP, E8M0, BN, BKW,
                   mp, mtab_ptr + mrowc * 16 + 8, mrow >= 0, stride_mn)
    g = g * tl.load(s2_ptr + e * 2)
    u = u * tl.load(s2_ptr + e * 2 + 1)
    a = _swiglu(g, u, limit, HAS_LIMIT)
    tl.store(act_ptr + p.to(tl.int64) * I + n, a.to(act_ptr.dtype.element_ty))


@triton.jit
def w2_pairs_kernel(act_ptr, ids_ptr, wts_ptr, tier_ptr, b_ptr, d_ptr, s_ptr, s2_ptr, tab_ptr, out_ptr,
                    H: tl.constexpr, I: tl.constexpr, stride_be, stride_bn, stride_se, stride_sn,
                    mids_ptr, m_ptr, mtab_ptr, stride_me, stride_mn,
                    GROUP: tl.constexpr, E8M0: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr):
    """out[p, n] = topk_weights[p] * (down_e act[p])[n]."""
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    e = tl.load(ids_ptr + p).to(tl.int64)
    row = tl.load(tier_ptr + e)
    rowc = tl.maximum(row, 0).to(tl.int64)
    mrow = tl.load(mids_ptr + e)
    mrowc = tl.maximum(mrow, 0).to(tl.int64)
    y = _gemv_rows(act_ptr + p.to(tl.int64) * I, b_ptr + e * stride_be, d_ptr + rowc * stride_be,
                   s_ptr + e * stride_se, tab_ptr + e * 4, n, row >= 0, I, stride_bn, stride_sn,
                   GROUP, E8M0, BN, BKW, m_ptr + mrowc * stride_me, mtab_ptr + mrowc * 8, mrow >= 0, stride_mn)
    y = y * tl.load(s2_ptr + e) * tl.load(wts_ptr + p).to(tl.float32)
    tl.store(out_ptr + p.to(tl.int64) * H + n, y)


@triton.jit
def _tile(base_ptr, delta_ptr, scale_ptr, rows, wi, is_tier, k0, k1, k2, k3, stride_bn, stride_sn,
          GROUP: tl.constexpr, E8M0: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
          mid_ptr, is_mid, l0, l1, l2, l3, h0, h1, h2, h3, stride_mn):
    """float32 [BN, 16 * BKW] tile of scaled weights (without scale_2), elements in natural K order.

    Base-only: the block scale is folded into the cubic's coefficients once per word (16 codes).
    """
    sh = (2 * tl.arange(0, 16))[None, None, :]
    w = tl.load(base_ptr + rows[:, None] * stride_bn + wi[None, :])[:, :, None]
    s = _scale_value(tl.load(scale_ptr + rows[:, None] * stride_sn + ((wi * 16) // GROUP)[None, :]), E8M0)
    s = s[:, :, None]
    if is_tier:
        d = tl.load(delta_ptr + rows[:, None] * stride_bn + wi[None, :])[:, :, None]
        v = _fp4_values(w, d, sh) * s
    elif is_mid:
        m = (tl.load(mid_ptr + rows[:, None] * stride_mn + wi[None, :]).to(tl.int32) & 0xFFFF)[:, :, None]
        v = _mid_values(w, m, sh, tl.arange(0, 16)[None, None, :], l0, l1, l2, l3, h0, h1, h2, h3) * s
    else:
        v = _base_values(w, sh, k0 * s, k1 * s, k2 * s, k3 * s)
    return tl.reshape(v, (BN, 16 * BKW))


@triton.jit
def _dot_in(v, DOT_F32: tl.constexpr):
    """Operand of tl.dot: bf16 on the GPU; float32 under the interpreter, whose bf16 dot is wrong."""
    if DOT_F32:
        return v.to(tl.float32)
    return v.to(tl.bfloat16)


@triton.jit
def _mid_of(mids_ptr, m_ptr, mtab_ptr, e, stride_me, ntab: tl.constexpr):
    """Whether expert e is in the mid tier, its mid plane and its mid table (of `ntab` entries) pointers."""
    mrow = tl.load(mids_ptr + e)
    mrowc = tl.maximum(mrow, 0).to(tl.int64)
    return mrow >= 0, m_ptr + mrowc * stride_me, mtab_ptr + mrowc * ntab


@triton.jit
def _block(sorted_ptr, tier_ptr, b_ptr, d_ptr, s_ptr, e, stride_be, stride_se, BM: tl.constexpr,
           BN: tl.constexpr):
    """This program's rows n, its block's pairs (pc, padding masked by valid), whether the expert is
    in the tier, and the expert's base, delta and scale pointers."""
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    pairs = tl.load(sorted_ptr + tl.program_id(0) * BM + tl.arange(0, BM))
    valid = pairs >= 0
    pc = tl.where(valid, pairs, 0).to(tl.int64)
    row = tl.load(tier_ptr + e)
    dp = d_ptr + tl.maximum(row, 0).to(tl.int64) * stride_be
    return n, valid, pc, row >= 0, b_ptr + e * stride_be, dp, s_ptr + e * stride_se


@triton.jit
def _store_down(out_ptr, acc, s2, wts_ptr, pc, valid, n, H: tl.constexpr):
    """out[pair, n] = acc * scale_2 * topk_weight[pair] for the block's valid pairs."""
    wt = tl.load(wts_ptr + pc, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + pc[:, None] * H + n[None, :], acc * s2 * wt[:, None], mask=valid[:, None])


@triton.jit
def _tile_steps(acc, a_ptr, rows_a, valid, lda, base_ptr, delta_ptr, scale_ptr, rows, is_tier, k0, k1, k2, k3,
                stride_bn, stride_sn, K: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr,
                BN: tl.constexpr, BKW: tl.constexpr, DOT_F32: tl.constexpr,
                mid_ptr, is_mid, l0, l1, l2, l3, h0, h1, h2, h3, stride_mn):
    """acc[BM, BN] += A[rows_a, :K] @ W[rows, :K]^T (scaled, without scale_2), whole [BN, 16 * BKW] tiles."""
    kk = tl.arange(0, 16 * BKW)
    for kw in range(0, K // 16, BKW):
        wi = kw + tl.arange(0, BKW)
        a = tl.load(a_ptr + rows_a[:, None] * lda + kw * 16 + kk[None, :], mask=valid[:, None], other=0.0)
        w = _tile(base_ptr, delta_ptr, scale_ptr, rows, wi, is_tier, k0, k1, k2, k3, stride_bn, stride_sn,
                  GROUP, E8M0, BN, BKW, mid_ptr, is_mid, l0, l1, l2, l3, h0, h1, h2, h3, stride_mn)
        acc = tl.dot(_dot_in(a, DOT_F32), tl.trans(_dot_in(w, DOT_F32)), acc)
    return acc


# ---- grouped, version 2: 2-D tiles only, K permuted within each step ------------------------------
# A step covers BKW words (16 * BKW codes). Code j of word w is element (kw + w) * 16 + j; the kernel
# takes the 16 codes of the step's words as 16 tiles [BN, BKW] (constant shifts) and runs one dot per
# j against the activations at those K positions, which the launcher lays out contiguously
# ("K-permuted": position j * BKW + w of each step holds element w * 16 + j). The w13 kernel writes
# act in the w2 kernel's permuted order.


@triton.jit
def _perm_col(n, BKW: tl.constexpr):
    """Where natural column n sits in the K-permuted order of steps of BKW words."""
    return (n // (16 * BKW)) * (16 * BKW) + (n % 16) * BKW + (n // 16) % BKW


@triton.jit
def _dot_steps(acc, a_ptr, rows_a, valid, lda, base_ptr, delta_ptr, scale_ptr, rows, is_tier, k0, k1, k2, k3,
               stride_bn, stride_sn, K: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr,
               BKW: tl.constexpr, DOT_F32: tl.constexpr,
               mid_ptr, is_mid, l0, l1, l2, l3, h0, h1, h2, h3, stride_mn):
    """acc[BM, BN] += A[rows_a, :K] (K-permuted) @ W[rows, :K]^T (scaled, without scale_2)."""
    wk = tl.arange(0, BKW)
    for kw in range(0, K // 16, BKW):
        wi = kw + wk
        w = tl.load(base_ptr + rows[:, None] * stride_bn + wi[None, :])
        s = _scale_value(tl.load(scale_ptr + rows[:, None] * stride_sn + ((wi * 16) // GROUP)[None, :]), E8M0)
        a_row = a_ptr + rows_a[:, None] * lda + kw * 16 + wk[None, :]
        if is_tier:
            d = tl.load(delta_ptr + rows[:, None] * stride_bn + wi[None, :])
            for j in tl.static_range(16):
                a = tl.load(a_row + j * BKW, mask=valid[:, None], other=0.0)
                v = _fp4_values(w, d, 2 * j) * s
                acc = tl.dot(_dot_in(a, DOT_F32), tl.trans(_dot_in(v, DOT_F32)), acc)
        elif is_mid:
            m = tl.load(mid_ptr + rows[:, None] * stride_mn + wi[None, :]).to(tl.int32) & 0xFFFF
            for j in tl.static_range(16):
                a = tl.load(a_row + j * BKW, mask=valid[:, None], other=0.0)
                v = _mid_values(w, m, 2 * j, j, l0, l1, l2, l3, h0, h1, h2, h3) * s
                acc = tl.dot(_dot_in(a, DOT_F32), tl.trans(_dot_in(v, DOT_F32)), acc)
        else:
            for j in tl.static_range(16):
                a = tl.load(a_row + j * BKW, mask=valid[:, None], other=0.0)
                v = _base_values(w, 2 * j, k0, k1, k2, k3) * s
                acc = tl.dot(_dot_in(a, DOT_F32), tl.trans(_dot_in(v, DOT_F32)), acc)
    return acc


@triton.jit
def _steps(acc, a_ptr, rows_a, valid, lda, bp, dp, sp, rows, is_tier, k0, k1, k2, k3, stride_bn, stride_sn,
           K: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
           DOT_F32: tl.constexpr, V2: tl.constexpr, mid_ptr, is_mid, mtab_ptr, stride_mn):
    """The K loop of the grouped kernels: version 2 (2-D, K-permuted) or version 1 (whole tiles)."""
    l0, l1, l2, l3 = _cubic_mid(mtab_ptr, 0)
    h0, h1, h2, h3 = _cubic_mid(mtab_ptr, 1)
    if V2:
        acc = _dot_steps(acc, a_ptr, rows_a, valid, lda, bp, dp, sp, rows, is_tier, k0, k1, k2, k3, stride_bn,
                         stride_sn, K, GROUP, E8M0, BKW, DOT_F32, mid_ptr, is_mid, l0, l1, l2, l3, h0, h1, h2, h3, stride_mn)
    else:
        acc = _tile_steps(acc, a_ptr, rows_a, valid, lda, bp, dp, sp, rows, is_tier, k0, k1, k2, k3, stride_bn,
                          stride_sn, K, GROUP, E8M0, BN, BKW, DOT_F32, mid_ptr, is_mid, l0, l1, l2, l3, h0, h1, h2, h3, stride_mn)
    return acc


@triton.jit
def w13_grouped_kernel(x_ptr, sorted_ptr, bexp_ptr, tier_ptr, b_ptr, d_ptr, s_ptr, s2_ptr, tab_ptr, act_ptr,
                       top_k, H: tl.constexpr, I: tl.constexpr, limit, stride_be, stride_bn, stride_se, stride_sn,
                       mids_ptr, m_ptr, mtab_ptr, stride_me, stride_mn,
                       GROUP: tl.constexpr, E8M0: tl.constexpr, HAS_LIMIT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, BKW2: tl.constexpr,
                       DOT_F32: tl.constexpr, V2: tl.constexpr):
    """act[pairs, n] for the BM pairs of one expert, on tensor cores. V2: x is K-permuted for BKW and act
    is written K-permuted for the w2 kernel's BKW2."""
    e = tl.load(bexp_ptr + tl.program_id(0)).to(tl.int64)
    if e >= 0:
        n, valid, pc, is_tier, bp, dp, sp = _block(sorted_ptr, tier_ptr, b_ptr, d_ptr, s_ptr, e, stride_be,
                                                   stride_se, BM, BN)
        tok = pc // top_k
        is_mid, mp, mt = _mid_of(mids_ptr, m_ptr, mtab_ptr, e, stride_me, 16)
        g0, g1, g2, g3 = _cubic(tab_ptr + e * 8)
        u0, u1, u2, u3 = _cubic(tab_ptr + e * 8 + 4)
        acc_g = _steps(tl.zeros([BM, BN], dtype=tl.float32), x_ptr, tok, valid, H, bp, dp, sp, n, is_tier,
                       g0, g1, g2, g3, stride_bn, stride_sn, H, GROUP, E8M0, BN, BKW, DOT_F32, V2,
                       mp, is_mid, mt, stride_mn)
        acc_u = _steps(tl.zeros([BM, BN], dtype=tl.float32), x_ptr, tok, valid, H, bp, dp, sp, n + I, is_tier,
                       u0, u1, u2, u3, stride_bn, stride_sn, H, GROUP, E8M0, BN, BKW, DOT_F32, V2,
                       mp, is_mid, mt + 8, stride_mn)
        a = _swiglu(acc_g * tl.load(s2_ptr + e * 2), acc_u * tl.load(s2_ptr + e * 2 + 1), limit, HAS_LIMIT)
        col = n
        if V2:
            col = _perm_col(n, BKW2)
        tl.store(act_ptr + pc[:, None] * I + col[None, :], a.to(act_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def w2_grouped_kernel(act_ptr, sorted_ptr, bexp_ptr, wts_ptr, tier_ptr, b_ptr, d_ptr, s_ptr, s2_ptr, tab_ptr,
                      out_ptr, H: tl.constexpr, I: tl.constexpr, stride_be, stride_bn, stride_se, stride_sn,
                      mids_ptr, m_ptr, mtab_ptr, stride_me, stride_mn,
                      GROUP: tl.constexpr, E8M0: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BKW: tl.constexpr, DOT_F32: tl.constexpr, V2: tl.constexpr):
    """out[pair, n] = topk_weight[pair] * (down_e act[pair])[n] for the BM pairs of one expert."""
    e = tl.load(bexp_ptr + tl.program_id(0)).to(tl.int64)
    if e >= 0:
        n, valid, pc, is_tier, bp, dp, sp = _block(sorted_ptr, tier_ptr, b_ptr, d_ptr, s_ptr, e, stride_be,
                                                   stride_se, BM, BN)
        k0, k1, k2, k3 = _cubic(tab_ptr + e * 4)
        is_mid, mp, mt = _mid_of(mids_ptr, m_ptr, mtab_ptr, e, stride_me, 8)
        acc = _steps(tl.zeros([BM, BN], dtype=tl.float32), act_ptr, pc, valid, I, bp, dp, sp, n, is_tier,
                     k0, k1, k2, k3, stride_bn, stride_sn, I, GROUP, E8M0, BN, BKW, DOT_F32, V2,
                     mp, is_mid, mt, stride_mn)
        _store_down(out_ptr, acc, tl.load(s2_ptr + e), wts_ptr, pc, valid, n, H)
