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
from ..format.formats import e8m0_to_e4m3
from ..format.fp4 import BLOCK, pack_codes, quantize_to_codes
from ..fsutil import atomic_write_bytes
from ..stwriter import SafetensorsWriter, TensorSpec

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


def make_checkpoint(path: str | Path, spec: SyntheticSpec | V4Spec | None = None) -> Path:
    """Write a sharded checkpoint (index, config.json, shards) at `path` and return it (a V4Spec: the
    DeepSeek-V4 family, make_v4_checkpoint)."""
    if isinstance(spec, V4Spec):
        return make_v4_checkpoint(path, spec)
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


# === DeepSeek-V4 =====================================================================================
# A small but faithful DeepSeek-V4-Flash checkpoint (DEEPSEEK_V4.md): V4 names (layers.L.ffn.experts.E.w1/w3/w2,
# no model. prefix), every main layer MoE, hash-routed first layers (ffn.gate.tid2eid int32, no gate bias),
# FP8 attention and shared experts with e8m0 block scales (or BF16 dense: the vLLM-loadable variant),
# routed experts MXFP4 (official release) or NVFP4 cast losslessly from MXFP4 (e4m3 block scales exact
# powers of two equal in pairs; NVIDIA Model-Optimizer's examples/deepseek/cast_mxfp4_to_nvfp4.py:
# weight_scale_2 = 2^m with m = max(k_max(w1), k_max(w3)) - 8 for the w1/w3 pair, k_max - 8 for w2,
# e4m3 = 2^(k - m); the generator keeps every block inside e4m3's window, so the cast is exact),
# drafter blocks mtp.K (MXFP4 in the -0731 hybrid), compress_ratios, a tokenizer stub and encoding/.

V4_MAIN_FORMATS = (MODELOPT, COMPRESSED_TENSORS, "mxfp4")


@dataclass(frozen=True)
class V4Spec:
    hidden_size: int = 256
    moe_intermediate_size: int = 128
    n_routed_experts: int = 16
    num_experts_per_tok: int = 4
    n_shared_experts: int = 1
    num_hidden_layers: int = 4
    num_hash_layers: int = 1
    mtp_blocks: int = 1                     # drafter blocks written (mtp.0 ...); -0731 ships 3
    drafter: str = "mtp"                    # mtp (each block its e/h_proj and head) | dspark (one head stack)
    dspark_markov_rank: int = 32            # DSpark: the Markov head's rank
    dspark_target_layer_ids: tuple[int, ...] = (1, 2)   # DSpark: target layers main_proj concatenates
    num_nextn_predict_layers: int = 1
    compress_ratios: tuple[int, ...] | None = None   # None: [0, 4, 128, 4, 128, ...] then the drafters'
    vocab_size: int = 512
    num_attention_heads: int = 4
    head_dim: int = 128
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 128
    o_lora_rank: int = 64
    o_groups: int = 2
    index_n_heads: int = 4
    index_head_dim: int = 64
    index_topk: int = 64
    sliding_window: int = 128
    hc_mult: int = 4
    main_format: str = MODELOPT             # modelopt | compressed-tensors | mxfp4 (main-layer experts)
    mtp_format: str = "mxfp4"               # drafter experts (-0731: MXFP4 beside NVFP4 main layers)
    dense: str = "fp8"                      # fp8 (attention and shared experts FP8 + e8m0 scales) | bf16
    shard_bytes: int = 4 << 20
    seed: int = 0
    fast_codes: bool = False

    def ratios(self) -> tuple[int, ...]:
        if self.compress_ratios is not None:
            return self.compress_ratios
        main = tuple(0 if i == 0 else 4 if i % 2 == 1 else 128 for i in range(self.num_hidden_layers))
        return main + (0,) * max(self.mtp_blocks, self.num_nextn_predict_layers)


def small_v4_spec(variant: str = "hybrid", **overrides: Any) -> V4Spec:
    """The embedded default V4 checkpoint. variant: hybrid (NVFP4 main experts + MXFP4 drafters, the
    -0731-NVFP4 release), mxfp4 (the official release), nvfp4 (ModelOpt, drafters too), ct-nvfp4
    (compressed-tensors, drafters too)."""
    main, mtp = {"hybrid": (MODELOPT, "mxfp4"), "mxfp4": ("mxfp4", "mxfp4"), "nvfp4": (MODELOPT, MODELOPT),
                 "ct-nvfp4": (COMPRESSED_TENSORS, COMPRESSED_TENSORS)}[variant]
    return replace(V4Spec(main_format=main, mtp_format=mtp), **overrides)


