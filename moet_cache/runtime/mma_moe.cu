// One routed-expert layer on the planes, on tensor cores (mma.sync m16n8k16 bf16, fp32 accumulate):
// the decode kernels (a block of up to 8 * NT pairs of one expert). Compiled at first use by NVRTC
// (mma_moe.py, after mma_bits.cu's helpers); no header is included, so no CUDA toolkit is needed.
//
// Layout facts (docs/FORMAT.md, docs/RUNTIME.md): a plane row is int32 words of 16 codes, element
// 16w + j in bits 2j..2j+1 of word w. The A operand (16 weight rows x 16 k) of one mma is one word of
// each of 16 rows; thread (g = lane / 4, q = lane % 4) holds rows g and g + 8 and in each row the mma
// columns 2q, 2q + 1 (registers a0/a1) and 2q + 8, 2q + 9 (a2/a3); B (16 k x 8 tokens) gives it the
// same columns of token g (b0, b1).
//
// The K order ("chunk mapping"): K is read in chunks of 256 codes (16 words) a row, and thread q reads
// words 4q .. 4q + 3 of each chunk with ONE 16-byte load a row: the four threads of a row read 64
// distinct contiguous bytes and nothing twice. Mma sub-step (i, j) (i: the thread's word, j = 0..3)
// lets column 2q + s + 8h stand for code j + 4s + 8h of word 4q + i. Any mapping is right as long as A
// and B agree (the column decides q, so it may depend on q), and this one keeps a register's two codes
// 8 bits apart: (word >> 2j) & 0x0303 holds codes j and j + 4, (word >> (2j + 16)) & 0x0303 codes j + 8
// and j + 12; the shift is a constant. The activations come K-paired (mma_moe.k_paired, pair_col):
// position 4j + 2h + s of each 16 holds element j + 4s + 8h, so the thread's two 16-byte loads of a
// word's 16 values hold b0, b1 of sub-steps 0..3 as adjacent u32 pairs, as mma takes them (pairing
// natural-order values by PRMT cost 32 ALU ops a chunk: 380 against 358 us at T = 16). The w13
// epilogue writes the intermediate K-paired for w2; x costs one small kernel (pair_rows).
//
// Base code -> bf16 table value, two codes per op: the row's 4-entry table, pre-multiplied by the
// block scale (bf16x2 multiply, once per row and scale group), sits in two registers (8 bytes); PRMT
// picks bytes 2c and 2c + 1 for each code, and the selector is one IMAD: m * 0x22 + 0x1010.
// X4 (a layer built with --base-table x4, its planes repacked at load: x4_table.py): no table; x4_reg
// makes each register from its repacked word with one LOP3 and one IMAD (mma_bits.cu), and the epilogue
// multiplies by the tables' factor a.
// TILED (every layer the kernels take, once laid out at load: tiles.py, layout.py; x4 layers always):
// each 16-row tile of planes and scales is stored chunk-major (Cursor), so that a warp's chunk is one
// contiguous load, and a tier expert's base and delta words carry the x4 layout's bits whatever the
// table: its registers take x4_tier_reg (a few integer ops and one bf16 multiply), and the epilogue the
// 2^8 it leaves out.
// Tier code (base << 2 | delta) -> exact E2M1 (natural layout: a layer handed to fused_moe as loaded): two
// PRMTs into the tables {0, .5, 1, 1.5} and {2, 3, 4, 6} by the delta bits, a select by the base's low bit
// and the sign from its high bit (PRMT sign-replicate mode), then the block scale (exact: E2M1 x power of
// two or e4m3).
//
// Loads in flight: each warp keeps D chunks (D x 1 KB of its 16 rows; a tier expert's delta words too)
// in registers in flight, refilling a chunk's registers as soon as it is computed: D = 2 for one or two
// token columns, 1 for wider blocks and LEAN ones. The loop is bound by the ALU pipe (PRMT, LOP3, SHF:
// Nsight Compute at T = 16), so more warps beat deeper loads: one token column is held to 80 registers
// (6 CTAs of 128 threads an SM), which measured the same as 4 chunks at 128 registers at T = 1 and 4,
// faster from T = 16 (353 against 358 us; T = 64: 862 against 897) and 18% faster with a 10% tier;
// LEAN blocks go further (64 registers, one chunk, 8 CTAs an SM) and ask the L2 for their whole tile at
// the start (prefetch_l2), so that their one chunk waits on the L2, not DRAM (MIN_THREADS_SM).
// The activation loads are volatile so ptxas does not hoist a whole chunk's worth of them (it took up
// to 246 registers). A shared-memory ring filled by cp.async measured no faster (docs/RUNTIME.md).
//
// moe_sum, at the end, sums a token's top-k slots and casts them to the activations' dtype; for few pairs
// the w2 kernel does it instead (sum_when_last, Mma.sum_in_w2).

