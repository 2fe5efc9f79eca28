"""The VRAM budget of serving a cache on one GPU: what it holds, what is left for the KV cache, what fits.

Every figure is in bytes here and printed in GiB (2^30). The weights come from a cache's manifests
(exact tensor bytes) or from a checkpoint's config.json and safetensors headers (computed bytes, the
same arithmetic the builder uses). The KV term comes from the model's attention dims (docs/SERVING.md).
The CUDA-graph and activation reserves are documented estimates; the user can override both.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import layout as L
from .errors import InputError
from .manifest import CACHE_MANIFEST, COMMIT_RECORD, DeltaIndex, PartManifest
from .modelconfig import ModelConfig
from .units import GIB, parse_budget, parse_size

MIB = 1 << 20

# --- GPUs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuPreset:
    name: str
    total_bytes: int   # the memory the driver reports (nvidia-smi "memory.total"), not the marketing GB
    note: str


# nvidia-smi's memory.total (MiB) for each card. vLLM's --gpu-memory-utilization is a fraction of it.
GPU_PRESETS: dict[str, GpuPreset] = {
    "rtx-pro-6000": GpuPreset("rtx-pro-6000", 97887 * MIB, "RTX PRO 6000 Blackwell, sold as 96 GB"),
    "h100-80g": GpuPreset("h100-80g", 81559 * MIB, "H100 SXM/PCIe, sold as 80 GB"),
    "h200": GpuPreset("h200", 143771 * MIB, "H200 SXM, sold as 141 GB"),
}
DEFAULT_GPU = "rtx-pro-6000"


def resolve_gpu(text: str) -> GpuPreset:
    """A preset name, or a size with a unit ("96GB", "95.6GiB", bytes)."""
    key = str(text).strip().lower()
    if key in GPU_PRESETS:
        return GPU_PRESETS[key]
    try:
        n = parse_size(key, what="GPU memory")
    except InputError:
        raise InputError(f"unknown GPU {text!r}",
                         f"use one of {', '.join(GPU_PRESETS)} or a size such as 96GB or 95.6GiB") from None
    if n < GIB:
        raise InputError(f"GPU memory {text!r} is under 1 GiB", "give the card's size with a unit, e.g. 96GB")
    return GpuPreset(f"custom ({n / GIB:.2f} GiB)", n, "given on the command line")


# --- the KV cache ---------------------------------------------------------------------------------

KV_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla", "nvfp4_ds_mla")
SPARSE_ONLY = ("fp8_ds_mla", "nvfp4_ds_mla")   # vLLM allows these only on sparse-MLA backends


@dataclass(frozen=True)
class Attention:
    """What the KV cache of one token in one attention layer is made of, from config.json."""

    kind: str                  # "mla" (DeepSeek latent attention) or "unknown"
    kv_lora_rank: int = 0
    rope_dim: int = 0
    index_head_dim: int = 0    # DeepSeek-V3.2 sparse attention's indexer keys (0: none)
    layers: int = 0            # attention layers of the main model (each caches every token)
    mtp_layers: int = 0
    note: str = ""


def attention_from_config(cfg: dict[str, Any]) -> Attention:
    """MLA when the config has kv_lora_rank and qk_rope_head_dim; otherwise unknown (needs --kv-bytes-per-token)."""
    layers = cfg.get("num_hidden_layers")
    layers = layers if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 else 0
    mtp = cfg.get("num_nextn_predict_layers", 0)
    mtp = mtp if isinstance(mtp, int) and not isinstance(mtp, bool) and mtp >= 0 else 0
    r, rope = cfg.get("kv_lora_rank"), cfg.get("qk_rope_head_dim")
    if isinstance(r, int) and isinstance(rope, int) and r > 0 and rope >= 0:
        idx = cfg.get("index_head_dim")
        idx = idx if isinstance(idx, int) and idx > 0 and "index_topk" in cfg else 0
        note = ""
        if any(k in cfg for k in ("compress_ratios", "sliding_window", "window_size")):
            note = ("the config also names compressed or windowed attention, which caches less per token "
                    "than plain MLA: this KV figure is an upper bound; give --kv-bytes-per-token if known")
        return Attention("mla", r, rope, idx, layers, mtp, note)
    return Attention("unknown", layers=layers, mtp_layers=mtp,
                     note="the config has no kv_lora_rank/qk_rope_head_dim (not DeepSeek MLA)")


def kv_bytes_per_token_layer(att: Attention, kv_dtype: str) -> int:
    """Bytes one token takes in one layer's KV cache, from the dims (FORMATS.md: 656/576/1152/352 for V3)."""
    if att.kind != "mla":
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