def dspark_v4_spec(variant: str = "hybrid", **overrides: Any) -> V4Spec:
    """The embedded default with DeepSeek-V4-Flash-0731's DSpark drafter: three blocks mtp.0-2 and the head
    stack (main_proj, main_norm on mtp.0; norm, hc_head_*, markov_head, confidence_head on the last block),
    as vLLM 0.34's vllm/models/deepseek_v4/nvidia/dspark.py loads them."""
    return small_v4_spec(variant, **{"drafter": "dspark", "mtp_blocks": 3, "num_nextn_predict_layers": 3,
                                     **overrides})


def vllm_v4_spec(**overrides: Any) -> V4Spec:
    """The tiny variant vLLM's DeepseekV4ForCausalLM (CPU model) loads: 3 layers, hidden 256, moe_intermediate
    128, 64 experts top-6, vocab 1024, 4 heads of 512, compress_ratios [0, 4, 128], one hash layer, BF16
    dense, NVFP4 experts cast from MXFP4, no drafter."""
    return replace(V4Spec(hidden_size=256, moe_intermediate_size=128, n_routed_experts=64, num_experts_per_tok=6,
                          num_hidden_layers=3, num_hash_layers=1, mtp_blocks=0, num_nextn_predict_layers=0,
                          compress_ratios=(0, 4, 128), vocab_size=1024, num_attention_heads=4, head_dim=512,
                          q_lora_rank=128, o_lora_rank=128, o_groups=2, index_n_heads=4, index_head_dim=128,
                          index_topk=64, main_format=MODELOPT, mtp_format=MODELOPT, dense="bf16"), **overrides)


def v4_spec_for_size(total_bytes: int, variant: str = "hybrid", seed: int = 0) -> V4Spec:
    """A V4-shaped spec (H 4096, I 2048) whose routed-expert bytes come close to `total_bytes` (benchmarks)."""
    H, I, E = 4096, 2048, 32
    per_layer = E * 3 * H * I * (0.5 + 1 / 16)
    layers = max(1, int(round(total_bytes / per_layer)))
    return small_v4_spec(variant, hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_hidden_layers=layers,
                         mtp_blocks=0, num_nextn_predict_layers=0, q_lora_rank=256, o_lora_rank=128, head_dim=512,
                         index_head_dim=128, vocab_size=1024, shard_bytes=512 << 20, seed=seed, fast_codes=True,
                         dense="bf16")


_Tensor = tuple[str, np.ndarray, tuple[int, ...]]    # (safetensors dtype, raw bytes, shape)


def _raw(t: torch.Tensor) -> _Tensor:
    dt = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int32: "I32", torch.float8_e4m3fn: "F8_E4M3",
          torch.float8_e8m0fnu: "F8_E8M0", torch.uint8: "U8", torch.int8: "I8"}[t.dtype]
    t = t.contiguous()
    return dt, t.reshape(-1).view(torch.uint8).numpy().copy(), tuple(t.shape)


