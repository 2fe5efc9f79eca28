// The x4 layouts' bit moves (x4_table.py bit_moves, delta_bit_moves) on the GPU, in place: each of a
// plane's n words (an int: a V4-Flash base plane has 2^27) gets its bits moved by the (mask, shift) groups
// x4_table._groups gives, one thread a word at a time, no temporaries: a V4-Flash layer's base planes in
// 4.7 ms on an H200 (about 600 GB/s), where the torch ops of the CPU path took 106 ms (docs/RUNTIME.md).
__global__ void x4_move_bits(u32* __restrict__ words, int n, const u32* __restrict__ masks,
                             const int* __restrict__ shifts, int n_groups) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const u32 v = words[i];
    u32 o = 0;
    for (int g = 0; g < n_groups; ++g) {
      const u32 p = v & masks[g];
      const int s = shifts[g];
      o |= s >= 0 ? p << s : p >> -s;
    }
    words[i] = o;
  }
}
