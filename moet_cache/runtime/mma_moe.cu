// One routed-expert layer on the planes, on tensor cores (mma.sync m16n8k16 bf16, fp32 accumulate).
// Compiled at first use by NVRTC (mma_moe.py); no header is included, so no CUDA toolkit is needed.
//
// Layout facts (docs/FORMAT.md, docs/RUNTIME.md): a plane row is int32 words of 16 codes, element
// 16w + j in bits 2j..2j+1 of word w. The A operand (16 weight rows x 16 k) of one mma is one word of
// each of 16 rows. Thread (g = lane / 4, q = lane % 4) holds rows g and g + 8, and in each row the mma
// columns 2q, 2q + 1 (register a0/a1) and 2q + 8, 2q + 9 (a2/a3). We let mma column 2q + s + 8h stand
// for code q + 4s + 8h of the word ("K-permuted"; the activations are laid out the same way by the
// launcher), so a register's two codes sit 8 bits apart: (word >> 2q) & 0x0303 holds codes q and
// q + 4, and (word >> (2q + 16)) & 0x0303 codes q + 8 and q + 12.
//
// Base code -> bf16 table value, two codes per op: the row's 4-entry table, pre-multiplied by the
// block scale (bf16x2 multiply, once per row and scale group), sits in two registers (8 bytes); PRMT
// picks bytes 2c and 2c + 1 for each code, and the selector is one IMAD: m * 0x22 + 0x1010.
// Tier code (base << 2 | delta) -> exact E2M1: two PRMTs into the tables {0, .5, 1, 1.5} and
// {2, 3, 4, 6} by the delta bits, a select by the base's low bit and the sign from its high bit
// (PRMT sign-replicate mode), then the block scale (exact: E2M1 x power of two or e4m3).

// The helpers (prmt, base_regs, tier_regs, scale_pair, mma, ...) are in mma_bits.cu.

// K-permuted position of natural index n (see the top of this file)
DEV int perm_col(int n) {
  int o = n & 15;
  return (n & ~15) | ((o & 3) << 1) | ((o >> 2) & 1) | (o & 8);
}

// One step's weights: 8 words (STEP_WORDS in mma_moe.py) of each of the thread's R rows (+ the tier's
// delta words), and the block-scale bytes of those words.
template <int R>
struct Step {
  U4 w[R][2], d[R][2];
  u32 s[R][2];
};

// A plane load: 16 bytes, read once (no L1 allocation), the L2 asked for the 256-byte segment around
// it (the next steps of the row). The hint measured neither faster nor slower (docs/RUNTIME.md).
DEV U4 load_words(const u32* p) {
  U4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

template <int R, bool E8, bool TIER>
DEV void load_step(Step<R>& st, const u32* const (&wrow)[R], const u32* const (&drow)[R],
                   const u8* const (&srow)[R], int k0) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    st.w[r][0] = load_words(wrow[r] + k0);
    st.w[r][1] = load_words(wrow[r] + k0 + 4);
    if (TIER) {
      st.d[r][0] = load_words(drow[r] + k0);
      st.d[r][1] = load_words(drow[r] + k0 + 4);
    }
    if (E8) {
      st.s[r][0] = *reinterpret_cast<const u32*>(srow[r] + (k0 >> 1));  // 4 groups of 32 codes
    } else {
      const u32* ps = reinterpret_cast<const u32*>(srow[r] + k0);       // 8 groups of 16 codes
      st.s[r][0] = ps[0];
      st.s[r][1] = ps[1];
    }
  }
}

DEV u32 word_of(const U4& v, int j) { return (j & 3) == 0 ? v.x : (j & 3) == 1 ? v.y : (j & 3) == 2 ? v.z : v.w; }

// B fragments of word k for one token row: k positions 2q, 2q + 1 (b0) and 2q + 8, 2q + 9 (b1), i.e.
// elements q, q + 4 and q + 8, q + 12 (XNAT: x in natural order, bf16; else already K-permuted).
template <bool XNAT>
DEV void b_frag(const u16* xr, int k, int q, u32& b0, u32& b1) {
  if (!xr) {
    b0 = b1 = 0u;
  } else if (XNAT) {
    const u16* p = xr + 16 * k + q;
    b0 = (u32)p[0] | ((u32)p[4] << 16);
    b1 = (u32)p[8] | ((u32)p[12] << 16);
  } else {
    const u32* p = reinterpret_cast<const u32*>(xr) + 8 * k + q;
    b0 = p[0];
    b1 = p[4];
  }
}