def _mx_expert(rng: np.random.Generator, out_dim: int, in_dim: int, fast: _FastCodes | None
               ) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 codes (packed uint8 [out, in/2]) and e8m0 exponent bytes [out, in/32] of t(5) weights.
    Exponents stay in 2^-18 .. 2^-1 (a span of 17 binades) so that the NVFP4 cast (e4m3 = 2^(k - m),
    m = k_max - 8) is exact for every block."""
    if fast is not None:
        return fast.codes(rng, (out_dim, in_dim // 2)), rng.integers(127 - 12, 127 - 5, size=(out_dim, in_dim // 32),
                                                                     dtype=np.uint8)
    row_std = 0.02 * np.exp(rng.normal(0, 0.3, size=(out_dim, 1)))
    w = (rng.standard_t(5, size=(out_dim, in_dim)) * row_std).astype(np.float32)
    blocks = w.reshape(out_dim, -1, 32)
    amax = np.abs(blocks).max(axis=-1)
    k = np.clip(np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -18, -1).astype(np.int32)
    q = blocks / np.ldexp(np.float32(1.0), k)[..., None]
    return pack_codes(quantize_to_codes(q.reshape(w.shape))), (k + 127).astype(np.uint8)


def _v4_expert(rng: np.random.Generator, prefix: str, codes: np.ndarray, e8: np.ndarray, m: int,
               fmt: str) -> dict[str, _Tensor]:
    """One projection in `fmt` from its MXFP4 codes and e8m0 scales; NVFP4 as the cast makes it (scale_2 2^m)."""
    if fmt == "mxfp4":
        return {f"{prefix}.weight": ("I8", codes.reshape(-1), codes.shape),
                f"{prefix}.scale": ("F8_E8M0", e8.reshape(-1), e8.shape)}
    e4 = e8m0_to_e4m3(e8, m)              # the cast: e4m3 = 2^(k - m), weight_scale_2 = 2^m
    scale_2 = np.float32(2.0 ** m)
    iscale = np.float32(rng.uniform(0.5, 2.0) / (6.0 * FP8_MAX))
    if fmt == MODELOPT:
        return {f"{prefix}.weight": ("U8", codes.reshape(-1), codes.shape),
                f"{prefix}.weight_scale": ("F8_E4M3", e4.reshape(-1), e4.shape),
                f"{prefix}.weight_scale_2": ("F32", np.array([scale_2], "<f4").view(np.uint8), ()),
                f"{prefix}.input_scale": ("F32", np.array([iscale], "<f4").view(np.uint8), ())}
    return {f"{prefix}.weight_packed": ("U8", codes.reshape(-1), codes.shape),
            f"{prefix}.weight_scale": ("F8_E4M3", e4.reshape(-1), e4.shape),
            f"{prefix}.weight_global_scale": ("F32", np.array([1.0 / scale_2], "<f4").view(np.uint8), (1,)),
            f"{prefix}.input_global_scale": ("F32", np.array([1.0 / iscale], "<f4").view(np.uint8), (1,))}


def _v4_linear(spec: V4Spec, rng: np.random.Generator, name: str, out_dim: int, in_dim: int) -> dict[str, _Tensor]:
    """A dense linear: FP8 e4m3 with e8m0 scales per 128x128 block (the official release), or BF16."""
    w = _bf16(rng, (out_dim, in_dim))
    if spec.dense == "bf16":
        return {f"{name}.weight": _raw(w)}
    q = (w.to(torch.float32) * 64).to(torch.float8_e4m3fn)
    sc = torch.full(((out_dim + 127) // 128, (in_dim + 127) // 128), 2.0 ** -6).to(torch.float8_e8m0fnu)
    return {f"{name}.weight": _raw(q), f"{name}.scale": _raw(sc)}


def _v4_block(spec: V4Spec, rng: np.random.Generator, p: str, idx: int, ratio: int, fmt: str,
              fast: _FastCodes | None) -> Iterator[dict[str, _Tensor]]:
    """One main layer (p = layers.L) or drafter block (p = mtp.K): attention, hyper-connections, the MoE."""
    H, hc, hd, nh = spec.hidden_size, spec.hc_mult, spec.head_dim, spec.num_attention_heads
    mix = (2 + hc) * hc
    f32 = torch.float32
    t: dict[str, _Tensor] = {f"{p}.attn_norm.weight": _raw(torch.ones(H, dtype=torch.bfloat16)),
                             f"{p}.ffn_norm.weight": _raw(torch.ones(H, dtype=torch.bfloat16))}
    for part in ("attn", "ffn"):
        t[f"{p}.hc_{part}_fn"] = _raw(torch.from_numpy((rng.standard_normal((mix, hc * H)) * 0.01).astype(np.float32)))
        t[f"{p}.hc_{part}_base"] = _raw(torch.zeros(mix, dtype=f32))
        t[f"{p}.hc_{part}_scale"] = _raw(torch.ones(3, dtype=f32))
    a = f"{p}.attn"
    t.update(_v4_linear(spec, rng, f"{a}.wq_a", spec.q_lora_rank, H))
    t.update(_v4_linear(spec, rng, f"{a}.wq_b", nh * hd, spec.q_lora_rank))
    t.update(_v4_linear(spec, rng, f"{a}.wkv", hd, H))
    t.update(_v4_linear(spec, rng, f"{a}.wo_a", spec.o_groups * spec.o_lora_rank, nh * hd // spec.o_groups))
    t.update(_v4_linear(spec, rng, f"{a}.wo_b", H, spec.o_groups * spec.o_lora_rank))
    t[f"{a}.q_norm.weight"] = _raw(torch.ones(spec.q_lora_rank, dtype=torch.bfloat16))
    t[f"{a}.kv_norm.weight"] = _raw(torch.ones(hd, dtype=torch.bfloat16))
    t[f"{a}.attn_sink"] = _raw(torch.zeros(nh, dtype=f32))

    def compressor(c: str, ratio: int, dim: int) -> None:
        coff = 2 if ratio == 4 else 1
        t[f"{c}.ape"] = _raw(torch.zeros((ratio, coff * dim), dtype=f32))
        t[f"{c}.wkv.weight"] = _raw(_bf16(rng, (coff * dim, H)))
        t[f"{c}.wgate.weight"] = _raw(_bf16(rng, (coff * dim, H)))
        t[f"{c}.norm.weight"] = _raw(torch.ones(dim, dtype=torch.bfloat16))
    if ratio:
        compressor(f"{a}.compressor", ratio, hd)
    if ratio == 4:
        ix = f"{a}.indexer"
        t.update(_v4_linear(spec, rng, f"{ix}.wq_b", spec.index_n_heads * spec.index_head_dim, spec.q_lora_rank))
        t[f"{ix}.weights_proj.weight"] = _raw(_bf16(rng, (spec.index_n_heads, H)))
        compressor(f"{ix}.compressor", 4, spec.index_head_dim)
    E, I = spec.n_routed_experts, spec.moe_intermediate_size
    t[f"{p}.ffn.gate.weight"] = _raw(_bf16(rng, (E, H)))
    if idx < spec.num_hash_layers:
        tid = rng.integers(0, E, size=(spec.vocab_size, spec.num_experts_per_tok), dtype=np.int32)
        t[f"{p}.ffn.gate.tid2eid"] = _raw(torch.from_numpy(tid))
    else:
        t[f"{p}.ffn.gate.bias"] = _raw(torch.zeros(E, dtype=f32))
    if spec.n_shared_experts:
        s = f"{p}.ffn.shared_experts"
        Is = I * spec.n_shared_experts
        t.update(_v4_linear(spec, rng, f"{s}.w1", Is, H))
        t.update(_v4_linear(spec, rng, f"{s}.w3", Is, H))
        t.update(_v4_linear(spec, rng, f"{s}.w2", H, Is))
    yield t
    for e in range(E):
        mx = {w: _mx_expert(rng, o, i, fast) for w, (o, i) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I)))}
        m13 = max(int(mx["w1"][1].max()), int(mx["w3"][1].max())) - 127 - 8   # w1/w3 share 2^m (SwiGLU fusion)
        m2 = int(mx["w2"][1].max()) - 127 - 8
        out: dict[str, _Tensor] = {}
        for w, (codes, e8) in mx.items():
            out.update(_v4_expert(rng, f"{p}.ffn.experts.{e}.{w}", codes, e8, m2 if w == "w2" else m13, fmt))
        yield out


def _v4_tensors(spec: V4Spec) -> Iterator[dict[str, _Tensor]]:
    rng = np.random.default_rng(spec.seed)
    fast = _FastCodes(rng) if spec.fast_codes else None
    H, hc, f32 = spec.hidden_size, spec.hc_mult, torch.float32
    ratios = spec.ratios()
    yield {"embed.weight": _raw(_bf16(rng, (spec.vocab_size, H)))}
    for i in range(spec.num_hidden_layers):
        yield from _v4_block(spec, rng, f"layers.{i}", i, ratios[i], spec.main_format, fast)
    for k in range(spec.mtp_blocks):
        p = f"mtp.{k}"
        if spec.drafter == "mtp":
            yield {f"{p}.e_proj.weight": _raw(_bf16(rng, (H, H))), f"{p}.h_proj.weight": _raw(_bf16(rng, (H, H))),
                   f"{p}.enorm.weight": _raw(torch.ones(H, dtype=torch.bfloat16)),
                   f"{p}.hnorm.weight": _raw(torch.ones(H, dtype=torch.bfloat16)), **_v4_head(spec, p)}
        else:
            yield _dspark_head_stack(spec, rng, k)
        yield from _v4_block(spec, rng, p, spec.num_hidden_layers + k, ratios[spec.num_hidden_layers + k],
                             spec.mtp_format, fast)
    yield {"norm.weight": _raw(torch.ones(H, dtype=torch.bfloat16)), "head.weight": _raw(_bf16(rng, (spec.vocab_size, H))),
           "hc_head_fn": _raw(torch.from_numpy((rng.standard_normal((hc, hc * H)) * 0.01).astype(np.float32))),
           "hc_head_base": _raw(torch.zeros(hc, dtype=f32)), "hc_head_scale": _raw(torch.ones(1, dtype=f32))}


def _v4_head(spec: V4Spec, p: str) -> dict[str, _Tensor]:
    """A drafter's output head: final norm and the hyper-connection head (an MTP block's own, DSpark's last)."""
    H, hc, f32 = spec.hidden_size, spec.hc_mult, torch.float32
    return {f"{p}.norm.weight": _raw(torch.ones(H, dtype=torch.bfloat16)),
            f"{p}.hc_head_fn": _raw(torch.zeros((hc, hc * H), dtype=f32)),
            f"{p}.hc_head_base": _raw(torch.zeros(hc, dtype=f32)), f"{p}.hc_head_scale": _raw(torch.ones(1, dtype=f32))}


