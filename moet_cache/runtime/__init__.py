"""MoE on the planes: one routed-expert layer computed from the 2-bit base planes and the FP4 tier.

`fused_moe` takes what `Cache.load(..., expand=False)` yields for a layer (docs/LOADER.md) and the
router's final `topk_weights` / `topk_ids`. Each path implements one interface (`experts.Experts`): CPU
tensors take the plain torch reference (`reference.py`); CUDA tensors the tensor-core plane kernels
(`mma_moe.cu` for decode, `mma_prefill.cu` for prefill; sm_80+), and the Triton kernels
(`triton_experts.py`) where those do not run; `launch.py` picks one. docs/RUNTIME.md has the choices and
the measured figures.
"""

from __future__ import annotations

from .api import fused_moe
from .dequant import E2M1, LayerPlanes, dequant_expert, unpack_plane

__all__ = ["fused_moe", "LayerPlanes", "dequant_expert", "unpack_plane", "E2M1"]