// acc[ntile] += one step (8 words) of the thread's two rows (g, g + 8) against the block's tokens.
template <int NT, bool E8, bool TIER, bool XNAT>
DEV void compute_step(float (&acc)[NT][4], const Step<2>& st, u32 tlo, u32 thi,
                      const u16* const (&xrow)[NT], int q, int k0) {
  const int q2 = 2 * q;
  u32 tl[2], th[2], sc[2];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (!E8 || (j & 1) == 0) {  // a new scale group: the rows' scales, and the tables pre-scaled
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        int byte = E8 ? (j >> 1) : j;
        sc[r] = scale_pair<E8>(prmt(st.s[r][byte >> 2], 0u, 0x4440u | (byte & 3)));
        if (!TIER) {
          tl[r] = bmul2(tlo, sc[r]);
          th[r] = bmul2(thi, sc[r]);
        }
      }
    }
    u32 xb[NT][2];
#pragma unroll
    for (int t = 0; t < NT; ++t) b_frag<XNAT>(xrow[t], k0 + j, q, xb[t][0], xb[t][1]);
    // row g gives a0 (codes q, q + 4) and a2 (q + 8, q + 12); row g + 8 gives a1 and a3
    u32 wg = word_of(st.w[0][j >> 2], j) >> q2, wh = word_of(st.w[1][j >> 2], j) >> q2;
    u32 a0, a1, a2, a3;
    if (TIER) {
      u32 dg = word_of(st.d[0][j >> 2], j) >> q2, dh = word_of(st.d[1][j >> 2], j) >> q2;
      tier_regs(wg, dg, sc[0], a0, a2);
      tier_regs(wh, dh, sc[1], a1, a3);
    } else {
      base_regs(wg, tl[0], th[0], a0, a2);
      base_regs(wh, tl[1], th[1], a1, a3);
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) mma(acc[t], a0, a1, a2, a3, xb[t][0], xb[t][1]);
  }
}

// The K loop of one warp over words [kb, ke). Base-only decode blocks: two steps in flight (the next
// step's loads are issued before this step's arithmetic). A tier expert (twice the words) and the
// wide prefill blocks (NT > 2, registers taken by the accumulators): one step at a time.
template <int NT, bool E8, bool TIER, bool XNAT>
DEV void k_loop(float (&acc)[NT][4], const u32* const (&wrow)[2], const u32* const (&drow)[2],
                const u8* const (&srow)[2], u32 tlo, u32 thi, const u16* const (&xrow)[NT], int q, int kb,
                int ke) {
  Step<2> a, b;
  if (TIER || NT > 2) {
    for (int k0 = kb; k0 < ke; k0 += 8) {
      load_step<2, E8, TIER>(a, wrow, drow, srow, k0);
      compute_step<NT, E8, TIER, XNAT>(acc, a, tlo, thi, xrow, q, k0);
    }
    return;
  }
  load_step<2, E8, TIER>(a, wrow, drow, srow, kb);
  for (int k0 = kb; k0 < ke; k0 += 16) {
    if (k0 + 8 < ke) load_step<2, E8, TIER>(b, wrow, drow, srow, k0 + 8);
    compute_step<NT, E8, TIER, XNAT>(acc, a, tlo, thi, xrow, q, k0);
    if (k0 + 8 >= ke) break;
    if (k0 + 16 < ke) load_step<2, E8, TIER>(a, wrow, drow, srow, k0 + 16);
    compute_step<NT, E8, TIER, XNAT>(acc, b, tlo, thi, xrow, q, k0 + 8);
  }
}