def _dspark_head_stack(spec: V4Spec, rng: np.random.Generator, k: int) -> dict[str, _Tensor]:
    """DSpark's tensors outside its decoder blocks, on the block vLLM 0.34's dspark.py reads them from
    (`_remap_dspark_name`): main_proj and main_norm on mtp.0 (the target's hidden states in), the head
    stack on the last block (norm, hc_head_*, markov_head, confidence_head). Its context_wkv_proj has no
    tensor of its own: vLLM stacks the blocks' attn.wkv into it (`_duplicate_context_wkv_weights`)."""
    H, r, V, p = spec.hidden_size, spec.dspark_markov_rank, spec.vocab_size, f"mtp.{k}"
    t: dict[str, _Tensor] = {}
    if k == 0:
        t.update(_v4_linear(spec, rng, f"{p}.main_proj", H, H * len(spec.dspark_target_layer_ids)))
        t[f"{p}.main_norm.weight"] = _raw(torch.ones(H, dtype=torch.bfloat16))
    if k == spec.mtp_blocks - 1:
        t.update(_v4_head(spec, p))
        t[f"{p}.markov_head.markov_w1.weight"] = _raw(_bf16(rng, (V, r)))
        t[f"{p}.markov_head.markov_w2.weight"] = _raw(_bf16(rng, (V, r)))
        t[f"{p}.confidence_head.proj.weight"] = _raw(_bf16(rng, (1, H + r)).to(torch.float32))
    return t


