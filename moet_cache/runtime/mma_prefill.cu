// Prefill MoE on the planes (many pairs an expert): mma.sync m16n8k16 bf16, fp32 accumulate, with the
// activations staged in shared memory by cp.async, S stages deep, and read by ldmatrix.
// Compiled at first use by NVRTC (mma_prefill.py), after mma_bits.cu (prmt, base_regs, tier_regs,
// e8m0_pair, mma, word_of, tier_row_of).
//
// TILED: each 16-row tile of planes and scales stored chunk-major (tiles.py), which the copies address by
// tiled_at; every layer the kernels take at load, x4 or not.
// X4: planes repacked for the x4 table (x4_table.py; always TILED), base experts decoded by x4_reg with
// the register index (q, q + 4) known at run time (x4_reg_rt), tier experts by x4_tier_reg, the true block
// scale (no 2^-120: no table carries it).
// Roles as in mma_moe.cu: the weights are mma's A operand (16 rows x 16 k: one int32 word of 16 codes
// of each row, decoded in registers by PRMT), the pairs its B operand (8 pairs an n-tile). The K order
// is this file's own (not mma_moe.cu's chunk order): inside each word, mma column 2q + s + 8h stands
// for code q + 4s + 8h, so all four threads of a row take the same word, and the activations are
// stored K-permuted (mma_prefill.k_permuted; w13 writes the intermediate at
// perm_col(n), already permuted for w2). Then one 8x8 ldmatrix matrix of 8 pairs x 8 stored positions
// is exactly a B register: thread (g, q) gets pair g, positions 2q and 2q + 1.
//
// A CTA: one block of BM = 8 NT pairs of one expert (align.py) x 32 W weight rows; W warps, warp w owns
// two m16 tiles (w13: gate rows n0 + 16w.. and the matching up rows, so SwiGLU is in the epilogue;
// w2: down rows n0 + 32w.. and n0 + 32w + 16..) against all NT n-tiles: each decoded A fragment feeds
// NT mmas, each ldmatrix'd B fragment 2 mmas. K goes 128 a stage (8 words a row).
//
// One stage in shared memory (all by cp.async, nothing through registers):
//   x:      BM rows (pairs) x 128 bf16 = 16 chunks of 16 B; chunk c of row r at chunk c ^ (r & 7) (an
//           ldmatrix reads one chunk of 8 consecutive rows: the XOR spreads them over all 32 banks).
//   words:  32 W rows x 8 words; half h (4 words) of row r at half h ^ ((r >> 2) & 1) (a warp's 16-byte
//           reads of rows g = 0..7 then cover the 32 banks once).
//   delta:  the same for a tier expert's delta plane (loaded only for tier experts).
//   scales: 32 W rows x 8 bytes (e4m3: 8 groups of 16; e8m0: 4 groups of 32 in the first 4 bytes).
// Every thread copies its own weight row (32 W threads, 32 W rows) and BM / (2 W) x chunks.

DEV u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// 16 bytes global -> shared, bypassing L1; src_bytes 0 writes zeros (padding pairs) and reads nothing
DEV void cp_async16(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}

template <int BYTES>
DEV void cp_async_small(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(src), "n"(BYTES));
}

DEV void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
DEV void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

DEV void ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}


// K-permuted position of natural index n (the map mma_prefill.k_permuted applies to x): position
// 2q + s + 8h of each 16 holds element q + 4s + 8h, so one u32 of a word's 8 or 16 values is an mma B
// register (elements q, q + 4 or q + 8, q + 12). The w13 kernels here write the intermediate this way.
DEV int perm_col(int n) {
  int o = n & 15;
  return (n & ~15) | ((o & 3) << 1) | ((o >> 2) & 1) | (o & 8);
}

template <int NT, int W>
struct PrefillShape {
  static constexpr int BM = 8 * NT;             // pairs a block
  static constexpr int R = 32 * W;              // weight rows a CTA
  static constexpr int XB = BM * 256;           // x bytes a stage
  static constexpr int WB = R * 32;             // word bytes a stage (each of base, delta)
  static constexpr int SB = R * 8;              // scale bytes a stage
  static constexpr int STAGE = XB + 2 * WB + SB;
  static constexpr int XC = BM * 16 / R;        // x chunks a thread copies a stage
};

