"""`fused_moe`: the one entry point (the vLLM method's `apply` calls it)."""

from __future__ import annotations

import torch

from ..errors import InputError
from .dequant import LayerPlanes
from .launch import fused_moe_on_device


def _check_routing(x: torch.Tensor, planes: LayerPlanes, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] != planes.hidden:
        raise InputError(f"x {tuple(x.shape)} is not [tokens, {planes.hidden}]")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise InputError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [{x.shape[0]}, top_k]")
    # On a GPU this check would cost a device sync per call (and break graph capture): CPU only. -1 marks
    # a pair to skip (vLLM's padding rows, padding.py).
    if not x.is_cuda and topk_ids.numel() and (int(topk_ids.min()) < -1
                                               or int(topk_ids.max()) >= planes.num_experts):
        raise InputError(f"topk_ids outside 0..{planes.num_experts - 1} (and -1, a pair to skip)",
                         "ids index the layer's own experts: under expert parallelism map the router's global "
                         "ids to local ones first (runtime.padding.to_local)")


def fused_moe(x: torch.Tensor, tensors: dict[str, torch.Tensor], topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, swiglu_limit: float | None = None) -> torch.Tensor:
    """Routed experts of one MoE layer from its planes: [T, H] in x's dtype.

    `tensors` is what `Cache.load(..., expand=False)` yields for the layer; `topk_weights` are applied
    as given (vLLM's router has folded routed_scaling_factor into them); `swiglu_limit` clamps the
    SwiGLU as vLLM's SiluAndMulWithClamp (None: plain silu(gate) * up).
    """
    planes = LayerPlanes.from_tensors(tensors)
    _check_routing(x, planes, topk_weights, topk_ids)
    return fused_moe_on_device(x, planes, topk_weights, topk_ids, swiglu_limit)