def v4_config_for(spec: V4Spec) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "hidden_size": spec.hidden_size, "moe_intermediate_size": spec.moe_intermediate_size,
        "n_routed_experts": spec.n_routed_experts, "n_shared_experts": spec.n_shared_experts,
        "num_experts_per_tok": spec.num_experts_per_tok, "num_hidden_layers": spec.num_hidden_layers,
        "num_hash_layers": spec.num_hash_layers, "num_nextn_predict_layers": spec.num_nextn_predict_layers,
        "vocab_size": spec.vocab_size, "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": 1,
        "head_dim": spec.head_dim, "qk_rope_head_dim": spec.qk_rope_head_dim, "q_lora_rank": spec.q_lora_rank,
        "o_lora_rank": spec.o_lora_rank, "o_groups": spec.o_groups, "sliding_window": spec.sliding_window,
        "index_n_heads": spec.index_n_heads, "index_head_dim": spec.index_head_dim, "index_topk": spec.index_topk,
        "compress_ratios": list(spec.ratios()), "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "hc_mult": spec.hc_mult, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1048576, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "expert_dtype": "fp4",
    }
    if spec.drafter == "dspark":   # what vLLM 0.34's DSpark draft model reads from the target's config
        cfg.update({"n_mtp_layers": spec.mtp_blocks, "dspark_target_layer_ids": list(spec.dspark_target_layer_ids),
                    "dspark_markov_rank": spec.dspark_markov_rank, "dspark_block_size": spec.mtp_blocks + 1,
                    "enable_confidence_head": True})
    if spec.main_format == "mxfp4":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                      "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    elif spec.main_format == MODELOPT:
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                      "ignore": ["head", "embed", "*attn*", "*ffn.gate", "*shared_experts*",
                                                 *(["mtp.*"] if spec.mtp_format == "mxfp4" else [])]}
    elif spec.main_format == COMPRESSED_TENSORS:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"format": "nvfp4-pack-quantized", "targets": ["Linear"],
                                          "weights": {"num_bits": 4, "type": "float", "group_size": 16}}},
            "ignore": ["head", "re:.*attn.*", "re:.*ffn.gate$", "re:.*shared_experts.*"]}
    else:
        raise ValueError(f"unknown V4 expert format {spec.main_format}")
    return cfg