// The helpers (prmt, base_regs, tier_regs, e8m0_pair, mma, ...) are in mma_bits.cu.

// K-paired position of natural index n (mma_moe.k_paired): position 4j + 2h + s of each 16
// holds element j + 4s + 8h, so a word's u32 2j, 2j + 1 are sub-step j's B registers b0, b1, adjacent
// as mma wants them. The w13 kernels write the intermediate this way.
DEV int pair_col(int n) {
  int o = n & 15;
  return (n & ~15) | ((o & 3) << 2) | ((o >> 3) << 1) | ((o >> 2) & 1);
}


// One chunk of the thread's two rows (g, g + 8): words 4q .. 4q + 3, and their block-scale bytes
// (e8m0: the 2 groups of 32 codes, bytes 2q, 2q + 1 of the chunk's 8; e4m3: the 4 groups of 16, bytes
// 4q .. 4q + 3 of its 16).
struct Chunk {
  U4 w[2];
  u32 s[2];
};

// A plane load: 16 bytes, read once (no L1 allocation), the L2 asked for the 256-byte segment around
// it (the next chunks of the row).
DEV U4 load_words(const u32* p) {
  U4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

DEV U4 load_x(const u16* p) {
  U4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// The thread's words (or scale bytes) of one chunk in rows g (r 0) and g + 8 (r 1), as a pointer moved on
// a chunk at a time (indices turned into addresses at every load took about six instructions
// a load, in a loop whose issue slots bound it at T = 1-2). UNIT: a row's elements in a chunk
// (CHUNK_WORDS plane words; 8 e8m0 or 16 e4m3 scale bytes); `lane`: the thread's first element in it.
// TILED (every layer laid out at load, tiles.py): each 16-row tile is stored chunk-major, [chunk][16 rows]
// [a row's chunk], so a warp's load of a chunk is one contiguous KB where row-major rows scatter it over 16
// (T = 1-64 7-22% faster), and row g + 8 lies a fixed offset after row g (one pointer; the
// offset goes in the load's immediate). Natural layout (a layer as loaded): each row its own pointer.
template <typename T, bool TILED, int UNIT>
struct Cursor {
  const T* p[2];
  DEV Cursor(const T* const (&row)[2], int c, int lane) {  // row[r]: row g / g + 8 at chunk 0
    p[0] = (TILED ? row[0] + tiled_at(0, UNIT * c, UNIT) : row[0] + UNIT * c) + lane;
    p[1] = TILED ? p[0] : row[1] + UNIT * c + lane;
  }
  DEV const T* at(int r) const { return TILED ? p[0] + r * 8 * UNIT : p[r]; }
  DEV void next() {
    p[0] += TILED ? 16 * UNIT : UNIT;
    if (!TILED) p[1] += UNIT;
  }
};
template <bool E8, bool TILED>
using ScaleCursor = Cursor<u8, TILED, E8 ? 8 : 16>;  // a row's scale bytes in a chunk: 256 codes / 32 or / 16
template <bool TILED>
using WordCursor = Cursor<u32, TILED, CHUNK_WORDS>;

// One chunk's plane words and scale bytes (e8m0: the 2 groups of 32 codes, bytes 2q, 2q + 1 of the
// chunk's 8; e4m3: the 4 groups of 16, bytes 4q .. 4q + 3 of its 16); then both cursors move on.
template <bool E8, bool TILED>
DEV void load_chunk(Chunk& ch, WordCursor<TILED>& w, ScaleCursor<E8, TILED>& s) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    ch.w[r] = load_words(w.at(r));
    if (E8)
      ch.s[r] = __ldg(reinterpret_cast<const u16*>(s.at(r)));
    else
      ch.s[r] = __ldg(reinterpret_cast<const u32*>(s.at(r)));
  }
  w.next();
  s.next();
}

