"""What the KV cache of one token is made of, read from the model's config.json: the attention's kind and
dims, the --kv-cache-dtype values vLLM runs it with, the bytes a token a layer, and the cards vLLM refuses it on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..enums import StrEnum
from ..errors import InputError
from .kv_v4 import KV_DTYPES_V4, V4_ATTENTION_MAJORS, V4Attention, compress_ratios_of
from .gpus import GPU_PRESETS, GpuPreset

KV_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla", "nvfp4_ds_mla")
SPARSE_ONLY = ("fp8_ds_mla", "nvfp4_ds_mla")   # vLLM allows these only on sparse-MLA backends


class AttentionKind(StrEnum):
    MLA = "mla"                      # DeepSeek latent attention
    DEEPSEEK_V4 = "deepseek_v4"      # compressed (kv_v4.py)
    UNKNOWN = "unknown"              # needs --kv-bytes-per-token


@dataclass(frozen=True)
class Attention:
    """What the KV cache of one token in one attention layer is made of, from config.json."""

    kind: AttentionKind
    kv_lora_rank: int = 0
    rope_dim: int = 0
    index_head_dim: int = 0    # DeepSeek-V3.2 sparse attention's indexer keys (0: none)
    layers: int = 0            # attention layers of the main model (each caches every token)
    mtp_layers: int = 0
    note: str = ""
    v4: V4Attention | None = None   # DeepSeek-V4: per-layer compress ratios, window, dims

    @property
    def kv_dtypes(self) -> tuple[str, ...]:
        """The --kv-cache-dtype values vLLM 0.34 runs this attention with (the plan suggests no other)."""
        if self.kind == AttentionKind.DEEPSEEK_V4:
            return KV_DTYPES_V4
        if self.kind == AttentionKind.MLA and self.index_head_dim:  # FlashMLA sparse (nvfp4_ds_mla: SM100 only, not offered)
            return ("auto", "bfloat16", "fp8", "fp8_ds_mla")
        if self.kind == AttentionKind.MLA:              # dense MLA backends
            return ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3")
        return KV_DTYPES


def _int(cfg: dict[str, Any], key: str, default: int = 0) -> int:
    v = cfg.get(key, default)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default


def attention_from_config(cfg: dict[str, Any]) -> Attention:
    """MLA when the config has kv_lora_rank and qk_rope_head_dim; DeepSeek-V4 when it has compress_ratios and
    head_dim but no kv_lora_rank; otherwise unknown (needs --kv-bytes-per-token)."""
    layers = _int(cfg, "num_hidden_layers")
    mtp = _int(cfg, "num_nextn_predict_layers")
    ratios = compress_ratios_of(cfg)
    if ratios is not None and "kv_lora_rank" not in cfg and _int(cfg, "head_dim") > 0 and layers:
        if len(ratios) < layers or any(r not in (0, 1, 4, 128) for r in ratios[:layers]):
            raise InputError(f"config.json: compress_ratios {ratios[:8]}... does not give one of 0, 4, 128 "
                             f"to each of the {layers} layers", "check the model's config.json")
        v4 = V4Attention(tuple(ratios[:layers]), _int(cfg, "head_dim"), _int(cfg, "sliding_window", 128) or 128,
                         _int(cfg, "index_head_dim", 128) or 128, mtp)
        return Attention(AttentionKind.DEEPSEEK_V4, 0, _int(cfg, "qk_rope_head_dim"), v4.index_head_dim, layers, mtp, v4=v4)
    r, rope = cfg.get("kv_lora_rank"), cfg.get("qk_rope_head_dim")
    if isinstance(r, int) and isinstance(rope, int) and r > 0 and rope >= 0:
        idx = cfg.get("index_head_dim")
        idx = idx if isinstance(idx, int) and idx > 0 and "index_topk" in cfg else 0
        note = ""
        if any(k in cfg for k in ("compress_ratios", "sliding_window", "window_size")):
            note = ("the config also names compressed or windowed attention, which caches less per token "
                    "than plain MLA: this KV figure is an upper bound; give --kv-bytes-per-token if known")
        return Attention(AttentionKind.MLA, r, rope, idx, layers, mtp, note)
    return Attention(AttentionKind.UNKNOWN, layers=layers, mtp_layers=mtp,
                     note="the config has no kv_lora_rank/qk_rope_head_dim (not DeepSeek MLA)")


def kv_bytes_per_token_layer(att: Attention, kv_dtype: str) -> int:
    """Bytes one token takes in one layer's KV cache, from the dims (FORMATS.md: 656/576/1152/352 for V3)."""
    if att.kind == AttentionKind.DEEPSEEK_V4:
        raise InputError("DeepSeek-V4 caches no fixed bytes per token per layer", "plan it with kv_v4.v4_kv")
    if att.kind != AttentionKind.MLA:
        raise InputError("the KV cache size of this model's attention is not known to moet-cache",
                         f"{att.note}; give --kv-bytes-per-token (bytes per token per layer)")
    r, rope = att.kv_lora_rank, att.rope_dim
    if kv_dtype in ("auto", "bfloat16", "float16"):
        per = (r + rope) * 2
    elif kv_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        per = r + rope
    elif kv_dtype == "fp8_ds_mla":     # latent fp8, one fp32 scale per 128, rope bf16
        per = r + (r // 128) * 4 + rope * 2
    elif kv_dtype == "nvfp4_ds_mla":   # latent e2m1 two a byte, one fp8 scale per 16, rope fp8
        per = r // 2 + r // 16 + rope
    else:
        raise InputError(f"unknown --kv-cache-dtype {kv_dtype!r}", f"use one of {', '.join(KV_DTYPES)}")
    if att.index_head_dim:             # V3.2 indexer keys: fp8 plus one fp32 scale per 128, any dtype
        per += att.index_head_dim + att.index_head_dim // 128 * 4
    return per


def attention_refusal(att: Attention, gpu: GpuPreset) -> str | None:
    """Why vLLM 0.34 would refuse this model's attention on this card (None: it runs, or the card is not known)."""
    if att.kind != AttentionKind.DEEPSEEK_V4 or gpu.capability is None or gpu.capability[0] in V4_ATTENTION_MAJORS:
        return None
    cc = ".".join(map(str, gpu.capability))
    card = gpu.note.split(",")[0] if GPU_PRESETS.get(gpu.name) == gpu else gpu.name
    return (f"attention: vLLM 0.34 runs DeepSeek-V4's attention only on compute capability 9.x, 10.x and 12.x "
            f"(FlashMLA sparse, FlashInfer sparse); the {card} is {cc}, where vLLM refuses it")
