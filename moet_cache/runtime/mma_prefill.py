"""The prefill tensor-core plane kernels (mma_prefill.cu): many pairs an expert, the activations staged
in shared memory by cp.async several stages deep and read by ldmatrix, the weights decoded in registers
as in mma_moe.cu. Pairs sorted into blocks of one expert by align.py. CUDA only, sm_80+ (cp.async,
ldmatrix, mma.sync bf16)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import torch

from .align import align_pairs
from .dequant import LayerPlanes
from .experts import Experts

from .mma_moe import Operands, sum_slots

from .nvrtc import compiled, runs_here
from .plane_layout import PlaneLayout


#: K a pipeline stage (8 words of 16 codes a row)
STAGE_K = 128


def k_permuted(x: torch.Tensor) -> torch.Tensor:
    """bf16 [T, K] with position 2q + s + 8h of each 16 holding element q + 4s + 8h (mma_prefill.cu perm_col):
    one u32 of it is an mma B register of the prefill kernels."""
    T, K = x.shape
    return x.to(torch.bfloat16).view(T, K // 16, 2, 2, 4).transpose(-1, -2).reshape(T, K).contiguous()


@dataclass(frozen=True)
class Prefill:
    """A CTA: a block of 8 * nt pairs of one expert x 32 * warps weight rows (w13: 16 * warps gate rows
    and the matching up rows; w2: 32 * warps down rows), `stages` cp.async stages of 128 K; `pipe`: the
    fragments of the next k16 step fetched while this one computes; `ctas`: the CTAs an SM the compiler
    sizes the registers for."""

    nt: int = 8
    warps: int = 8
    stages: int = 3
    pipe: bool = False  # fetch step j + 1 before step j's mmas (more registers)
    ctas: int = 2       # CTAs an SM the registers are sized for (__launch_bounds__)

    def __post_init__(self) -> None:
        # 4 and 8 warps are the shapes tested on the GPU; 2 warps computed wrong results on the H200
        if (self.nt % 2 or self.nt < 2 or self.stages < 2 or self.warps not in (4, 8)
                or (8 * self.nt * 16) % (32 * self.warps) or self.ctas < 1):
            raise ValueError(f"unsupported prefill block {self}")

    def smem_bytes(self) -> int:
        """Dynamic shared memory: x (8 nt rows x 256 B), base and delta words (32 B a row), scales (8 B)."""
        rows = 32 * self.warps
        return self.stages * (8 * self.nt * 256 + rows * (2 * 32 + 8))


def smem_limit(device: torch.device) -> int:
    """The dynamic shared memory a CTA may opt in to on this CUDA device: 227 KB on sm_90 (H100, H200) and
    sm_100, 163 KB on sm_80, 99 KB on sm_86, sm_89 and sm_120 (RTX PRO 6000)."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 49152)


def within(block: Prefill, limit: int) -> Prefill | None:
    """`block`, or the same with fewer stages where it takes more shared memory than `limit` bytes, or None
    where two stages do not fit. Refused, a step would send the layer to the Triton kernels, which read the
    natural layout only: the layer's planes put back on every call. A Prefill(4, 8, 4) takes 104 KB, which
    the RTX PRO 6000's 99 KB refuse; the steps in use take 84 KB at most (docs/RUNTIME.md)."""
    for stages in range(block.stages, 1, -1):
        fit = replace(block, stages=stages)
        if fit.smem_bytes() <= limit:
            return fit
    return None


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def supported(planes: LayerPlanes, x: torch.Tensor, P: int, block: Prefill) -> bool:
    """Whether these kernels run this layer here: sm_80+, NVRTC, K a multiple of a stage, the rows split
    into whole CTAs, 16-byte aligned planes (cp.async), activation offsets within int32, and the shared
    memory the device allows. Host-side facts only (no sync)."""
    dev = x.device
    if not runs_here(dev):
        return False
    H, I = planes.hidden, planes.inter
    if H % STAGE_K or I % STAGE_K or I % (16 * block.warps) or H % (32 * block.warps):
        return False
    if max(x.shape[0] * H, P * I) >= 1 << 31 or P // (8 * block.nt) + planes.num_experts > 65535:
        return False  # int32 activation offsets; the blocks are gridDim.y
    if block.smem_bytes() > smem_limit(dev):
        return False
    tensors = [planes.w13_base, planes.w2_base, planes.w13_scale, planes.w2_scale]
    if planes.delta_experts.numel():
        tensors += [planes.w13_delta, planes.w2_delta]
    return all(t.is_contiguous() for t in tensors) and _aligned(*tensors)