_TOKENIZER_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                       "<think>", "</think>", "<｜DSML｜>")


def _write_v4_aux(root: Path, spec: V4Spec) -> None:
    def put(rel: str, obj: Any) -> None:
        data = obj if isinstance(obj, bytes) else (json.dumps(obj, indent=1, ensure_ascii=False) + "\n").encode()
        atomic_write_bytes(root / rel, data)
    put("config.json", v4_config_for(spec))
    put("generation_config.json", {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 1.0})
    if spec.main_format == MODELOPT:
        put("hf_quant_config.json", {"producer": {"name": "modelopt", "version": "synthetic"},
                                     "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                      "kv_cache_quant_algo": None,
                                                      "exclude_modules": ["head", "*attn*", "*ffn.gate"]}})
    words = [*_TOKENIZER_SPECIALS, *[chr(c) for c in range(33, 127)], "[UNK]"][: spec.vocab_size]
    vocab = {w: i for i, w in enumerate(words)}
    put("tokenizer.json", {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": w, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, w in enumerate(_TOKENIZER_SPECIALS)],
        "normalizer": None, "pre_tokenizer": {"type": "Split", "pattern": {"String": ""}, "behavior": "Isolated",
                                              "invert": False},
        "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}})
    put("tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": _TOKENIZER_SPECIALS[0],
                                  "eos_token": _TOKENIZER_SPECIALS[1], "model_max_length": 1048576,
                                  "add_bos_token": True, "add_eos_token": False})
    put("encoding/README.md", b"# encoding (synthetic stub)\n\nDeepSeek-V4 ships its chat encoder as a script, not a "
        b"Jinja template; vLLM's --tokenizer-mode deepseek_v4 uses its own copy. This folder stands in for it.\n")
    put("encoding/encoding_dsv4.py", b'"""Synthetic stand-in for DeepSeek-V4\'s encoding script."""\n\n'
        b'BOS = "<\xef\xbd\x9cbegin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"\n\n\n'
        b'def encode_messages(messages, thinking=True):\n'
        b'    out = BOS\n    for m in messages:\n'
        b'        out += ("<\xef\xbd\x9cUser\xef\xbd\x9c>" if m["role"] == "user" else "<\xef\xbd\x9cAssistant\xef\xbd\x9c>") + m["content"]\n'
        b'    return out + "<\xef\xbd\x9cAssistant\xef\xbd\x9c>" + ("<think>" if thinking else "</think>")\n')


def make_v4_checkpoint(path: str | Path, spec: V4Spec | None = None) -> Path:
    """Write a sharded V4 checkpoint (index, config.json, tokenizer stub, encoding/, shards) at `path`."""
    spec = spec or small_v4_spec()
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = []
    pending: dict[str, _Tensor] = {}
    total = 0

    def flush() -> None:
        if not pending:
            return
        specs = [TensorSpec(n, dt, shape) for n, (dt, _, shape) in pending.items()]
        with SafetensorsWriter(root / f".shard-{len(shards) + 1:05d}", specs, {"format": "pt"}) as w:
            for n, (_, raw, _) in pending.items():
                w.write(n, raw)
            w.commit()
        shards.append(list(pending))
        pending.clear()
    size = 0
    for group in _v4_tensors(spec):
        nbytes = sum(raw.nbytes for _, raw, _ in group.values())
        if size and size + nbytes > spec.shard_bytes:
            flush()
            size = 0
        pending.update(group)
        size += nbytes
        total += nbytes
    flush()
    weight_map = {}
    for k, names in enumerate(shards, start=1):
        final = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        (root / f".shard-{k:05d}").rename(root / final)
        weight_map.update({name: final for name in names})
    (root / INDEX_NAME).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    _write_v4_aux(root, spec)
    return root