// acc[t] += one chunk of the thread's rows against the block's token columns (ACC2: the odd sub-steps
// into acc2[t], for two chains of dependent mma in place of one; k_loop). `dl`: the tier's delta
// words of the same chunk (TIER only). xp[t]: the thread's 64 activations of this chunk in token g of
// tile t, K-paired (k_paired), so a word's u32 2j, 2j + 1 are b0, b1 of sub-step j. live[t] false: a
// padding slot, whose loads are skipped and whose registers (xa, xb) keep what they held: that B
// column's products land only in C columns that are never stored. (Zeroing them every word cost 16
// instructions a chunk; loading another pair's row instead made every warp's activation loads take
// four L1 passes where the live lanes alone take one: T = 1 25.3 -> 32.3 us, T = 64 638.6 -> 1002.6.)
template <int NT, bool E8, bool TIER, bool X4, bool ACC2>
DEV void compute_chunk(float (&acc)[NT][4], float (&acc2)[NT][4], const Chunk& ch, const U4 (&dl)[2], u32 tlo,
                       u32 thi, const u16* const (&xp)[NT], const bool (&live)[NT], U4 (&xa)[NT], U4 (&xb)[NT]) {
  u32 tl[2], th[2], sc[2], two[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (!E8 || (i & 1) == 0) {  // a new scale group: the rows' scales, and the tables pre-scaled
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (!E8) {  // e4m3: groups i and i + 1 converted together (x4 tier experts: x 2^118)
          sc[r] = x4_scale_e4<TIER && X4>(ch.s[r], i, two[r]);
        } else {
          const int byte = E8 ? (i >> 1) : i;
          sc[r] = !X4 ? e8m0_pair(prmt(ch.s[r], 0u, 0x4440u | byte)) : x4_scale_e8(ch.s[r], byte);
          if (TIER && X4) sc[r] = x4_tier_scale<E8>(sc[r]);
        }
        if (!TIER && !X4) {
          tl[r] = bmul2(tlo, sc[r]);
          th[r] = bmul2(thi, sc[r]);
        }
      }
    }
    // token g's 16 activations of word 4q + i: xa sub-steps 0, 1, xb 2, 3
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (live[t]) {
        xa[t] = load_x(xp[t] + 16 * i);
        xb[t] = load_x(xp[t] + 16 * i + 8);
      }
    }
    const u32 wg = word_of(ch.w[0], i), wh = word_of(ch.w[1], i);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // row g gives a0 (codes j, j + 4) and a2 (j + 8, j + 12); row g + 8 gives a1 and a3
      u32 a0, a1, a2, a3;
      if (TIER && X4) {
        const X4Tier lo = x4_tier_consts(j), hi = x4_tier_consts(j + 4);
        a0 = x4_tier_reg(lo, wg, word_of(dl[0], i), sc[0]);
        a2 = x4_tier_reg(hi, wg, word_of(dl[0], i), sc[0]);
        a1 = x4_tier_reg(lo, wh, word_of(dl[1], i), sc[1]);
        a3 = x4_tier_reg(hi, wh, word_of(dl[1], i), sc[1]);
      } else if (TIER) {
        tier_regs(wg >> (2 * j), word_of(dl[0], i) >> (2 * j), sc[0], a0, a2);
        tier_regs(wh >> (2 * j), word_of(dl[1], i) >> (2 * j), sc[1], a1, a3);
      } else if (X4) {
        a0 = x4_reg(j, wg, sc[0]);
        a2 = x4_reg(j + 4, wg, sc[0]);
        a1 = x4_reg(j, wh, sc[1]);
        a3 = x4_reg(j + 4, wh, sc[1]);
      } else {
        base_regs(wg >> (2 * j), tl[0], th[0], a0, a2);
        base_regs(wh >> (2 * j), tl[1], th[1], a1, a3);
      }
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const U4& xv = j < 2 ? xa[t] : xb[t];
        mma(ACC2 && (j & 1) ? acc2[t] : acc[t], a0, a1, a2, a3, word_of(xv, 2 * j), word_of(xv, 2 * j + 1));
      }
    }
  }
}

