"""The SwiGLU between the two projections, plain or clamped as vLLM does it for DeepSeek-V4."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """silu(gate) * up; with a limit L, silu(min(gate, L)) * clamp(up, -L, L).

    The clamp is vLLM's `SiluAndMulWithClamp.forward_native` (vllm-project/vllm,
    vllm/model_executor/layers/activation.py, added with DeepSeek-V4 support):
    gate = clamp(x[..., :d], max=L); up = clamp(x[..., d:], min=-L, max=L); silu(gate) * up.
    Only the gate's upper side is clamped.
    """
    if swiglu_limit is not None:
        limit = float(swiglu_limit)
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, min=-limit, max=limit)
    return F.silu(gate) * up