// One stage's arithmetic: 8 k16 steps. Thread (g, q) of warp w: m-tile i rows 32w + 16i + g (+ 8).
// A step: fetch (the B fragments of all n-tile pairs by ldmatrix.x4, the thread's 4 words from shared
// memory), decode (scales at a new group, the A fragments by PRMT), the mmas. The mmas of pairs past the
// block's last valid pair are skipped (their rows are zero-filled, so fetching them is harmless).
// PIPE: step j + 1 is fetched before step j's mmas and decoded after them, so the ldmatrix and decode
// latencies hide behind the tensor cores (more registers: one CTA an SM).
template <int NT, bool TIER>
struct PrefillFrag {
  u32 b[NT / 2][4];
  u32 w[2][2], d[2][2];
};

template <int NT, int W, bool E8, bool TIER, bool X4>
struct PrefillStage {
  typedef PrefillShape<NT, W> S;
  const unsigned char* wsp;  // row g of the warp's first m-tile, this stage
  u32 x_row, x_chunk;
  int q2, sw;
  u32 sreg[2][2][2];
  u32 sc[2][2], tl[2][2], th[2][2], two[2][2];
  X4Consts x4lo, x4hi;  // X4: x4_reg_rt's constants for registers q (lo: a0, a1) and q + 4 (hi: a2, a3)
  X4Tier x4tlo, x4thi;  // X4 tier experts: x4_tier_reg's, the same registers

  DEV void fetch(int j, PrefillFrag<NT, TIER>& f) const {
    // chunk 2j (+1 for odd matrices) of the row, XORed as stored: (2j + c) ^ r == (2j << 4 ^ (c ^ r) << 4) >> 4
    const u32 xj = x_row + (x_chunk ^ (u32)(32 * j));
#pragma unroll
    for (int p = 0; p < NT / 2; ++p) ldmatrix_x4(xj + p * 16 * 256, f.b[p][0], f.b[p][1], f.b[p][2], f.b[p][3]);
    const int wo = (((j >> 2) ^ sw) << 4) + 4 * (j & 3);
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int ro = (16 * i + 8 * rr) * 32 + wo;
        f.w[i][rr] = *reinterpret_cast<const u32*>(wsp + ro);
        if (TIER) f.d[i][rr] = *reinterpret_cast<const u32*>(wsp + S::WB + ro);
      }
  }

  DEV void decode(int j, const PrefillFrag<NT, TIER>& f, const u32 (&tlo)[2], const u32 (&thi)[2], u32 (&a)[2][4]) {
    if (!E8 || (j & 1) == 0) {  // a new scale group: the rows' scales, and the tables pre-scaled
      const int byte = E8 ? (j >> 1) : j;
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const u32 sr = sreg[i][rr][byte >> 2];
          if (X4 && !E8) {  // the true scale; groups j and j + 1 converted together
            sc[i][rr] = x4_scale_e4<TIER>(sr, byte & 3, two[i][rr]);
          } else if (X4) {  // the true scale (no 2^-120: there is no table to carry it); tier experts x 2^118
            sc[i][rr] = x4_scale_e8(sr, byte & 3);
            if (TIER) sc[i][rr] = x4_tier_scale<true>(sc[i][rr]);
          } else if (E8) {
            sc[i][rr] = e8m0_pair(prmt(sr, 0u, 0x4440u | (byte & 3)));
          } else {
            sc[i][rr] = TIER ? e4m3_pair(sr, byte) : e4m3_pair_lo(sr, byte);  // base: the tables carry 2^120
          }
          if (!TIER && !X4) {
            tl[i][rr] = bmul2(tlo[i], sc[i][rr]);
            th[i][rr] = bmul2(thi[i], sc[i][rr]);
          }
        }
    }
    // row g gives a0 (codes q, q + 4) and a2 (q + 8, q + 12); row g + 8 gives a1, a3
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (TIER && X4) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          a[i][rr] = x4_tier_reg(x4tlo, f.w[i][rr], f.d[i][rr], sc[i][rr]);
          a[i][rr + 2] = x4_tier_reg(x4thi, f.w[i][rr], f.d[i][rr], sc[i][rr]);
        }
      } else if (TIER) {
        tier_regs(f.w[i][0] >> q2, f.d[i][0] >> q2, sc[i][0], a[i][0], a[i][2]);
        tier_regs(f.w[i][1] >> q2, f.d[i][1] >> q2, sc[i][1], a[i][1], a[i][3]);
      } else if (X4) {  // register q < 7 needs only the mask and the IMAD
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          a[i][rr] = (f.w[i][rr] & x4lo.m1) * x4lo.k1 + sc[i][rr];
          a[i][rr + 2] = x4_reg_rt(x4hi, f.w[i][rr], sc[i][rr]);
        }
      } else {
        base_regs(f.w[i][0] >> q2, tl[i][0], th[i][0], a[i][0], a[i][2]);
        base_regs(f.w[i][1] >> q2, tl[i][1], th[i][1], a[i][1], a[i][3]);
      }
    }
  }

  DEV static void mmas(float (&acc)[2][NT][4], const u32 (&a)[2][4], const PrefillFrag<NT, TIER>& f, int nvalid) {
#pragma unroll
    for (int p = 0; p < NT / 2; ++p) {
      if (16 * p < nvalid) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          mma(acc[i][2 * p], a[i][0], a[i][1], a[i][2], a[i][3], f.b[p][0], f.b[p][1]);
          mma(acc[i][2 * p + 1], a[i][0], a[i][1], a[i][2], a[i][3], f.b[p][2], f.b[p][3]);
        }
      }
    }
  }
};

