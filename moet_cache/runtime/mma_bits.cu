// Device helpers shared by the plane kernels (mma_moe.cu: decode and mid; mma_prefill.cu: prefill):
// PTX wrappers, the table lookup by PRMT, the tier's exact E2M1, the block-scale bytes, and the tier
// row of an expert. mma_moe.py prepends this file to each kernel file before NVRTC compiles it, so
// each fact lives here once. The bit layouts are described at the top of mma_moe.cu and emulated on
// the CPU by tests/test_runtime_mma_bits.py.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

struct alignas(16) U4 { u32 x, y, z, w; };

#define DEV __device__ __forceinline__

// Word i (taken mod 4) of a 16-byte load.
DEV u32 word_of(const U4& v, int i) { return (i & 3) == 0 ? v.x : (i & 3) == 1 ? v.y : (i & 3) == 2 ? v.z : v.w; }

DEV u32 prmt(u32 a, u32 b, u32 s) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}

// a * b on bf16 pairs (exact for a power-of-two b); -0 as the addend keeps -0 products
DEV u32 bmul2(u32 a, u32 b) {
  u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

DEV u32 pack_bf16(float lo, float hi) {
  u32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

DEV u16 to_bf16(float v) {
  u16 d;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(d) : "f"(v));
  return d;
}

DEV void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// An e8m0 block-scale byte as a bf16 pair (both halves the same value): 2^(b - 127) is bf16 bits b << 7
// (b = 0, 2^-127, gives 0). e4m3 bytes take e4m3_two / e4m3_pair below.
DEV u32 e8m0_pair(u32 byte) { return byte * 0x00800080u; }

// The four base codes q, q + 4 (low half of the selector) and q + 8, q + 12 (high half) of a word,
// shifted by 2q, as two register pairs of table values: one LOP3, one IMAD, one SHF, two PRMTs. The
// multiply spreads each byte's code c into nibbles 2c, 2c + 1 (c <= 3: no carry between bytes).
DEV void base_regs(u32 ws, u32 tlo, u32 thi, u32& lo, u32& hi) {
  u32 sel = (ws & 0x03030303u) * 0x22u + 0x10101010u;
  lo = prmt(tlo, thi, sel);
  hi = prmt(tlo, thi, sel >> 16);
}

// e4m3 scale byte -> a bf16 pair of its value x 2^-120: the byte's exponent and mantissa bits moved into
// bf16's places (bias 127 where e4m3 has 7: the 2^-120); e = 0 lands on a bf16 subnormal of the same
// m / 8 x 2^-126, so subnormal scales stay exact. Four integer ops where a general e4m3 conversion takes
// about ten; the tables are pre-multiplied by 2^120 (exact), so table x scale rounds as with the true scale
// (mma_prefill.cu).
DEV u32 e4m3_bits(u32 x) { return ((x << 4) & 0x07F007F0u) | ((x << 8) & 0x80008000u); }  // a byte a half
DEV u32 e4m3_pair_lo(u32 sreg, int byte) {
  return e4m3_bits(prmt(sreg, 0u, 0x4040u | ((byte & 3) << 8) | (byte & 3)));  // the byte at bits 0 and 16
}
#define BF16X2_2P120 0x7B807B80u  // 2^120 in both halves

// An e4m3 scale byte of sreg as its true value's bf16 pair, exactly (subnormal scales too, through a bf16
// subnormal): e4m3_pair_lo times 2^120, five ops where a general conversion takes about ten (the prefill's
// tier experts in natural-layout layers; the other kernels take two at a time, e4m3_two).
DEV u32 e4m3_pair(u32 sreg, int byte) { return bmul2(e4m3_pair_lo(sreg, byte), BF16X2_2P120); }

// Two e4m3 scale bytes of sreg at once (h 0: bytes 0 and 1, h 1: bytes 2 and 3) as the bf16 pair of their
// true values, one a half, exactly as e4m3_pair; prmt(., 0, 0x1010) / prmt(., 0, 0x3232) then gives each
// byte's e4m3_pair (the decode kernels, and the prefill's x4 layers and tiled tier experts: two groups'
// scales converted in the ops of one).
DEV u32 e4m3_two(u32 sreg, int h) {
  return bmul2(e4m3_bits(prmt(sreg, 0u, h ? 0x4342u : 0x4140u)), BF16X2_2P120);
}

// x4 base decode (a layer whose tables are all a x (1, 4, -1, -4): x4_table.py has the layout and the
// why): register r (0..7) of a repacked word -> the bf16 pair s x {1, 4} x scale, sc being the block
// scale's bf16 bits in both halves (a is applied in the fp32 epilogue). r < 7: the mask, then one IMAD
// shifts by r (onto the exponent's bit 1 and the sign) and adds sc. The multiplier's second term,
// 2^(24 + r), puts every product above bit 31 (no effect), but it is not a shift, so ptxas keeps LOP3 +
// IMAD instead of moving the shift ahead of the mask and adding sc as a third instruction. r = 7 (bits
// 0, 1 and 16, 17) takes two shifts at once: e1 to 8 and 14, s to 9 and 15, the strays masked off.
DEV u32 x4_reg(int r, u32 w, u32 sc) {
  if (r < 7) return (w & (0x81008100u >> r)) * (0x01000001u << r) + sc;
  return ((w & 0x00030003u) * 0x4100u & 0x81008100u) * 0x01000001u + sc;
}

// x4_reg for an r known only at run time (mma_prefill.cu: r = q and q + 4), its constants per thread.
struct X4Consts {
  u32 m1, k1, m2, k2;
};
DEV X4Consts x4_consts(int r) {
  return r < 7 ? X4Consts{0x81008100u >> r, 0x01000001u << r, 0xFFFFFFFFu, 1u}
               : X4Consts{0x00030003u, 0x4100u, 0x81008100u, 0x01000001u};
}
DEV u32 x4_reg_rt(const X4Consts& c, u32 w, u32 sc) { return ((w & c.m1) * c.k1 & c.m2) * c.k2 + sc; }

// x4 tier decode (a tier expert of an x4 layer, its base and delta planes both repacked: x4_table.py):
// register r's bf16 pair of exact FP4 values x 2^-8, from its base word wb, its delta word wd and sc, the
// block scale x 2^118 (x4_tier_scale). With k = r >> 1: the base bits moved by r & 1 (r = 7: from bits
// 0, 1, by a multiply and a mask) and the delta bits (of wd >> 8 for odd r) ORed in put s, e1, e0, m at
// bits 15 - 2k, 8 - 2k, 7 - 2k, 6 - 2k; shifted by 2k they are the code's value E2M1 x 2^-126 (bf16
// subnormals for the codes 0 and 0.5), and the multiply by sc is exact. Three to five integer ops a
// register where tier_regs takes about ten. The constants of an r known at compile time (mma_moe.cu)
// fold into the instructions; mma_prefill.cu keeps them in registers (r = q, q + 4).
struct X4Tier {
  u32 mb, kb, mb2, md;
  int s, dshift;
};
DEV X4Tier x4_tier_consts(int r) {
  const int k = r >> 1;
  return r < 7 ? X4Tier{0x81008100u >> r, 1u << (r & 1), 0xFFFFFFFFu, 0x00C000C0u >> (2 * k), 2 * k, 8 * (r & 1)}
               : X4Tier{0x00030003u, 0x104u, 0x02040204u, 0x00030003u, 6, 8};
}
DEV u32 x4_tier_reg(const X4Tier& c, u32 wb, u32 wd, u32 sc) {
  return bmul2(((((wb & c.mb) * c.kb) & c.mb2) | ((wd >> c.dshift) & c.md)) << c.s, sc);
}

// A tier expert's block scale in an x4 layer as x4_tier_reg's sc, from the true scale's bf16 pair: its
// value x 2^118, so the weights come out x 2^-8 (X4_TIER_POST in the epilogue puts it back). e8m0: 118
// added to the exponent, exact for the bytes 3 to x4_table.MAX_TIER_E8M0_BYTE (at 2^-125 and below, the
// weights x 2^-8 fall under bf16's subnormals); e4m3 (448 at most, 2^-9 at least): one bf16 multiply.
template <bool E8>
DEV u32 x4_tier_scale(u32 sc) { return E8 ? sc + 0x3B003B00u : bmul2(sc, 0x7A807A80u); }
#define X4_TIER_POST 256.f

// The fp32 epilogue's factor for an expert's rows of table tile i (tx: the expert's tables, 4 floats a
// tile; tr: its tier row or -1), which the decode left out: a tier expert of a tiled layer (x4 or not,
// x4_tier_reg) 2^8, an x4 base expert its table's a, any other expert 1 (decode and prefill kernels).
template <bool X4, bool TILED>
DEV float decode_factor(int tr, const float* tx, int i) {
  return tr >= 0 ? (TILED ? X4_TIER_POST : 1.f) : X4 ? tx[4 * i] : 1.f;
}

// The e4m3 scale pair of group `byte` (0..3 of sreg) in the decode kernels and the x4 / tiled-tier prefill:
// at an even group, it and the next are converted together into `two` (e4m3_two; an x4 tier expert's
// x4_tier_scale, a multiply a half, on the pair), and each group takes its own by one PRMT. Called for the
// groups in order.
template <bool TIER>
DEV u32 x4_scale_e4(u32 sreg, int byte, u32& two) {
  if ((byte & 1) == 0) {
    two = e4m3_two(sreg, (byte >> 1) & 1);
    if (TIER) two = x4_tier_scale<false>(two);
  }
  return prmt(two, 0u, (byte & 1) ? 0x3232u : 0x1010u);
}

// An e8m0 scale byte of sreg as x4_reg's sc: the byte into both halves by PRMT, then one shift (with the
// multiply of e8m0_pair, ptxas folds the multiply into every x4_reg IMAD and splits the shift out).
DEV u32 x4_scale_e8(u32 sreg, int byte) { return prmt(sreg, 0u, 0x4040u | (byte << 8) | byte) << 7; }

// The same four codes of a tier expert (base and delta words, both shifted by 2q) -> exact E2M1 x scale.
DEV void tier_regs(u32 wb, u32 wd, u32 sc, u32& lo, u32& hi) {
  u32 mb = wb & 0x03030303u;
  u32 sel = (wd & 0x03030303u) * 0x22u + 0x10101010u;
  u32 m7 = mb << 7, m6 = mb << 6;
  // {0, 0.5, 1, 1.5} or {2, 3, 4, 6} by the base's bit 0, the sign from its bit 1 (sign-replicate)
  u32 small0 = prmt(0x3F000000u, 0x3FC03F80u, sel), large0 = prmt(0x40404000u, 0x40C04080u, sel);
  u32 small1 = prmt(0x3F000000u, 0x3FC03F80u, sel >> 16), large1 = prmt(0x40404000u, 0x40C04080u, sel >> 16);
  u32 big0 = prmt(m7, 0u, 0x9988u), big1 = prmt(m7, 0u, 0xBBAAu);
  u32 neg0 = prmt(m6, 0u, 0x9988u), neg1 = prmt(m6, 0u, 0xBBAAu);
  lo = bmul2(((large0 & big0) | (small0 & ~big0)) | (neg0 & 0x80008000u), sc);
  hi = bmul2(((large1 & big1) | (small1 & ~big1)) | (neg1 & 0x80008000u), sc);
}

// The tiles of every layer laid out at load (tiles.py): each 16 rows stored chunk-major, [chunk][16 rows]
// [a row's chunk], a row's chunk being `unit` of its elements (CHUNK_WORDS plane words; 8 e8m0 or 16 e4m3
// scale bytes). Element k of the tile's row i is at this offset from the tile's start, in the same elements.
DEV int tiled_at(int i, int k, int unit) { return (k / unit * 16 + i) * unit + k % unit; }

// Ask the L2 for `bytes` (a multiple of 16, 16-byte aligned) from p, with no register and no completion
// to wait for (sm_90 bulk prefetch; a no-op below): the CTA's whole tile is on its way from DRAM at once,
// where the register loads keep only a chunk or two in flight.
DEV void prefetch_l2(const void* p, u32 bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// Programmatic dependent launch (a kernel launched with it may start before the kernel ahead of it in
// the stream ends): wait_prior blocks until that kernel's writes are visible; let_next_start lets the
// next kernel's CTAs be scheduled. Both are no-ops in a kernel launched without it.
DEV void wait_prior() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
DEV void let_next_start() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// The delta row of expert e: its index in delta_experts, or -1. The warp compares 32 entries a round,
// the loads independent of each other (a binary search would chain five dependent loads before the
// CTA's first weight load: measurable at decode, where every CTA is short).
DEV int tier_row_of(const long long* delta_experts, int n_tier, int e, int lane) {
  for (int i0 = 0; i0 < n_tier; i0 += 32) {
    int i = i0 + lane;
    unsigned hit = __ballot_sync(0xffffffffu, i < n_tier && delta_experts[i] == e);
    if (hit) return i0 + __ffs(hit) - 1;
  }
  return -1;
}