// The K loop of one warp over chunks [cb, ce); `ch` holds chunks cb .. cb + D - 1 already (issued
// before the tier lookup, which they do not depend on). Each chunk's registers are refilled with the
// chunk D further as soon as it is computed, so D chunks stay in flight; a tier expert's delta words
// likewise (issued once the lookup has found its tier row). ACC2: a second accumulator set takes the
// odd sub-steps, so a chunk's 16 mma are two dependent chains of 8 that a warp waits through while its
// loads are in flight (direct blocks: T = 4 98.7 against 101.3 us, 106.7 against 109.3 with a 10%
// tier; in lean blocks it spilled at 56 registers (T = 16 306.5 against 296.3) and is 1-3% slower at 64).
template <int NT, int D, bool E8, bool TIER, bool X4, bool TILED, bool ACC2>
DEV void k_loop(float (&acc)[NT][4], Chunk (&ch)[D], WordCursor<TILED> w, ScaleCursor<E8, TILED> s,
                const u32* const (&drow)[2], u32 tlo, u32 thi, const u16* xin0, const u16* const (&xrow)[NT], int q,
                int cb, int ce) {
  U4 dl[D][2], xa[NT], xb[NT];
  float acc2[NT][4];
  constexpr int CODES = 16 * CHUNK_WORDS;  // a row's codes (activations) in a chunk
  const u16* xp[NT];  // the thread's activations of chunk c: its words' 4 x 16
  bool live[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    live[t] = xrow[t] != nullptr;
    xp[t] = (live[t] ? xrow[t] : xin0) + CODES * cb + 64 * q;  // a padding slot's: never read
    xa[t] = xb[t] = U4{0u, 0u, 0u, 0u};
#pragma unroll
    for (int c = 0; c < 4; ++c) acc2[t][c] = 0.f;
  }
  WordCursor<TILED> dw(drow, cb, 4 * q);  // w and s are at chunk cb + D already
  if (TIER) {
#pragma unroll
    for (int d = 0; d < D; ++d)
      if (cb + d < ce) {
#pragma unroll
        for (int r = 0; r < 2; ++r) dl[d][r] = load_words(dw.at(r));
        dw.next();
      }
  }
  for (int c0 = cb; c0 < ce; c0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int c = c0 + d;
      if (c < ce) {
        compute_chunk<NT, E8, TIER, X4, ACC2>(acc, acc2, ch[d], dl[d], tlo, thi, xp, live, xa, xb);
#pragma unroll
        for (int t = 0; t < NT; ++t) xp[t] += CODES;
        if (c + D < ce) {
          load_chunk<E8, TILED>(ch[d], w, s);
          if (TIER) {
#pragma unroll
            for (int r = 0; r < 2; ++r) dl[d][r] = load_words(dw.at(r));
            dw.next();
          }
        }
      }
    }
  }
  if (ACC2) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[t][c] += acc2[t][c];
  }
}

// A `direct` block's pairs: the pairs routed to expert e, in pair order, fall into groups of BM; the
// block of a group's first pair (p = blockIdx.x, among the P = gridDim.x pairs) takes the whole group,
// and every other block leaves (`lead` false): an expert routed to several tokens is decoded once for
// them all with no sorting kernels (align.py). Each warp scans topk_ids 32 at a time by ballot (P is at
// most a few hundred in decode). Returns the pair of the lane's slot (lane % BM) or -1 (none).
template <int BM>
DEV int group_pair(const int* __restrict__ ids, int P, int e, int p, int lane, bool& lead) {
  static_assert(BM <= 32 && (BM & (BM - 1)) == 0, "a group fits one warp's lanes");
  const int s = lane & (BM - 1);
  int before = 0, rank = -1, pair = -1;  // before: the matches in earlier rounds; rank: p's among them
  for (int i0 = 0; i0 < P; i0 += 32) {
    const int i = i0 + lane;
    const u32 m = __ballot_sync(0xffffffffu, i < P && ids[i] == e);
    if (rank < 0 && p < i0 + 32) {  // p's round
      rank = before + __popc(m & ((1u << (p - i0)) - 1u));
      if (rank % BM) {
        lead = false;
        return -1;
      }
    }
    if (rank >= 0) {
      const int k = rank + s - before;  // the lane's slot's match, counted within this round
      if (k >= 0 && k < __popc(m)) {  // in this round (in a later one k < 0)
        u32 b = m;
        for (int j = 0; j < k; ++j) b &= b - 1;  // drop the k lowest matches
        pair = i0 + __ffs(b) - 1;
      }
      if (before + __popc(m) >= rank + BM) break;  // every slot found (the same in every lane)
    }
    before += __popc(m);
  }
  lead = true;
  return pair;
}

DEV u16 to_f16(float v) {
  u16 d;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(d) : "f"(v));
  return d;
}