# --- what the weights take ------------------------------------------------------------------------


@dataclass(frozen=True)
class Footprint:
    """The resident weights of a served cache (exact from manifests, computed from a checkpoint)."""

    source: str                   # "cache", "checkpoint" or "given"
    path: str
    exact: bool
    base_bytes: int               # base planes (+ FP8 block scales, scalars, tables) of served main layers
    delta_tier_bytes: int         # the FP4 delta tier as built (or as a budget would choose)
    dense_bytes: int              # everything copied unchanged that the main model loads
    expert_delta_bytes: int       # one expert's delta planes (w13 + w2)
    tier_experts: int
    total_experts: int            # experts over the served layers (the most the tier can hold)
    served_layers: int
    mtp_bytes: int                # the MTP layer's weights for speculative decoding (0: no MTP layer)
    mtp_exact: bool
    attention: Attention
    model: dict[str, Any] = field(default_factory=dict)

    def with_tier(self, budget_bytes: int) -> Footprint:
        """The same cache with the tier a budget would choose (whole experts, at most every expert)."""
        n = min(self.total_experts, budget_bytes // self.expert_delta_bytes) if self.expert_delta_bytes else 0
        return replace(self, delta_tier_bytes=n * self.expert_delta_bytes, tier_experts=n)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    from .stwriter import TensorSpec
    return TensorSpec("", dtype, shape).nbytes


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def base_layer_bytes(m: ModelConfig, input_scales: bool, scale_form: str = "e4m3-16") -> int:
    """One layer's base-plane file tensors, as the builder lays them out (geometry.LayerGeometry)."""
    from .geometry import LayerGeometry
    return LayerGeometry(m.n_routed_experts, m.hidden_size, m.moe_intermediate_size, scale_form, scale_form,
                         input_scales).base_bytes


def expert_delta_bytes(m: ModelConfig) -> int:
    from .geometry import LayerGeometry
    return LayerGeometry(m.n_routed_experts, m.hidden_size, m.moe_intermediate_size).expert_delta_bytes


def _mtp_estimate(m: ModelConfig, dense_per_layer: int) -> int:
    """An MTP layer kept at FP4 (it is not planed): its routed experts plus a main layer's dense share."""
    E, H, I = m.n_routed_experts, m.hidden_size, m.moe_intermediate_size
    fp4 = E * 3 * H * I * 9 // 16    # codes (1/2 byte) + block scales (1/16 byte) per weight
    extra = H * 2 * H * 2            # eh_proj, bf16
    return m.num_nextn_predict_layers * (fp4 + extra + dense_per_layer)


def footprint_from_checkpoint(path: str | os.PathLike[str], delta_budget: str | None = None) -> Footprint:
    """Computed bytes of the cache a default build of this checkpoint would give (all main MoE layers)."""
    from .checkpoint import open_checkpoint
    from .tiering import DEFAULT_DELTA_BUDGET
    with open_checkpoint(path) as ck:
        m = ck.model
        served = [i for i in m.main_moe_layers()
                  if any(n.startswith(f"model.layers.{i}.mlp.experts.0.") for n in ck.tensors)]
        if not served:
            raise InputError(f"{path} has no routed-expert tensors in its MoE layers")
        planed = ck.expert_tensor_names(served)
        input_scales = ck.expert_names(served[0], 0, "gate_proj")["input_scale"] in ck.tensors
        dense = mtp_dense = 0
        for name, info in ck.tensors.items():
            if name in planed:
                continue
            n = _nbytes(info.dtype, info.shape)
            layer = _layer_of(name)
            if layer is not None and layer >= m.num_hidden_layers:
                mtp_dense += n
            else:
                dense += n
        cfg = dict(ck.config)
    edb = expert_delta_bytes(m)
    total_experts = len(served) * m.n_routed_experts
    budget = parse_budget(delta_budget or DEFAULT_DELTA_BUDGET, total_experts * edb, what="delta budget")
    fp = Footprint("checkpoint", str(path), False, len(served) * base_layer_bytes(m, input_scales), 0, dense,
                   edb, 0, total_experts, len(served), mtp_dense, mtp_dense > 0, attention_from_config(cfg),
                   cfg)
    return fp.with_tier(budget)


def is_cache(path: Path) -> bool:
    return (path / CACHE_MANIFEST).is_file() or (path / COMMIT_RECORD).is_file()


def _verified_json(root: Path, rel: str, size: int, digest: str) -> Any:
    from .hashing import xxh3_hex
    from .fsutil import resolve_inside
    data = resolve_inside(root, rel).read_bytes()
    if len(data) != size or xxh3_hex(data) != digest:
        raise InputError(f"{rel} does not match the cache manifest", "run moet-cache verify; rebuild if damaged")
    return json.loads(data)


def footprint_from_cache(root: str | os.PathLike[str], delta_budget: str | None = None) -> Footprint:
    """Exact bytes from a committed cache's manifests (tensor byte ranges, the delta index)."""
    from .verifier import load_cache_files
    root = Path(root)
    cf = load_cache_files(root)
    m = ModelConfig.from_dict(cf.manifest.model)
    base = mtp_base = 0
    main_layers: list[int] = []
    for layer, lm in cf.layers.items():
        base_files = {f.path for f in lm.files if f.role == L.ROLE_BASE}
        n = sum(t.end - t.begin for t in lm.tensors if t.file in base_files)
        if lm.kind == "mtp":
            mtp_base += n
        else:
            base += n
            main_layers.append(layer)
    edb = next((lm.expert_delta_bytes for lm in cf.layers.values()), expert_delta_bytes(m))
    total_experts = sum(cf.layers[i].n_experts for i in main_layers)
    tier_experts = 0
    idx_fe = cf.manifest.file(L.ROLE_DELTA_INDEX)
    if idx_fe is not None:
        index = DeltaIndex.parse(_verified_json(root, idx_fe.path, idx_fe.size, idx_fe.xxh3), idx_fe.path)
        tier_experts = sum(len(ex) for layer, ex in index.layers if layer in main_layers)
    dense = mtp_dense = 0
    for fe, _ in cf.files:
        if fe.role == L.ROLE_PART and fe.path.startswith(L.DENSE_DIR + "/"):
            part = PartManifest.parse(_verified_json(root, fe.path, fe.size, fe.xxh3), fe.path)
            for t in part.tensors:
                layer = _layer_of(t.name)
                if layer is not None and layer >= m.num_hidden_layers:
                    mtp_dense += t.end - t.begin
                else:
                    dense += t.end - t.begin
    cfg = dict(cf.manifest.model)
    aux = next((f for f in cf.manifest.files if f.role == L.ROLE_AUX and f.path == f"{L.AUX_DIR}/config.json"), None)
    if aux is not None:
        cfg = _verified_json(root, aux.path, aux.size, aux.xxh3)
    # MTP tensors are in the cache with --include-mtp (planes + the rest) or --lossless (all at FP4).
    mtp_exact = bool(mtp_dense)
    mtp = mtp_base + mtp_dense if mtp_exact else 0
    if not mtp_exact and m.num_nextn_predict_layers:
        mtp = _mtp_estimate(m, dense // max(1, m.num_hidden_layers))
    fp = Footprint("cache", str(root), True, base, tier_experts * edb, dense, edb, tier_experts,
                   total_experts, len(main_layers), mtp, mtp_exact, attention_from_config(cfg), cfg)
    if delta_budget is not None:
        fp = fp.with_tier(parse_budget(delta_budget, total_experts * edb, what="delta budget"))
    return fp


def read_footprint(path: str | os.PathLike[str], delta_budget: str | None = None) -> Footprint:
    """A cache's exact footprint, or a checkpoint's computed one (whichever the folder holds)."""
    p = Path(path)
    if not p.is_dir():
        raise InputError(f"{p} is not a folder", "give a cache folder or an NVFP4 checkpoint folder")
    if is_cache(p):
        return footprint_from_cache(p, delta_budget)
    return footprint_from_checkpoint(p, delta_budget)


# --- settings and reserves ------------------------------------------------------------------------

DEFAULT_UTILIZATION = 0.96
DEFAULT_MAX_MODEL_LEN = 260_000
DEFAULT_KV_DTYPE = "fp8_ds_mla"
DEFAULT_CUDAGRAPH_SIZES = (1, 2, 4, 8)
DEFAULT_BLOCK_SIZE = 256
DEFAULT_BATCHED_TOKENS = 8192
# Estimates (docs/SERVING.md "reserves"): a CUDA-graph pool of a base plus a share per captured size,
# and activations of one batched forward pass that scale with the tokens batched and the model's width.
CUDAGRAPH_BASE = 128 * MIB
CUDAGRAPH_PER_SIZE = 32 * MIB


def cudagraph_reserve(n_sizes: int) -> int:
    return 0 if n_sizes == 0 else CUDAGRAPH_BASE + CUDAGRAPH_PER_SIZE * n_sizes


def activation_reserve(model: dict[str, Any], batched_tokens: int) -> int:
    """A batched forward pass: ~24 bytes per hidden unit per token (residual, norms, attention in bf16)
    plus the fused MoE's gate/up/activation buffers (8 bytes per routed intermediate unit)."""
    H = model.get("hidden_size", 7168)
    k = model.get("num_experts_per_tok", 8)
    I = model.get("moe_intermediate_size", 2048)
    vals = [v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0 for v in (H, k, I)]
    H, k, I = vals
    return batched_tokens * (24 * H + 8 * k * I)


@dataclass(frozen=True)
class PlanSettings:
    gpu: GpuPreset = GPU_PRESETS[DEFAULT_GPU]
    utilization: float = DEFAULT_UTILIZATION
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    kv_cache_dtype: str = DEFAULT_KV_DTYPE
    max_num_seqs: int = 1                      # full-length sequences the KV cache must back at once
    cudagraph_sizes: tuple[int, ...] = DEFAULT_CUDAGRAPH_SIZES
    speculative: str = "none"                  # "none" or "mtp"
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_bytes_per_token: int | None = None      # per token per layer, for attention we do not know
    cudagraph_reserve: int | None = None       # override of the estimate
    activation_reserve: int | None = None      # override of the estimate
    batched_tokens: int = DEFAULT_BATCHED_TOKENS

    def check(self) -> None:
        if not 0.05 <= self.utilization <= 1.0:
            raise InputError(f"--gpu-memory-utilization {self.utilization} must be in [0.05, 1.0]")
        if self.max_model_len < 1:
            raise InputError("--max-model-len must be at least 1")
        if self.max_num_seqs < 1:
            raise InputError("--max-num-seqs must be at least 1")
        if self.block_size < 1:
            raise InputError("--block-size must be at least 1")
        if self.speculative not in ("none", "mtp"):
            raise InputError(f"--speculative {self.speculative!r}", "use mtp or none")
        if self.kv_cache_dtype not in KV_DTYPES and self.kv_bytes_per_token is None:
            raise InputError(f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}",
                             f"use one of {', '.join(KV_DTYPES)}, or give --kv-bytes-per-token")


# --- the plan ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Suggestion:
    change: str        # context, sequences, tier, base-only, kv-cache-dtype, gpu
    setting: str       # the flag that gets there, e.g. "--max-model-len 131072"
    margin: int        # bytes left over with that change


@dataclass(frozen=True)
class Plan:
    footprint: Footprint
    settings: PlanSettings
    budget: int                    # gpu total x utilization
    base: int
    delta: int
    dense: int
    mtp_weights: int               # counted only with --speculative mtp
    cudagraph: int
    activations: int
    kv_per_token_layer: int
    kv_layers: int                 # attention layers that cache tokens (+ MTP layers when speculating)
    kv_tokens: int                 # tokens backed: max_num_seqs x max_model_len rounded up to blocks
    kv: int
    static: int                    # everything but the KV cache
    need: int
    fits: bool
    margin: int                    # budget - need (negative: short by that much)
    deciding: str                  # what makes it not fit, or what limits the headroom
    kv_room: int                   # budget - static: what the KV cache can have
    max_kv_per_token_layer: int    # the largest per-token-per-layer KV that still fits these settings
    longest_context: int           # for max_num_seqs sequences, whole blocks
    extra_full_seqs: int
    extra_delta_experts: int
    mtp_need: int                  # MTP weights + its KV, for speculative decoding
    mtp_fits: bool
    suggestions: tuple[Suggestion, ...]
    notes: tuple[str, ...]


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def make_plan(fp: Footprint, s: PlanSettings) -> Plan:
    """The whole budget: terms, verdict, which term decides, what the free bytes buy or what would fit."""
    s.check()
    notes: list[str] = []
    att = fp.attention
    if s.kv_bytes_per_token is not None:
        per_layer = s.kv_bytes_per_token
        notes.append(f"KV: {per_layer} B per token per layer as given (--kv-bytes-per-token)")
    else:
        per_layer = kv_bytes_per_token_layer(att, s.kv_cache_dtype)
        if att.note:
            notes.append(att.note)
        if s.kv_cache_dtype in SPARSE_ONLY and not att.index_head_dim:
            notes.append(f"{s.kv_cache_dtype} runs only on vLLM's sparse-MLA backends (DeepSeek V3.2 and later); "
                         "this config has no sparse indexer, so vLLM may refuse it")
    mpe = fp.model.get("max_position_embeddings")
    if isinstance(mpe, int) and not isinstance(mpe, bool) and 0 < mpe < s.max_model_len:
        notes.append(f"--max-model-len {s.max_model_len} exceeds the model's max_position_embeddings {mpe}: "
                     "vLLM refuses it unless the rope scaling allows it (or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)")
    layers = att.layers or fp.served_layers
    mtp_layers = att.mtp_layers if fp.mtp_bytes else 0
    spec = s.speculative == "mtp"
    if spec and not fp.mtp_bytes:
        raise InputError("--speculative mtp: this model has no MTP layer (num_nextn_predict_layers is 0)")
    kv_layers = layers + (mtp_layers if spec else 0)
    per_token = per_layer * kv_layers
    seq_tokens = _round_up(s.max_model_len, s.block_size)
    kv_tokens = seq_tokens * s.max_num_seqs
    kv = kv_tokens * per_token
    budget = int(s.gpu.total_bytes * s.utilization)
    graphs = s.cudagraph_reserve if s.cudagraph_reserve is not None else cudagraph_reserve(len(s.cudagraph_sizes))
    acts = s.activation_reserve if s.activation_reserve is not None else \
        activation_reserve(fp.model, s.batched_tokens)
    mtp_w = fp.mtp_bytes if spec else 0
    if spec and not fp.mtp_exact:
        notes.append("the MTP layer's weights are an estimate (the cache holds no MTP planes)")
    static = fp.base_bytes + fp.delta_tier_bytes + fp.dense_bytes + mtp_w + graphs + acts
    need = static + kv
    margin = budget - need
    kv_room = budget - static
    fits = margin >= 0
    weights = {"base planes": fp.base_bytes, "dense weights": fp.dense_bytes, "delta tier": fp.delta_tier_bytes}
    if static > budget:
        deciding = f"weights: {max(weights, key=weights.__getitem__)} and the rest exceed the budget before any KV"
    elif not fits:
        deciding = "KV cache: the weights fit, the KV cache for these settings does not"
    else:
        deciding = "KV cache: the headroom is what the KV cache leaves"
    room = max(0, kv_room)
    max_per_layer = room // (kv_tokens * kv_layers) if kv_tokens and kv_layers else 0
    longest = (room // (per_token * s.max_num_seqs)) // s.block_size * s.block_size if per_token else 0
    per_seq = seq_tokens * per_token
    extra_seqs = max(0, margin) // per_seq if per_seq else 0
    extra_experts = min(max(0, margin) // fp.expert_delta_bytes if fp.expert_delta_bytes else 0,
                        fp.total_experts - fp.tier_experts)
    mtp_need = fp.mtp_bytes + mtp_layers * per_layer * kv_tokens if fp.mtp_bytes else 0
    mtp_fits = bool(fp.mtp_bytes) and (fits if spec else margin >= mtp_need)
    suggestions = () if fits else _suggestions(fp, s, budget, static, per_token, seq_tokens, per_layer,
                                               graphs, acts, mtp_w, kv_layers)
    return Plan(fp, s, budget, fp.base_bytes, fp.delta_tier_bytes, fp.dense_bytes, mtp_w, graphs, acts,
                per_layer, kv_layers, kv_tokens, kv, static, need, fits, margin, deciding, kv_room,
                max_per_layer, longest, extra_seqs, extra_experts, mtp_need, mtp_fits, suggestions,
                tuple(notes))


def _suggestions(fp: Footprint, s: PlanSettings, budget: int, static: int, per_token: int, seq_tokens: int,
                 per_layer: int, graphs: int, acts: int, mtp_w: int, kv_layers: int) -> tuple[Suggestion, ...]:
    """The nearest single changes that fit, each with the margin it leaves."""
    out: list[Suggestion] = []
    room = budget - static
    if room > 0 and per_token:
        longest = (room // (per_token * s.max_num_seqs)) // s.block_size * s.block_size
        if longest >= s.block_size:
            out.append(Suggestion("context", f"--max-model-len {longest}",
                                  room - longest * s.max_num_seqs * per_token))
        if s.max_num_seqs > 1:
            n = room // (seq_tokens * per_token)
            if n >= 1:
                out.append(Suggestion("sequences", f"--max-num-seqs {n}", room - n * seq_tokens * per_token))
    kv = seq_tokens * s.max_num_seqs * per_token
    short = static + kv - budget
    if fp.delta_tier_bytes and short <= fp.delta_tier_bytes:
        keep = (fp.delta_tier_bytes - short) // fp.expert_delta_bytes * fp.expert_delta_bytes
        if keep > 0:
            # Exact bytes: a rounded GiB figure could round up past what fits.
            out.append(Suggestion("tier", f"--delta-budget {keep} ({keep // fp.expert_delta_bytes} experts, "
                                          f"{keep / GIB:.3f} GiB)",
                                  budget - (static - fp.delta_tier_bytes + keep + kv)))
        out.append(Suggestion("base-only", "--delta-budget 0", budget - (static - fp.delta_tier_bytes + kv)))
    elif fp.delta_tier_bytes:  # dropping the tier is not enough alone: base-only and a shorter context
        room0 = room + fp.delta_tier_bytes
        longest = (room0 // (per_token * s.max_num_seqs)) // s.block_size * s.block_size if per_token else 0
        if longest >= s.block_size:
            out.append(Suggestion("base-only+context", f"--delta-budget 0 --max-model-len {longest}",
                                  room0 - longest * s.max_num_seqs * per_token))
    if s.kv_bytes_per_token is None and fp.attention.kind == "mla":
        for dtype in ("nvfp4_ds_mla", "fp8_ds_mla", "fp8"):
            p = kv_bytes_per_token_layer(fp.attention, dtype)
            if p < per_layer:
                m = budget - (static + seq_tokens * s.max_num_seqs * p * kv_layers)
                if m >= 0:
                    out.append(Suggestion("kv-cache-dtype", f"--kv-cache-dtype {dtype}", m))
                    break
    if not out:
        out.append(Suggestion("gpu", f"a card with {short / GIB:.2f} GiB more usable memory", 0))
    return tuple(out)


def plan_for(path: str | os.PathLike[str], settings: PlanSettings, delta_budget: str | None = None) -> Plan:
    """Read a cache or checkpoint and plan it (the library entry point of `moet-cache plan`)."""
    return make_plan(read_footprint(path, delta_budget), settings)


def parse_sizes_list(text: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8); 'none' or '' -> () (no CUDA graphs)."""
    t = str(text).strip().lower()
    if t in ("", "none", "0"):
        return ()
    try:
        sizes = tuple(int(x) for x in t.replace(" ", ",").split(",") if x)
    except ValueError:
        raise InputError(f"cannot read the capture sizes {text!r}", "write e.g. 1,2,4,8") from None
    if not sizes or any(x < 1 or x > 1 << 16 for x in sizes):
        raise InputError(f"capture sizes {text!r} must be positive batch sizes")
    return tuple(sorted(set(sizes)))


def detect_gpu() -> GpuPreset | None:
    """The first visible GPU's memory, from nvidia-smi (no CUDA context is created); None without one."""
    import shutil
    import subprocess
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    args = [smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    if visible.isdigit():
        args += ["-i", visible]
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=20, check=True).stdout
        name, mib = out.strip().splitlines()[0].rsplit(",", 1)
        return GpuPreset(name.strip(), int(mib.strip()) * MIB, "seen by nvidia-smi")
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