template <int NT, int W, bool E8, bool TIER, bool PIPE, bool X4>
DEV void prefill_compute(float (&acc)[2][NT][4], const unsigned char* st, const u32 (&tlo)[2],
                         const u32 (&thi)[2], u32 x_row, u32 x_chunk, int warp, int g, int q, int nvalid) {
  typedef PrefillShape<NT, W> S;
  PrefillStage<NT, W, E8, TIER, X4> ps;
  ps.wsp = st + S::XB + (32 * warp + g) * 32;
  ps.x_row = x_row;
  ps.x_chunk = x_chunk;
  ps.q2 = 2 * q;
  if (X4 && TIER) {
    ps.x4tlo = x4_tier_consts(q);
    ps.x4thi = x4_tier_consts(q + 4);
  } else if (X4) {
    ps.x4lo = x4_consts(q);
    ps.x4hi = x4_consts(q + 4);
  }
  ps.sw = (g >> 2) & 1;
  const unsigned char* ssp = st + S::XB + 2 * S::WB + (32 * warp + g) * 8;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int ro = (16 * i + 8 * rr) * 8;
      ps.sreg[i][rr][0] = *reinterpret_cast<const u32*>(ssp + ro);
      ps.sreg[i][rr][1] = E8 ? 0u : *reinterpret_cast<const u32*>(ssp + ro + 4);
    }
  if (PIPE) {
    PrefillFrag<NT, TIER> f[2];
    u32 a[2][2][4];
    ps.fetch(0, f[0]);
    ps.decode(0, f[0], tlo, thi, a[0]);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < 7) ps.fetch(j + 1, f[(j + 1) & 1]);
      ps.mmas(acc, a[j & 1], f[j & 1], nvalid);
      if (j < 7) ps.decode(j + 1, f[(j + 1) & 1], tlo, thi, a[(j + 1) & 1]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      PrefillFrag<NT, TIER> f;
      u32 a[2][4];
      ps.fetch(j, f);
      ps.decode(j, f, tlo, thi, a);
      ps.mmas(acc, a, f, nvalid);
    }
  }
}