// y[i] = v in the activations' dtype (OUT / y_type: 0 bf16, 1 fp16, 2 fp32)
DEV void store_out(void* y, size_t i, float v, int type) {
  if (type == 2)
    reinterpret_cast<float*>(y)[i] = v;
  else
    reinterpret_cast<u16*>(y)[i] = type == 0 ? to_bf16(v) : to_f16(v);
}

// The w2 kernel's top-k sum, in place of moe_sum (direct blocks): a w2 block has just written its pairs'
// 16 rows of `part`; per pair it counts one arrival for (the pair's token, these 16 rows), and the block
// whose arrival is the token's top_k-th sums the token's top_k slots of these rows, in slot order, into y
// (the same sum in the same order as moe_sum: the same bits). This saves moe_sum's launch and its wait on
// the w2 grid. `arrived` [T, gridDim.y] int32, zeroed by pair_rows, the chain's first kernel. Warp 0 only.
template <int BM, typename PairAt>
DEV void sum_when_last(const float* part, void* y, int* arrived, int y_type, int top_k, int N, int n0, int lane,
                       PairAt pair_at) {
  __threadfence();  // this block's part rows are seen by whichever block sums them
  __syncwarp();
  const int p = lane < BM ? pair_at(lane) : -1;
  const bool last = p >= 0 && atomicAdd(arrived + (size_t)(p / top_k) * gridDim.y + blockIdx.y, 1) == top_k - 1;
  u32 m = __ballot_sync(0xffffffffu, last);
  if (!m) return;
  __threadfence();  // the other blocks' rows, fenced before their arrivals, are read after ours
  while (m) {
    const int t = __shfl_sync(0xffffffffu, p, __ffs(m) - 1) / top_k;
    m &= m - 1;
    if (lane < 16) {
      float v = 0.f;
      for (int k = 0; k < top_k; ++k) v += __ldcg(part + ((size_t)t * top_k + k) * N + n0 + lane);
      store_out(y, (size_t)t * N + n0 + lane, v, y_type);
    }
  }
}

// x -> the K-paired rows the w13 kernel reads (mma_moe.k_paired, pair_col), one group of 16 a thread, and
// `arrived` zeroed for the w2 kernel's sum (sum_when_last). The chain's first kernel, launched plainly (it
// reads x, the router's output); it lets the w13 kernel start at once, which loads its weights meanwhile
// and waits for this kernel before it reads the rows (wait_prior). In place of torch's permute copy, which
// w13 could only follow once it had ended.
__global__ void pair_rows(const u16* __restrict__ x, u16* __restrict__ xp, int groups, int* __restrict__ arrived,
                          int n_arrived) {
  let_next_start();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n_arrived) arrived[i] = 0;
  if (i >= groups) return;
  const U4* src = reinterpret_cast<const U4*>(x) + 2 * (size_t)i;
  const U4 a = src[0], b = src[1];
  const u32 in[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  u32 o[8];
#pragma unroll
  for (int m = 0; m < 8; ++m) {  // word m = positions 2m, 2m + 1 = elements j + 8h, j + 4 + 8h (m = 2j + h)
    const int lo = (m >> 1) + 8 * (m & 1), hi = lo + 4;
    o[m] = prmt(in[lo >> 1], in[hi >> 1], (lo & 1 ? 0x32u : 0x10u) | (hi & 1 ? 0x7600u : 0x5400u));
  }
  U4* dst = reinterpret_cast<U4*>(xp) + 2 * (size_t)i;
  dst[0] = U4{o[0], o[1], o[2], o[3]};
  dst[1] = U4{o[4], o[5], o[6], o[7]};
}

// The threads an SM the decode kernels' registers are sized for (launch bounds), and the chunks each
// warp keeps in flight (see "Loads in flight" above). One token column (NT 1): 768 threads, 80
// registers, two chunks, or LEAN: 1024 threads, 64 registers, one chunk (more warps for fewer loads in
// flight: from 60-80 pairs on by the layer's form, launch.py; 64 registers, where 56 had
// spilled around the loop, 2-4% faster than 56 at T = 16-64, e.g. T = 16 289.3 against 294.8 us). Two
// columns 512 (their activations and accumulators spill at 80); wider blocks one chunk.
#define MIN_THREADS_SM(NT, LEAN) ((NT) == 1 ? ((LEAN) ? 1024 : 768) : 512)
#define CHUNKS_IN_FLIGHT(NT, LEAN) ((NT) <= 2 && !(LEAN) ? 2 : 1)

