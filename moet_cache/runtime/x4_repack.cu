// The x4 layout's bit moves (x4_table.py bit_moves) on the GPU, in place: each plane word of the listed
// experts gets its bits moved by the (mask, shift) groups x4_table._groups gives (22 of them), one
// thread a word at a time, no temporaries: a V4-Flash layer's planes in 4.7 ms on an H200 (about 600 GB/s),
// where the torch ops of the CPU path took 106 ms (docs/RUNTIME.md).
__global__ void x4_move_bits(u32* __restrict__ words, const long long* __restrict__ experts, int per_expert,
                             const u32* __restrict__ masks, const int* __restrict__ shifts, int n_groups) {
  u32* w = words + (size_t)experts[blockIdx.y] * per_expert;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < per_expert; i += gridDim.x * blockDim.x) {
    const u32 v = w[i];
    u32 o = 0;
    for (int g = 0; g < n_groups; ++g) {
      const u32 p = v & masks[g];
      const int s = shifts[g];
      o |= s >= 0 ? p << s : p >> -s;
    }
    w[i] = o;
  }
}