// w13 (TILES 2): act[pair, perm(n)] = bf16(swiglu(gate * s2g, up * s2u)), x row = pair / top_k, N = I.
// w2 (TILES 1): out[pair, n] = down * s2 * topk_w[pair] (fp32), x row = pair, N = H.
// Grid: (N / (16 W) for w13 or N / (32 W) for w2, align.py's max_blocks); the n-slices of one block run
// next to each other, so its x rows stay in L2 while all its slices read them.
// MINB: the CTAs an SM the registers are sized for (2: at most 128 a thread with 8 warps).
template <int TILES, int NT, int W, int NS, bool E8, bool PIPE, int MINB, bool X4, bool TILED>
__global__ void __launch_bounds__(W * 32, MINB)
moe_prefill(const u16* __restrict__ xin, const int* __restrict__ sorted_pairs, const int* __restrict__ block_expert,
            const long long* __restrict__ delta_experts, int n_tier, const u32* __restrict__ base,
            const u32* __restrict__ delta, const u8* __restrict__ scale, const float* __restrict__ scale2,
            const float* __restrict__ table, const float* __restrict__ topk_w, void* __restrict__ out, int top_k,
            int K, int N, double limit, int has_limit) {
  typedef PrefillShape<NT, W> S;
  static_assert(S::XC * S::R == S::BM * 16, "x chunks must split evenly over the threads");
  static_assert(NT % 2 == 0, "n-tiles come in pairs (one ldmatrix.x4)");
  static_assert(TILED || !X4, "x4 planes are always tiled");
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int spair[S::BM];

  const int blk = blockIdx.y;
  const int e = block_expert[blk];
  if (e < 0) return;  // the whole CTA: before any barrier
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31, g = lane >> 2, q = lane & 3;
  int pr = -1;
  if (t < S::BM) {
    pr = sorted_pairs[(size_t)blk * S::BM + t];
    spair[t] = pr;
  }
  // align.py puts a block's pairs first and its padding (-1) after them
  const int nvalid = __syncthreads_count(t < S::BM && pr >= 0);
  const int tr = tier_row_of(delta_experts, n_tier, e, lane);
  const int Kw = K >> 4, sk = E8 ? (K >> 5) : (K >> 4);
  const size_t rows_e = (size_t)TILES * N;

  // this thread's copy row: local row t = m-tile t / 16 (warp t / 32, tile (t / 16) % 2), row t % 16
  const int n0 = blockIdx.x * (TILES == 2 ? 16 * W : 32 * W);
  const int mt = t >> 4;
  const size_t grow = TILES == 2 ? (size_t)(mt & 1) * N + n0 + 16 * (mt >> 1) + (t & 15) : (size_t)n0 + t;
  // TILED: the row within its tile of 16 (tiles.py: chunk-major tiles), whose elements tiled_at places
  constexpr int SB = E8 ? 8 : 16;  // a row's scale bytes in a chunk
  const int ti = (int)(grow & 15);
  const size_t trow = TILED ? grow - ti : grow;
  const u32* wsrc = base + ((size_t)e * rows_e + trow) * Kw;
  const u32* dsrc = delta + ((size_t)(tr < 0 ? 0 : tr) * rows_e + trow) * Kw;
  const u8* ssrc = scale + ((size_t)e * rows_e + trow) * sk;
  auto word_at = [&](int k) { return TILED ? tiled_at(ti, k, CHUNK_WORDS) : k; };
  auto scale_at = [&](int k) { return TILED ? tiled_at(ti, k, SB) : k; };
  // element offsets (int: mma_prefill.supported keeps rows x K under 2^31), -1 for padding pairs;
  // 32-bit offsets rather than pointers keep the kernel within 128 registers (two CTAs an SM)
  int xoff[S::XC];
#pragma unroll
  for (int c = 0; c < S::XC; ++c) {
    const int p = spair[(t >> 4) + c * (S::R / 16)];
    xoff[c] = p < 0 ? -1 : (TILES == 2 ? p / top_k : p) * K + (t & 15) * 8;
  }
  const u32 sbase = smem_addr(smem);
  const int wsw = (t >> 2) & 1;

  auto load = [&](int s, int kt) {
    const u32 st = sbase + s * S::STAGE;
#pragma unroll
    for (int c = 0; c < S::XC; ++c) {
      const int row = (t >> 4) + c * (S::R / 16), chunk = t & 15;
      const u32 dst = st + row * 256 + ((chunk ^ (row & 7)) << 4);
      if (xoff[c] >= 0)
        cp_async16(dst, xin + xoff[c] + kt * 128, 16u);
      else
        cp_async16(dst, xin, 0u);
    }
    const u32 wd = st + S::XB + t * 32;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = word_at(kt * 8 + 4 * h);
      cp_async16(wd + ((h ^ wsw) << 4), wsrc + k, 16u);
      if (tr >= 0) cp_async16(wd + S::WB + ((h ^ wsw) << 4), dsrc + k, 16u);
    }
    const u32 sd = st + S::XB + 2 * S::WB + t * 8;
    if (E8)
      cp_async_small<4>(sd, ssrc + scale_at(kt * 4));
    else
      cp_async_small<8>(sd, ssrc + scale_at(kt * 8));
  };

  // tables: m-tile i of w13 is gate (i 0) or up (i 1); w2's two tiles share the one table
  u32 tlo[2], thi[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float* tb = table + ((size_t)e * TILES + (TILES == 2 ? i : 0)) * 4;
    tlo[i] = pack_bf16(tb[0], tb[1]);
    thi[i] = pack_bf16(tb[2], tb[3]);
    if (!E8) {  // e4m3: the scales come as value x 2^-120 (e4m3_pair_lo); exact, far from overflow
      tlo[i] = bmul2(tlo[i], BF16X2_2P120);
      thi[i] = bmul2(thi[i], BF16X2_2P120);
    }
  }
  // ldmatrix row address of this lane: matrix m = lane / 8 (0, 1: pairs 0-7; 2, 3: pairs 8-15; odd m:
  // stored positions 8-15 of the k16 step), row lane % 8; the chunk index XORed by the row as stored
  const int xr = (lane & 7) + ((lane >> 4) << 3);
  const u32 x_chunk = (((lane >> 3) & 1) ^ (lane & 7)) << 4;

  float acc[2][NT][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][n][c] = 0.f;

  const int KT = K >> 7;
