"""The one interface every way of computing a layer's routed experts implements (in the spirit of vLLM's
`FusedMoEExperts`, fused_moe/modular_kernel.py): what it computes (`apply`: the routed pairs of x -> the
layer's output), what it needs (the layer's `LayerPlanes`), and what it supports (`unsupported`: the device,
the pair count, the layer's dims and layout), so that launch.py picks one and calls it the same way.

The implementations: `reference.ReferenceExperts` (plain torch, any device: the CPU runtime and every test's
reference), `mma_moe.DecodeExperts` (the CUDA decode tensor-core kernels), `mma_prefill.PrefillExperts`
(the CUDA prefill tensor-core kernels) and `triton_experts.TritonExperts` (the Triton kernels, where the
others do not run). docs/RUNTIME.md has the table of paths x layer forms x pair ranges."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from .dequant import LayerPlanes
from .plane_layout import LAYOUTS, PlaneLayout


class Experts(ABC):
    """A way to compute one MoE layer's routed experts from its planes."""

    #: the device types (torch.device.type) it runs on
    devices: ClassVar[frozenset[str]]
    #: the layouts it reads as they are; a layer in another is put back to the natural one on every call
    layouts: ClassVar[frozenset[PlaneLayout]] = frozenset(LAYOUTS)
    #: whether it decodes a layer's mid-tier experts at 3 bits (a path that does not refuses such a layer
    #: rather than compute them from their base)
    decodes_mid: ClassVar[bool] = False

    def unsupported(self, planes: LayerPlanes, x: torch.Tensor, pairs: int) -> str | None:
        """Why it cannot run this layer for `pairs` routed pairs of x here, or None where it can. Host-side
        facts only: no device sync (a CUDA graph captures the call)."""
        if planes.has_mid and not self.decodes_mid:
            return f"{type(self).__name__} does not decode the mid tier this layer has"
        if x.device.type not in self.devices:
            return f"{type(self).__name__} does not run on {x.device.type}"
        return self._unsupported(planes, x, pairs)

    def supports(self, planes: LayerPlanes, x: torch.Tensor, pairs: int) -> bool:
        return self.unsupported(planes, x, pairs) is None

    @abstractmethod
    def _unsupported(self, planes: LayerPlanes, x: torch.Tensor, pairs: int) -> str | None:
        """`unsupported` on a device it runs on: the dims, the pair count, the device's capability."""

    @abstractmethod
    def apply(self, x: torch.Tensor, planes: LayerPlanes, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              swiglu_limit: float | None) -> torch.Tensor:
        """[T, H] in x's dtype: sum_k topk_weights[t, k] * down_e(act(gate_e x_t, up_e x_t)), e =
        topk_ids[t, k], for x [T, H] with T > 0 and no padding pair (-1) left (launch.fused_moe_cuda's
        prologue, padding.py); `swiglu_limit` clamps the SwiGLU (activation.swiglu)."""
