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

import torch

from .activation import swiglu
from .dequant import LayerPlanes, dequant_expert


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
    for e in torch.unique(flat_ids).tolist():
        if e < 0:  # a padding pair (vLLM's -1): no contribution
            continue
        pick = (flat_ids == e).nonzero().squeeze(1)
        w13, w2 = (w.to(x.dtype).float() for w in dequant_expert(planes, e, rows.get(e)))
        t = tokens[pick]
        gate_up = xf[t] @ w13.T
        act = swiglu(gate_up[:, :I], gate_up[:, I:], swiglu_limit).to(x.dtype).float()
        out.index_add_(0, t, (act @ w2.T) * flat_w[pick].unsqueeze(1))
    return out
