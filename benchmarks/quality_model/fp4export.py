"""FP4 forms of the reference model's routed experts: MXFP4 fake quantization for training, and the two
checkpoint exports (MXFP4 as DeepSeek-V4-Flash ships its experts; ModelOpt NVFP4 as the V3/R1 releases),
written under DeepSeek-V3 names so `moet-cache build` reads them as they are."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from moet_cache.format.fp4 import E2M1_VALUES, pack_codes, quantize_to_codes
from moet_cache.source.synthetic import quantize_nvfp4

from quality_model.model import ModelSpec, layer_prefix

MX_BLOCK = 32
_MAGS = torch.from_numpy(E2M1_VALUES[:8].copy())


def mxfp4_exponents(w: torch.Tensor) -> torch.Tensor:
    """Each 32-block's power-of-two scale exponent k (int32 [..., out, in/32]): 2^k = the smallest power of
    two with amax / 2^k <= 6 (no value clips), inside e8m0's range."""
    amax = w.reshape(*w.shape[:-1], -1, MX_BLOCK).abs().amax(-1).clamp_min(2.0 ** -126)
    return torch.ceil(torch.log2(amax / 6.0)).clamp(-126, 127).to(torch.int32)


def mxfp4_fake(w: torch.Tensor) -> torch.Tensor:
    """w rounded to MXFP4 (nearest E2M1 value, first of equals, as moet_cache.format.fp4.quantize_to_codes), with
    a straight-through gradient: the forward sees the FP4 values, the update reaches the master weights."""
    with torch.no_grad():
        blocks = w.reshape(*w.shape[:-1], -1, MX_BLOCK)
        scale = torch.exp2(mxfp4_exponents(w).to(w.dtype)).unsqueeze(-1)
        q = blocks / scale
        idx = (q.abs().clamp(max=6.0).unsqueeze(-1) - _MAGS.to(w.device, w.dtype)).abs().argmin(-1)
        deq = (_MAGS.to(w.device, w.dtype)[idx] * torch.where(q < 0, -1.0, 1.0) * scale).reshape(w.shape)
    return w + (deq - w).detach()


def mxfp4_export(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [out, in] -> (packed codes uint8 [out, in/2], e8m0 bytes uint8 [out, in/32]), the same
    values mxfp4_fake computes."""
    k = mxfp4_exponents(torch.from_numpy(w)).numpy()
    q = w.reshape(w.shape[0], -1, MX_BLOCK) / np.ldexp(np.float32(1.0), k)[..., None]
    return pack_codes(quantize_to_codes(q.reshape(w.shape))), (k + 127).astype(np.uint8)


def expert_weights(w13: torch.Tensor, w2: torch.Tensor, e: int) -> dict[str, np.ndarray]:
    inter = w2.shape[-1]
    return {"gate_proj": w13[e, :inter].float().numpy(), "up_proj": w13[e, inter:].float().numpy(),
            "down_proj": w2[e].float().numpy()}


def config_for(spec: ModelSpec, fmt: str) -> dict[str, object]:
    cfg: dict[str, object] = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": spec.hidden, "moe_intermediate_size": spec.expert_width,
        "intermediate_size": spec.shared_width, "n_routed_experts": spec.experts, "n_shared_experts": 1,
        "num_experts_per_tok": spec.top_k, "num_hidden_layers": spec.layers, "first_k_dense_replace": 0,
        "moe_layer_freq": 1, "num_nextn_predict_layers": 0, "vocab_size": spec.vocab,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.heads, "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.norm_eps, "scoring_func": "softmax", "norm_topk_prob": True,
        "routed_scaling_factor": 1.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "moet_reference_model": spec.to_dict(),
    }
    if fmt == "mxfp4":
        cfg["expert_dtype"] = "fp4"
        cfg["quantization_config"] = {"quant_method": "fp8", "expert_dtype": "fp4", "fmt": "e4m3",
                                      "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    else:
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                      "ignore": ["lm_head", "*self_attn*", "*mlp.gate", "*shared_experts*"]}
    return cfg


def write_checkpoint(out: Path, spec: ModelSpec, dense: dict[str, torch.Tensor], w13: list[torch.Tensor],
                     w2: list[torch.Tensor], fmt: str) -> Path:
    """One-shard checkpoint at `out`: dense tensors BF16, routed experts in `fmt` (mxfp4 | nvfp4)."""
    tensors: dict[str, torch.Tensor] = {n: t.detach().to(torch.bfloat16).contiguous() for n, t in dense.items()}
    for layer in range(spec.layers):
        for e in range(spec.experts):
            for proj, w in expert_weights(w13[layer].detach(), w2[layer].detach(), e).items():
                p = f"{layer_prefix(layer)}.mlp.experts.{e}.{proj}"
                if fmt == "mxfp4":
                    codes, e8 = mxfp4_export(w)
                    tensors[f"{p}.weight"] = torch.from_numpy(codes)
                    tensors[f"{p}.scale"] = torch.from_numpy(e8).view(torch.float8_e8m0fnu)
                else:
                    codes, scale, gscale = quantize_nvfp4(w)
                    tensors[f"{p}.weight"] = torch.from_numpy(np.ascontiguousarray(codes))
                    tensors[f"{p}.weight_scale"] = scale
                    tensors[f"{p}.weight_scale_2"] = torch.tensor(gscale, dtype=torch.float32)
                    # Weight-only here: the cache's runtime does not use input scales; ModelOpt writes one.
                    tensors[f"{p}.input_scale"] = torch.tensor(1.0, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    shard = "model-00001-of-00001.safetensors"
    save_file(tensors, str(out / shard), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": {n: shard for n in sorted(tensors)}}, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(config_for(spec, fmt), indent=1) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}) + "\n")
    if fmt == "nvfp4":
        (out / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "reference-model"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                             "exclude_modules": ["lm_head", "*self_attn*", "*mlp.gate", "*shared_experts*"]}},
            indent=1) + "\n")
    return out
