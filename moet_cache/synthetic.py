"""A small but faithful DeepSeek-style NVFP4 checkpoint for the demo, the tests and the benchmarks.

Routed and shared experts (and the dense MLPs) are block-quantized NVFP4 from heavy-tailed t(5)
weights; attention, norms, router and embeddings stay BF16; the MTP layer sits past
num_hidden_layers. Both layouts: ModelOpt and compressed-tensors nvfp4-pack-quantized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from safetensors.torch import save_file

from .checkpoint import COMPRESSED_TENSORS, INDEX_NAME, MODELOPT, TENSOR_SUFFIXES
from .fp4 import BLOCK, pack_codes, quantize_to_codes

FP8_MAX = 448.0


@dataclass(frozen=True)
class SyntheticSpec:
    hidden_size: int = 256
    moe_intermediate_size: int = 128
    intermediate_size: int = 512
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    num_experts_per_tok: int = 4
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 1
    num_nextn_predict_layers: int = 1
    vocab_size: int = 512
    layout: str = MODELOPT
    shard_bytes: int = 4 << 20
    seed: int = 0
    fast_codes: bool = False  # sample codes from the quantized distribution instead of quantizing (big sizes)


def spec_for_size(total_bytes: int, layout: str = MODELOPT, seed: int = 0) -> SyntheticSpec:
    """A spec whose routed-expert bytes come close to `total_bytes` (for benchmarks)."""
    H, I, E = 1024, 512, 32
    per_layer = E * 3 * H * I * (0.5 + 1 / 16)
    layers = max(2, int(round(total_bytes / per_layer)))
    return SyntheticSpec(hidden_size=H, moe_intermediate_size=I, intermediate_size=2 * I,
                         n_routed_experts=E, num_experts_per_tok=4, num_hidden_layers=layers + 1,
                         first_k_dense_replace=1, layout=layout, shard_bytes=512 << 20, seed=seed,
                         fast_codes=True, vocab_size=1024)


def quantize_nvfp4(w: np.ndarray) -> tuple[np.ndarray, torch.Tensor, float]:
    """Block-quantize float32 [out, in] to (packed codes, FP8 block scales, global multiply scale)."""
    amax = float(np.abs(w).max()) or 1.0
    global_scale = np.float32(amax / (6.0 * FP8_MAX))
    blocks = w.reshape(w.shape[0], -1, BLOCK)
    block_amax = np.abs(blocks).max(axis=-1)
    scale = torch.from_numpy((block_amax / 6.0 / global_scale).astype(np.float32)).to(torch.float8_e4m3fn)
    denom = scale.to(torch.float32).numpy() * global_scale
    q = blocks / np.where(denom > 0, denom, 1.0)[..., None]
    codes = quantize_to_codes(q.reshape(w.shape))
    return pack_codes(codes), scale, float(global_scale)


class _FastCodes:
    """Samples packed bytes whose codes follow the distribution of quantized t(5) weights."""

    def __init__(self, rng: np.random.Generator) -> None:
        w = rng.standard_t(5, size=(256, 1024)).astype(np.float32)
        packed, scale, _ = quantize_nvfp4(w)
        counts = np.bincount(packed.reshape(-1), minlength=256).astype(np.float64)
        cdf = np.cumsum(counts / counts.sum())
        self.lut = np.searchsorted(cdf, (np.arange(65536) + 0.5) / 65536).clip(0, 255).astype(np.uint8)
        self.scale_bytes = scale.view(torch.uint8).numpy().reshape(-1)

    def codes(self, rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
        u = rng.integers(0, 65536, size=shape, dtype=np.uint16)
        return np.take(self.lut, u)

    def scales(self, rng: np.random.Generator, shape: tuple[int, int]) -> torch.Tensor:
        raw = rng.choice(self.scale_bytes, size=shape)
        return torch.from_numpy(np.ascontiguousarray(raw)).view(torch.float8_e4m3fn)


def _bf16(rng: np.random.Generator, shape: tuple[int, ...], std: float = 0.02) -> torch.Tensor:
    return torch.from_numpy((rng.standard_normal(shape) * std).astype(np.float32)).to(torch.bfloat16)


def _quantized_linear(rng: np.random.Generator, prefix: str, out_dim: int, in_dim: int, layout: str,
                      fast: _FastCodes | None) -> dict[str, torch.Tensor]:
    if fast is not None:
        packed = fast.codes(rng, (out_dim, in_dim // 2))
        scale = fast.scales(rng, (out_dim, in_dim // BLOCK))
        gscale = float(np.float32(rng.uniform(1e-5, 4e-5)))
    else:
        # Heavy tails and a per-row spread, as in trained weights.
        row_std = 0.02 * np.exp(rng.normal(0, 0.3, size=(out_dim, 1)))
        w = (rng.standard_t(5, size=(out_dim, in_dim)) * row_std).astype(np.float32)
        packed, scale, gscale = quantize_nvfp4(w)
    iscale = float(np.float32(rng.uniform(0.5, 2.0) / (6.0 * FP8_MAX)))
    names = TENSOR_SUFFIXES[layout]
    out = {f"{prefix}.{names['codes']}": torch.from_numpy(np.ascontiguousarray(packed)),
           f"{prefix}.{names['block_scale']}": scale}
    if layout == MODELOPT:
        out[f"{prefix}.{names['global_scale']}"] = torch.tensor(gscale, dtype=torch.float32)
        out[f"{prefix}.{names['input_scale']}"] = torch.tensor(iscale, dtype=torch.float32)
    else:
        out[f"{prefix}.{names['global_scale']}"] = torch.tensor([1.0 / gscale], dtype=torch.float32)
        out[f"{prefix}.{names['input_scale']}"] = torch.tensor([1.0 / iscale], dtype=torch.float32)
    return out


def _mlp(rng: np.random.Generator, prefix: str, H: int, inter: int, layout: str,
         fast: _FastCodes | None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    out.update(_quantized_linear(rng, f"{prefix}.gate_proj", inter, H, layout, fast))
    out.update(_quantized_linear(rng, f"{prefix}.up_proj", inter, H, layout, fast))
    out.update(_quantized_linear(rng, f"{prefix}.down_proj", H, inter, layout, fast))
    return out


def _layer_tensors(spec: SyntheticSpec, rng: np.random.Generator, i: int,
                   fast: _FastCodes | None) -> Iterator[dict[str, torch.Tensor]]:
    H, p = spec.hidden_size, f"model.layers.{i}"
    yield {
        f"{p}.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        f"{p}.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        f"{p}.self_attn.q_proj.weight": _bf16(rng, (H, H)),
        f"{p}.self_attn.kv_a_proj_with_mqa.weight": _bf16(rng, (H // 2 + 64, H)),
        f"{p}.self_attn.o_proj.weight": _bf16(rng, (H, H)),
    }
    is_moe = i >= spec.first_k_dense_replace
    if not is_moe:
        yield _mlp(rng, f"{p}.mlp", H, spec.intermediate_size, spec.layout, fast)
        return
    E, I = spec.n_routed_experts, spec.moe_intermediate_size
    yield {f"{p}.mlp.gate.weight": _bf16(rng, (E, H)),
           f"{p}.mlp.gate.e_score_correction_bias": torch.zeros(E, dtype=torch.float32)}
    if spec.n_shared_experts:
        yield _mlp(rng, f"{p}.mlp.shared_experts", H, I * spec.n_shared_experts, spec.layout, fast)
    for e in range(E):
        yield _mlp(rng, f"{p}.mlp.experts.{e}", H, I, spec.layout, fast)
    if i >= spec.num_hidden_layers:  # the MTP layer's own parts
        yield {f"{p}.enorm.weight": torch.ones(H, dtype=torch.bfloat16),
               f"{p}.hnorm.weight": torch.ones(H, dtype=torch.bfloat16),
               f"{p}.eh_proj.weight": _bf16(rng, (H, 2 * H)),
               f"{p}.shared_head.norm.weight": torch.ones(H, dtype=torch.bfloat16)}


def _all_tensors(spec: SyntheticSpec) -> Iterator[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(spec.seed)
    fast = _FastCodes(rng) if spec.fast_codes else None
    yield {"model.embed_tokens.weight": _bf16(rng, (spec.vocab_size, spec.hidden_size))}
    for i in range(spec.num_hidden_layers + spec.num_nextn_predict_layers):
        yield from _layer_tensors(spec, rng, i, fast)
    yield {"model.norm.weight": torch.ones(spec.hidden_size, dtype=torch.bfloat16),
           "lm_head.weight": _bf16(rng, (spec.vocab_size, spec.hidden_size))}


def config_for(spec: SyntheticSpec) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "moe_intermediate_size": spec.moe_intermediate_size, "n_routed_experts": spec.n_routed_experts,
        "n_shared_experts": spec.n_shared_experts, "num_experts_per_tok": spec.num_experts_per_tok,
        "num_hidden_layers": spec.num_hidden_layers, "first_k_dense_replace": spec.first_k_dense_replace,
        "moe_layer_freq": 1, "num_nextn_predict_layers": spec.num_nextn_predict_layers,
        "vocab_size": spec.vocab_size, "num_attention_heads": 4, "num_key_value_heads": 4,
        "kv_lora_rank": spec.hidden_size // 2, "q_lora_rank": None, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64, "v_head_dim": 64, "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }
    if spec.layout == MODELOPT:
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                      "ignore": ["lm_head", "*self_attn*", "*mlp.gate"]}
    elif spec.layout == COMPRESSED_TENSORS:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"format": "nvfp4-pack-quantized", "targets": ["Linear"],
                                          "weights": {"num_bits": 4, "type": "float", "group_size": 16}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"]}
    else:
        raise ValueError(f"unknown layout {spec.layout}")
    return cfg


def make_checkpoint(path: str | Path, spec: SyntheticSpec | None = None) -> Path:
    """Write a sharded checkpoint (index, config.json, shards) at `path` and return it."""
    spec = spec or SyntheticSpec()
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for group in _all_tensors(spec):
        nbytes = sum(t.numel() * t.element_size() for t in group.values())
        if sizes[-1] and sizes[-1] + nbytes > spec.shard_bytes:
            _flush(root, shards, sizes)
        shards[-1].update(group)
        sizes[-1] += nbytes
    return _finish(root, spec, shards, sizes)


def _flush(root: Path, shards: list[dict[str, torch.Tensor]], sizes: list[int]) -> None:
    # Shards are written under a temporary name and renamed once the count is known.
    save_file(shards[-1], str(root / f".shard-{len(shards):05d}"), metadata={"format": "pt"})
    shards[-1] = {name: torch.empty(0) for name in shards[-1]}  # keep names, drop data
    shards.append({})
    sizes.append(0)


def _finish(root: Path, spec: SyntheticSpec, shards: list[dict[str, torch.Tensor]], sizes: list[int]) -> Path:
    if shards[-1]:
        _flush(root, shards, sizes)
    shards = [s for s in shards if s]
    n = len(shards)
    weight_map = {}
    for k, names in enumerate(shards, start=1):
        final = f"model-{k:05d}-of-{n:05d}.safetensors"
        (root / f".shard-{k:05d}").rename(root / final)
        weight_map.update({name: final for name in names})
    total = sum(sizes)
    (root / INDEX_NAME).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    (root / "config.json").write_text(json.dumps(config_for(spec), indent=1))
    if spec.layout == MODELOPT:
        (root / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "synthetic"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                             "exclude_modules": ["lm_head"]}}, indent=1))
    (root / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return root


def small_spec(layout: str = MODELOPT, **overrides: Any) -> SyntheticSpec:
    """The embedded default (demo and tests), in either layout."""
    return replace(SyntheticSpec(layout=layout), **overrides)
