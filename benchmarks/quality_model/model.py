"""The reference model: a small DeepSeek-V3-style MoE language model over bytes, as plain torch functions.

Every layer: RMSNorm -> causal multi-head attention with RoPE -> RMSNorm -> MoE (a softmax router over the
routed experts, top-k, the chosen weights renormalized to sum 1, plus one always-on shared expert; every
expert a SwiGLU). The vocabulary is the 256 byte values. Weights are held under the DeepSeek-V3
checkpoint names (`model.layers.L.mlp.experts.E.gate_proj.weight`, ...), so the training script, the
checkpoints and the quality ladder share one forward: `forward` computes everything but the routed
experts, which it asks of `routed(layer, x, topk_weights, topk_ids)`, so the ladder runs them through the
cache (moet_cache.runtime.fused_moe) and training through its own (fake-quantized) weights.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

Routed = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    vocab: int = 256
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    experts: int = 32
    top_k: int = 4
    expert_width: int = 128
    shared_width: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}"


def dense_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor but the routed experts', by checkpoint name."""
    H, V, S, E = spec.hidden, spec.vocab, spec.shared_width, spec.experts
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(spec.layers):
        p = layer_prefix(i)
        shapes[f"{p}.input_layernorm.weight"] = (H,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (H,)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{proj}.weight"] = (H, H)
        shapes[f"{p}.mlp.gate.weight"] = (E, H)
        shapes[f"{p}.mlp.shared_experts.gate_proj.weight"] = (S, H)
        shapes[f"{p}.mlp.shared_experts.up_proj.weight"] = (S, H)
        shapes[f"{p}.mlp.shared_experts.down_proj.weight"] = (H, S)
    shapes["model.norm.weight"] = (H,)
    shapes["lm_head.weight"] = (V, H)
    return shapes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding on [B, heads, T, d] (rotating the two halves of each head)."""
    T, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def attention(w: Mapping[str, torch.Tensor], p: str, x: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    B, T, H = x.shape
    nh, hd = spec.heads, H // spec.heads

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(B, T, nh, hd).transpose(1, 2)
    q = rope(heads(x @ w[f"{p}.self_attn.q_proj.weight"].T), spec.rope_theta)
    k = rope(heads(x @ w[f"{p}.self_attn.k_proj.weight"].T), spec.rope_theta)
    v = heads(x @ w[f"{p}.self_attn.v_proj.weight"].T)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(B, T, H) @ w[f"{p}.self_attn.o_proj.weight"].T


def swiglu_mlp(w: Mapping[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    gate = x @ w[f"{p}.gate_proj.weight"].T
    up = x @ w[f"{p}.up_proj.weight"].T
    return (F.silu(gate) * up) @ w[f"{p}.down_proj.weight"].T


def route(gate_weight: torch.Tensor, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router probabilities [T, E], normalized top-k weights [T, k], top-k ids [T, k]) for x [T, H]."""
    probs = torch.softmax((x @ gate_weight.T).float(), dim=-1)
    top_w, top_ids = probs.topk(top_k, dim=-1)
    return probs, top_w / top_w.sum(-1, keepdim=True), top_ids


@dataclass(frozen=True)
class RouterTrace:
    """One MoE layer's routing in a forward: what a routing profile and the load-balancing loss need."""

    layer: int
    probs: torch.Tensor      # [T, E]
    topk_ids: torch.Tensor   # [T, k]


def forward(w: Mapping[str, torch.Tensor], spec: ModelSpec, tokens: torch.Tensor, routed: Routed,
            trace: list[RouterTrace] | None = None) -> torch.Tensor:
    """Next-token logits [B, T, vocab] for byte tokens [B, T] (int64)."""
    B, T = tokens.shape
    x = w["model.embed_tokens.weight"][tokens]
    for i in range(spec.layers):
        p = layer_prefix(i)
        x = x + attention(w, p, rms_norm(x, w[f"{p}.input_layernorm.weight"], spec.norm_eps), spec)
        h = rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], spec.norm_eps).reshape(B * T, -1)
        probs, top_w, top_ids = route(w[f"{p}.mlp.gate.weight"], h, spec.top_k)
        if trace is not None:
            trace.append(RouterTrace(i, probs, top_ids))
        moe = swiglu_mlp(w, f"{p}.mlp.shared_experts", h) + routed(i, h, top_w.to(h.dtype), top_ids)
        x = x + moe.view(B, T, -1)
    x = rms_norm(x, w["model.norm.weight"], spec.norm_eps)
    return x @ w["lm_head.weight"].T


def routed_from_weights(w13: torch.Tensor, w2: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Routed experts from stacked weights w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]:
    sum_k topk_weights * down(silu(gate x) * up x), the same sum moet_cache's reference computes."""
    inter = w2.shape[-1]

    def run(x: torch.Tensor, top_w: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        tokens = torch.arange(x.shape[0]).repeat_interleave(top_ids.shape[1])
        flat_ids, flat_w = top_ids.reshape(-1), top_w.reshape(-1)
        for e in torch.unique(flat_ids).tolist():
            pick = (flat_ids == e).nonzero().squeeze(1)
            t = tokens[pick]
            gu = x[t] @ w13[e].T
            act = F.silu(gu[:, :inter]) * gu[:, inter:]
            out = out.index_add(0, t, (act @ w2[e].T) * flat_w[pick].unsqueeze(1))
        return out
    return run


def init_dense(spec: ModelSpec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Initial dense weights: N(0, 0.02) matrices (output projections scaled by 1/sqrt(2 layers)), unit norms."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in dense_shapes(spec).items():
        if len(shape) == 1:
            out[name] = torch.ones(shape)
        else:
            std = 0.02 / math.sqrt(2 * spec.layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            out[name] = torch.randn(shape, generator=gen) * std
    return out