// One CTA: a block of up to 8 * NT pairs of one expert x 16 output rows of each of TILES tiles (w13:
// 16 gate rows and the 16 matching up rows; w2: 16 down rows). TILES * KS warps: warp w takes tile
// w / KS and the (w % KS)-th part of K; the parts are summed through shared memory. The block is
// either one of align.py's (sorted_pairs, block_expert) or, `direct` (NT 1), the group of up to 8 pairs
// of expert topk_ids[blockIdx.x] that pair blockIdx.x leads (group_pair; decode: no sorting kernels).
// The input rows come K-paired (k_paired). w13 (TILES 2): act[pair, pair_col(n)] = bf16(swiglu(gate * s2g,
// up * s2u)), input row = pair / top_k (w2 reads the intermediate K-paired). w2 (TILES 1): out[pair, n] =
// down * s2 * topk_weight[pair] (fp32), input row = pair.
// ACC2: k_loop's two accumulator sets (mma_moe.two_accumulators says where).
template <int TILES, int NT, int KS, bool E8, bool LEAN, bool X4, bool TILED, bool ACC2>
__global__ void __launch_bounds__(TILES * KS * 32, NT <= 2 && TILES * KS * 32 <= 512 ? MIN_THREADS_SM(NT, LEAN) / (TILES * KS * 32) : 1)
moe_mma(const u16* __restrict__ xin, const int* __restrict__ topk_ids, const int* __restrict__ sorted_pairs,
        const int* __restrict__ block_expert, const long long* __restrict__ delta_experts, int n_tier,
        const u32* __restrict__ base, const u32* __restrict__ delta, const u8* __restrict__ scale,
        const float* __restrict__ scale2, const float* __restrict__ table, const float* __restrict__ topk_w,
        void* __restrict__ out, int top_k, int K, int N, double limit, int has_limit, int direct,
        void* __restrict__ y, int* __restrict__ arrived, int y_type) {
  constexpr int BM = 8 * NT, W = TILES * KS, D = CHUNKS_IN_FLIGHT(NT, LEAN);
  static_assert(TILED || !X4, "x4 planes are always tiled");
  static_assert(!ACC2 || (NT == 1 && !LEAN), "two accumulator sets in one-column blocks that are not lean");
  const int e = direct ? topk_ids[blockIdx.x] : block_expert[blockIdx.x];
  if (e < 0) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int tile = warp / KS, part = warp % KS;
  const int Kw = K >> 4, sk = E8 ? (K >> 5) : (K >> 4);
  const int n0 = blockIdx.y * 16;
  const size_t rows_e = (size_t)TILES * N;

  // the thread's rows g and g + 8 of the tile: where each starts (x4 layers: within their tile, chunk 0)
  const u32* wrow[2];
  const u8* srow[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (TILED) {
      const size_t tile0 = (size_t)e * rows_e + (size_t)tile * N + n0;
      wrow[r] = base + tile0 * Kw + tiled_at(g + 8 * r, 0, CHUNK_WORDS);
      srow[r] = scale + tile0 * sk + tiled_at(g + 8 * r, 0, E8 ? 8 : 16);
    } else {
      const size_t row = (size_t)tile * N + n0 + g + 8 * r;
      wrow[r] = base + ((size_t)e * rows_e + row) * Kw;
      srow[r] = scale + ((size_t)e * rows_e + row) * sk;
    }
  }
  // lean blocks keep one chunk a warp in flight: the tile's planes and scales are asked of the L2 at
  // once, so that the register loads wait on the L2 instead of DRAM (T = 16, x4: 296 against 320 us)
  if (LEAN && part == 0 && lane == 0) {  // a tile is the same 16 rows' bytes in either layout
    const size_t row0 = (size_t)e * rows_e + (size_t)tile * N + n0;
    prefetch_l2(base + row0 * Kw, 16u * Kw * 4u);
    prefetch_l2(scale + row0 * sk, 16u * sk);
  }
  // the first D chunks before anything else: they depend on e alone
  const int per = Kw / CHUNK_WORDS / KS, cb = part * per, ce = cb + per;
  Chunk ch[D];
  WordCursor<TILED> wc(wrow, cb, 4 * q);
  ScaleCursor<E8, TILED> sc(srow, cb, (E8 ? 2 : 4) * q);
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (cb + d < ce) load_chunk<E8, TILED>(ch[d], wc, sc);
  // a direct block's group, once its first loads are on their way (they depend on e alone), kept in
  // shared memory (each warp its own copy) so that no register holds it through the K loop
  __shared__ int group[W][BM];
  if constexpr (NT == 1) {  // direct blocks are one column of 8 pairs (mma_moe.Mma)
    if (direct) {
      bool lead;
      const int pair = group_pair<BM>(topk_ids, gridDim.x, e, blockIdx.x, lane, lead);
      if (!lead) return;
      if (lane < BM) group[warp][lane] = pair;
      __syncwarp();
    }
  }
  auto pair_at = [&](int slot) -> int {
    return direct ? group[warp][slot] : sorted_pairs[(size_t)blockIdx.x * BM + slot];
  };
  const int tr = tier_row_of(delta_experts, n_tier, e, lane);
  const u32* drow[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const size_t row = (size_t)tile * N + n0 + (TILED ? 0 : g + 8 * r);
    drow[r] = delta + ((size_t)(tr < 0 ? 0 : tr) * rows_e + row) * Kw +
              (TILED ? tiled_at(g + 8 * r, 0, CHUNK_WORDS) : 0);
  }
  const float* tb = table + ((size_t)e * TILES + tile) * 4;
  const u32 tlo = pack_bf16(tb[0], tb[1]), thi = pack_bf16(tb[2], tb[3]);
  // the epilogue's factors the decode leaves out (decode_factor: gate, up / down), loaded here so that the
  // loads are long done by then
  const float* tx = table + (size_t)e * TILES * 4;
  const float a_first = decode_factor<X4, TILED>(tr, tx, 0), a_last = decode_factor<X4, TILED>(tr, tx, TILES - 1);
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
  let_next_start();  // launched dependent (Mma.pdl): the next kernel may start loading its weights
  wait_prior();      // xin is the kernel ahead's output

  if (tr >= 0)  // a tiled layer's tier experts, x4 or not, take the x4 tier decode (tiles.py)
    k_loop<NT, D, E8, true, TILED, TILED, ACC2>(acc, ch, wc, sc, drow, tlo, thi, xin, xrow, q, cb, ce);
  else
    k_loop<NT, D, E8, false, X4, TILED, ACC2>(acc, ch, wc, sc, drow, tlo, thi, xin, xrow, q, cb, ce);

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
        float gv = sum[0][t][c] * scale2[2 * e] * a_first, uv = sum[TILES - 1][t][c] * scale2[2 * e + 1] * a_last;
        if (has_limit) {
          float L = (float)limit;
          gv = fminf(gv, L);
          uv = fminf(fmaxf(uv, -L), L);
        }
        float a = gv / (1.0f + __expf(-gv)) * uv;
        reinterpret_cast<u16*>(out)[(size_t)p * N + pair_col(n)] = to_bf16(a);
      } else {
        reinterpret_cast<float*>(out)[(size_t)p * N + n] = sum[0][t][c] * scale2[e] * a_first * topk_w[p];
      }
    }
  }
  if constexpr (TILES == 1 && NT == 1) {
    if (y_type >= 0) sum_when_last<BM>(reinterpret_cast<const float*>(out), y, arrived, y_type, top_k, N, n0,
                                       lane, [&](int slot) { return pair_at(slot); });
  }
}

struct alignas(16) F4 { float x, y, z, w; };

// out[t, h] = the sum over the top_k slots of part[t, slot, h] (fp32, the w2 kernel's), in the
// activations' dtype (OUT: 0 bf16, 1 fp16, 2 fp32): the sum and the cast in one kernel (torch takes
// two, 5 us of a 50 us decode layer). Four values a thread.
template <int OUT>
__global__ void moe_sum(const float* __restrict__ part, void* __restrict__ out, int top_k, int H) {
  const int t = blockIdx.y, h = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
  wait_prior();  // part is the w2 kernel's output (a no-op unless launched dependent)
  if (h >= H) return;
  F4 s{0.f, 0.f, 0.f, 0.f};
  for (int k = 0; k < top_k; ++k) {
    const F4 v = *reinterpret_cast<const F4*>(part + ((size_t)t * top_k + k) * H + h);
    s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
  }
  const size_t o = (size_t)t * H + h;
  if (OUT == 2) {
    *reinterpret_cast<F4*>(reinterpret_cast<float*>(out) + o) = s;
  } else {
    const float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) store_out(out, o + i, v[i], OUT);
  }
}
