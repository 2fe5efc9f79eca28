"""The reference model read back from its FP4 checkpoint: its spec, its dense tensors, and the FP4 values
of its routed experts decoded straight from the checkpoint's codes and scales (no cache involved)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from moet_cache.runtime.dequant import E2M1, expand_block_scale

from quality_model.model import ModelSpec, layer_prefix

E2M1_T = torch.tensor(E2M1, dtype=torch.float32)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> [..., n] FP4 codes, the even element in the low nibble."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


@dataclass(frozen=True)
class Checkpoint:
    spec: ModelSpec
    fmt: str                                        # mxfp4 | nvfp4
    dense: dict[str, torch.Tensor]                  # float32, every non-expert tensor
    experts: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: FP4 values w13 [E, 2I, H], w2 [E, H, I]


def _fp4_values(t: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    codes = unpack_nibbles(t[f"{p}.weight"].view(torch.uint8))
    values = E2M1_T[codes.long()]
    if f"{p}.weight_scale_2" in t:
        scale = expand_block_scale(t[f"{p}.weight_scale"], codes.shape[-1]) * t[f"{p}.weight_scale_2"].float()
    else:
        scale = expand_block_scale(t[f"{p}.scale"], codes.shape[-1])
    return values * scale


def read_checkpoint(root: Path) -> Checkpoint:
    cfg = json.loads((root / "config.json").read_text())
    spec = ModelSpec(**cfg["moet_reference_model"])
    t = load_file(str(root / "model-00001-of-00001.safetensors"))
    dense = {n: v.float() for n, v in t.items() if ".mlp.experts." not in n}
    experts = []
    for i in range(spec.layers):
        def proj(e: int, name: str) -> torch.Tensor:
            return _fp4_values(t, f"{layer_prefix(i)}.mlp.experts.{e}.{name}")
        w13 = torch.stack([torch.cat([proj(e, "gate_proj"), proj(e, "up_proj")]) for e in range(spec.experts)])
        w2 = torch.stack([proj(e, "down_proj") for e in range(spec.experts)])
        experts.append((w13, w2))
    fmt = "nvfp4" if any(n.endswith("weight_scale_2") for n in t) else "mxfp4"
    return Checkpoint(spec, fmt, dense, experts)