#pragma unroll
  for (int s = 0; s < NS - 1; ++s) {
    if (s < KT) load(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<NS - 2>();
    __syncthreads();  // stage kt is in; everyone is done with stage kt - 1, which the next load reuses
    const int nk = kt + NS - 1;
    if (nk < KT) load(nk % NS, nk);
    cp_async_commit();
    const int s = kt % NS;
    const unsigned char* st = smem + s * S::STAGE;
    const u32 x_row = sbase + s * S::STAGE + xr * 256;
    if (tr >= 0)  // a tiled layer's tier experts, x4 or not, take the x4 tier decode (tiles.py)
      prefill_compute<NT, W, E8, true, PIPE, TILED>(acc, st, tlo, thi, x_row, x_chunk, warp, g, q, nvalid);
    else
      prefill_compute<NT, W, E8, false, PIPE, X4>(acc, st, tlo, thi, x_row, x_chunk, warp, g, q, nvalid);
  }
  cp_async_wait<0>();

  // C fragment: c0, c1 -> row g, pair columns 2q, 2q + 1; c2, c3 -> row g + 8
  // times the factors the decode leaves out (decode_factor: gate, up / down)
  const float* tx = table + (size_t)e * TILES * 4;
  const float s2a = scale2[TILES == 2 ? 2 * e : e] * decode_factor<X4, TILED>(tr, tx, 0),
              s2u = TILES == 2 ? scale2[2 * e + 1] * decode_factor<X4, TILED>(tr, tx, 1) : 0.f;
  const float L = (float)limit;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int slot = 8 * n + 2 * q + (c & 1);
      if (slot >= nvalid) continue;
      const int p = spair[slot];
      if (TILES == 2) {
        const int col = n0 + 16 * warp + g + 8 * (c >> 1);
        float gv = acc[0][n][c] * s2a, uv = acc[1][n][c] * s2u;
        if (has_limit) {
          gv = fminf(gv, L);
          uv = fminf(fmaxf(uv, -L), L);
        }
        const float a = gv / (1.0f + __expf(-gv)) * uv;
        reinterpret_cast<u16*>(out)[(size_t)p * N + perm_col(col)] = to_bf16(a);
      } else {
        const float f = s2a * topk_w[p];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int col = n0 + 32 * warp + 16 * i + g + 8 * (c >> 1);
          reinterpret_cast<float*>(out)[(size_t)p * N + col] = acc[i][n][c] * f;
        }
      }
    }
}