def kernel_name(block: Prefill, tiles: int, e8m0: bool, layout: PlaneLayout) -> str:
    """The moe_prefill instantiation of `block` for w13 (tiles 2) or w2 (tiles 1), as mma_moe.kernel_name."""
    flags = ", ".join(str(f).lower() for f in (e8m0, block.pipe))
    return (f"moe_prefill<{tiles}, {block.nt}, {block.warps}, {block.stages}, {flags}, {block.ctas}, "
            f"{str(layout.x4).lower()}, {str(layout.tiled).lower()}>")


@lru_cache(maxsize=None)
def _kernel(name: str, smem: int, device: int) -> Any:
    """The kernel of this name, compiled by NVRTC and loaded once a process and device, its dynamic
    shared-memory limit raised to what it uses."""
    k = compiled("mma_prefill.cu", name, device)
    if hasattr(k, "set_shared_memory_config"):
        k.set_shared_memory_config(smem)
    elif smem >= 48 * 1024:  # older torch: the attribute set directly (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
        from torch.cuda._utils import _get_gpu_runtime_library
        _get_gpu_runtime_library().cuFuncSetAttribute(k.func, 8, smem)
        k._max_shared_mem_bytes = smem
    return k


def fused_moe_prefill(x: torch.Tensor, planes: LayerPlanes, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      swiglu_limit: float | None, block: Prefill) -> torch.Tensor:
    """[T, top_k, H] float32 per pair (already weighted), for T > 0."""
    T, H, I, E = x.shape[0], planes.hidden, planes.inter, planes.num_experts
    top_k = topk_ids.shape[1]
    P, dev = T * top_k, x.device
    blocks = align_pairs(topk_ids, E, 8 * block.nt)
    ops = Operands.of(planes, topk_weights)
    xin = k_permuted(x)  # the stored K order of the B operand (mma_prefill.cu)
    act = torch.empty((P, I), dtype=torch.bfloat16, device=dev)
    out = torch.empty((P, H), dtype=torch.float32, device=dev)
    limit = 0.0 if swiglu_limit is None else float(swiglu_limit)
    smem = block.smem_bytes()
    threads = 32 * block.warps
    with torch.cuda.device(dev):  # the compile loads into, and the launch uses, dev's context
        k13 = _kernel(kernel_name(block, 2, ops.e8m0[0], planes.layout), smem, dev.index)
        k13(grid=(I // (16 * block.warps), blocks.max_blocks, 1), block=(threads, 1, 1), shared_mem=smem,
            args=[xin, blocks.sorted_pairs, blocks.block_expert, *ops.layer_args(0), act,
                  top_k, H, I, limit, int(swiglu_limit is not None)])
        k2 = _kernel(kernel_name(block, 1, ops.e8m0[1], planes.layout), smem, dev.index)
        k2(grid=(H // (32 * block.warps), blocks.max_blocks, 1), block=(threads, 1, 1), shared_mem=smem,
           args=[act, blocks.sorted_pairs, blocks.block_expert, *ops.layer_args(1), out,
                 top_k, I, H, 0.0, 0])
    return out.view(T, top_k, H)


@dataclass(frozen=True)
class PrefillExperts(Experts):
    """The prefill tensor-core kernels with one block (`Prefill`) as an Experts: CUDA sm_80+, the pair counts,
    dims, alignment and shared memory `supported` takes, any layout. The output is the kernels' per-pair
    rows summed over the top-k slots (mma_moe.sum_slots)."""

    block: Prefill
    devices = frozenset({"cuda"})

    def _unsupported(self, planes: LayerPlanes, x: torch.Tensor, pairs: int) -> str | None:
        if not supported(planes, x, pairs, self.block):
            return (f"the prefill kernels of {self.block} do not run {pairs} pairs of hidden {planes.hidden}, "
                    f"width {planes.inter} here")
        return None

    def apply(self, x: torch.Tensor, planes: LayerPlanes, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              swiglu_limit: float | None) -> torch.Tensor:
        return sum_slots(fused_moe_prefill(x, planes, topk_weights, topk_ids, swiglu_limit, self.block), x.dtype)
