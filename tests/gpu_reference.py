"""The plain torch reference the GPU tests check the kernels against: fused_moe_reference on the CPU for small
T (a kernel's reference is plain torch on the CPU), on the GPU (the same code, float32) from LARGE_T tokens.
The CPU copy of each GPU tensor is made once and kept while the tensor lives unchanged: a layer at
DeepSeek-V4-Flash's dims is about 2 GB: a copy on every call would cost more than the reference itself."""

from __future__ import annotations

import weakref

import torch

from moet_cache.runtime.dequant import LayerPlanes
from moet_cache.runtime.reference import fused_moe_reference

#: from this many tokens the reference runs on the GPU (on the CPU it would dequantize every expert)
LARGE_T = 64


class CpuCopies:
    """CPU copies of GPU tensors, each made once: kept while its tensor lives, made again where the tensor
    changed in place since (its version counter moved)."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[int, torch.Tensor]] = {}  # id(tensor) -> (its version, its copy)

    def of(self, t: torch.Tensor) -> torch.Tensor:
        key = id(t)
        held = self._copies.get(key)
        if held is None:
            # dropped when the tensor dies, before its id can name another
            weakref.finalize(t, self._copies.pop, key, None)
        if held is None or held[0] != t._version:
            held = self._copies[key] = (t._version, t.cpu())
        return held[1]

    def __len__(self) -> int:
        return len(self._copies)


class Reference:
    """reference(x, tensors, topk_weights, topk_ids, swiglu_limit): fused_moe_reference's float32 output on
    x's device, computed on the CPU below LARGE_T tokens (the layer's CPU copies kept), on x's device above."""

    def __init__(self) -> None:
        self.copies = CpuCopies()

    def __call__(self, x: torch.Tensor, t: dict[str, torch.Tensor], w: torch.Tensor, ids: torch.Tensor,
                 limit: float | None) -> torch.Tensor:
        planes = LayerPlanes.from_tensors(t if x.shape[0] >= LARGE_T else {k: self.copies.of(v) for k, v in t.items()})
        dev = planes.w13_base.device
        return fused_moe_reference(x.to(dev), planes, w.to(dev), ids.to(dev), limit).to(x.device)