// One CTA: a block of up to 8 * NT pairs of one expert x 16 output rows of each of TILES tiles (w13:
// 16 gate rows and the 16 matching up rows; w2: 16 down rows). TILES * KS warps: warp w takes tile
// w / KS and the (w % KS)-th part of K; the parts are summed through shared memory. The block is
// either one of align.py's (sorted_pairs, block_expert) or, `direct` (NT 1), pair blockIdx.x alone
// with its expert topk_ids[blockIdx.x] (decode: no sorting at all).
// w13 (TILES 2): act[pair, perm(n)] = bf16(swiglu(gate * s2g, up * s2u)), input row = pair / top_k.
// w2 (TILES 1): out[pair, n] = down * s2 * topk_weight[pair] (fp32), input row = pair.
template <int TILES, int NT, int KS, bool E8, bool XNAT>
__global__ void __launch_bounds__(TILES * KS * 32)
moe_mma(const u16* __restrict__ xin, const int* __restrict__ topk_ids, const int* __restrict__ sorted_pairs,
        const int* __restrict__ block_expert, const long long* __restrict__ delta_experts, int n_tier,
        const u32* __restrict__ base, const u32* __restrict__ delta, const u8* __restrict__ scale,
        const float* __restrict__ scale2, const float* __restrict__ table, const float* __restrict__ topk_w,
        void* __restrict__ out, int top_k, int K, int N, double limit, int has_limit, int direct) {
  constexpr int BM = 8 * NT, W = TILES * KS;
  const int e = direct ? topk_ids[blockIdx.x] : block_expert[blockIdx.x];
  if (e < 0) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int tr = tier_row_of(delta_experts, n_tier, e, lane);
  const int tile = warp / KS, part = warp % KS;
  const int Kw = K >> 4, sk = E8 ? (K >> 5) : (K >> 4);
  const int n0 = blockIdx.y * 16;
  const size_t rows_e = (size_t)TILES * N;
  auto pair_at = [&](int slot) -> int {
    if (direct) return slot == 0 ? (int)blockIdx.x : -1;
    return sorted_pairs[(size_t)blockIdx.x * BM + slot];
  };

  const u32* wrow[2];
  const u32* drow[2];
  const u8* srow[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    size_t row = (size_t)tile * N + n0 + g + 8 * r;
    wrow[r] = base + ((size_t)e * rows_e + row) * Kw;
    drow[r] = delta + ((size_t)(tr < 0 ? 0 : tr) * rows_e + row) * Kw;
    srow[r] = scale + ((size_t)e * rows_e + row) * sk;
  }
  const float* tb = table + ((size_t)e * TILES + tile) * 4;
  const u32 tlo = pack_bf16(tb[0], tb[1]), thi = pack_bf16(tb[2], tb[3]);
  const u16* xrow[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    int p = pair_at(t * 8 + g);
    xrow[t] = p < 0 ? nullptr : xin + (size_t)(TILES == 2 ? p / top_k : p) * K;
  }

  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[t][c] = 0.f;

  const int per = Kw / KS, kb = part * per, ke = kb + per;
  if (tr >= 0)
    k_loop<NT, E8, true, XNAT>(acc, wrow, drow, srow, tlo, thi, xrow, q, kb, ke);
  else
    k_loop<NT, E8, false, XNAT>(acc, wrow, drow, srow, tlo, thi, xrow, q, kb, ke);

  // every tile's parts summed into warp 0
  float sum[TILES][NT][4];
  if (W > 1) {
    __shared__ float red[W > 1 ? W - 1 : 1][NT * 4][32];
    if (warp > 0) {
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int c = 0; c < 4; ++c) red[warp - 1][t * 4 + c][lane] = acc[t][c];
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int i = 0; i < TILES; ++i)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float v = i == 0 ? acc[t][c] : 0.f;
#pragma unroll
          for (int w = (i == 0 ? 1 : 0); w < KS; ++w) v += red[i * KS + w - 1][t * 4 + c][lane];
          sum[i][t][c] = v;
        }
  } else {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) sum[0][t][c] = acc[t][c];
  }

  // C fragment: c0, c1 -> row g, token columns 2q, 2q + 1; c2, c3 -> row g + 8, same columns
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      int p = pair_at(t * 8 + 2 * q + (c & 1));
      if (p < 0) continue;
      int n = n0 + g + 8 * (c >> 1);
      if (TILES == 2) {
        float gv = sum[0][t][c] * scale2[2 * e], uv = sum[TILES - 1][t][c] * scale2[2 * e + 1];
        if (has_limit) {
          float L = (float)limit;
          gv = fminf(gv, L);
          uv = fminf(fmaxf(uv, -L), L);
        }
        float a = gv / (1.0f + __expf(-gv)) * uv;
        reinterpret_cast<u16*>(out)[(size_t)p * N + perm_col(n)] = to_bf16(a);
      } else {
        reinterpret_cast<float*>(out)[(size_t)p * N + n] = sum[0][t][c] * scale2[e] * topk_w[p];
      }
    }
  }
}
