"""The plain torch path: the reference every kernel is tested against, and the CPU runtime.

Weight-only (the layer's input scales, if any, are not used): each routed expert's weights are
dequantized once per call from its planes, and the output is
sum_k topk_weights[t, k] * down_e(act(gate_e x_t, up_e x_t)) accumulated in float32.

Rounding, as a kernel in the activations' dtype does it (vLLM's own MoE kernels: the CPU
`cpu_fused_moe`, the Triton fused_moe): the dequantized weights and the SwiGLU output are held in x's
dtype, products are accumulated in float32. With bf16 activations this equals vLLM's unquantized CPU
kernel on the same values bit for bit (measured on the tiny V4 of tests/test_e2e_vllm.py), so a
lossless cache and the BF16 model of its FP4 values generate the same tokens. With float32
activations nothing is rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .activation import swiglu
from .dequant import LayerPlanes, dequant_expert
from .experts import Experts


def fused_moe_reference(x: torch.Tensor, planes: LayerPlanes, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """float32 [T, H] routed-expert output (the caller casts). Repeated experts in a row count twice; a pair
    whose expert id is -1 (vLLM's padding rows) counts nothing."""
    T, H, I = x.shape[0], planes.hidden, planes.inter
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    if T == 0 or topk_ids.numel() == 0:
        return out
    xf = x.float()
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).float()
    tokens = torch.arange(T, device=x.device).repeat_interleave(topk_ids.shape[1])
    rows = planes.tier_rows()
    # every expert's weights written into the same buffers (and rounded through the same ones in x's dtype):
    # a fresh tensor of this size per expert costs its first touch of every page, more than the decode
    weights = (torch.empty((2 * I, H), device=x.device), torch.empty((H, I), device=x.device))
    rounded = tuple(torch.empty_like(w, dtype=x.dtype) for w in weights) if x.dtype != torch.float32 else None
    for e in torch.unique(flat_ids).tolist():
        if e < 0:  # a padding pair (vLLM's -1): no contribution
            continue
        pick = (flat_ids == e).nonzero().squeeze(1)
        w13, w2 = dequant_expert(planes, e, rows.get(e), out=weights)
        if rounded is not None:  # w.to(x.dtype).float(), in place
            for w, r in zip(weights, rounded):
                w.copy_(r.copy_(w))
        t = tokens[pick]
        gate_up = xf[t] @ w13.T
        act = swiglu(gate_up[:, :I], gate_up[:, I:], swiglu_limit).to(x.dtype).float()
        out.index_add_(0, t, (act @ w2.T) * flat_w[pick].unsqueeze(1))
    return out


@dataclass(frozen=True)
class ReferenceExperts(Experts):
    """fused_moe_reference as an Experts: any device torch runs on, any layer, any layout (each expert's rows
    put back one at a time), padding pairs (-1) and T = 0 included. The CPU runtime."""

    devices = frozenset({"cpu", "cuda"})
    decodes_mid = True

    def _unsupported(self, planes: LayerPlanes, x: torch.Tensor, pairs: int) -> str | None:
        return None

    def apply(self, x: torch.Tensor, planes: LayerPlanes, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              swiglu_limit: float | None) -> torch.Tensor:
        return fused_moe_reference(x, planes, topk_weights, topk_ids, swiglu_limit).to(x.dtype)
