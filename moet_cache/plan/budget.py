"""The VRAM budget of serving a cache on one GPU (or the fullest of several, parallel.py): what it holds, what
is left for the KV cache, what fits.

Every figure is in bytes here and printed in GiB (2^30). The weights come from a cache's manifests
(exact tensor bytes) or from a checkpoint's config.json and safetensors headers (computed bytes, the
same arithmetic the builder uses). The KV term comes from the model's attention dims (docs/SERVING.md).
The CUDA-graph and activation reserves are documented estimates; the user can override both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import layout as L
from .enums import StrEnum
from .errors import InputError
from .families import Family
from .cacheview import CacheView, open_view
from .manifest import CACHE_MANIFEST, COMMIT_RECORD, LayerKind
from .modelconfig import ModelConfig
from .drafter_vram import (BLOCK_WKV, CONTEXT_WKV, DrafterLayout, DrafterNeed, DrafterWeights,
                           draft_layers, drafter_need, layout_of)
from .kv_v4 import (BLOCK_SIZE_V4, KV_DTYPES_V4, V4_ATTENTION_MAJORS, V4Attention, V4Kv, compress_ratios_of,
                    longest_context, v4_kv)
from .parallel import Parallel, allowed_sizes, fullest_rank_experts, is_split, share
from .parallel import check as check_parallel
from .units import GIB, parse_budget, parse_size

MIB = 1 << 20
# The base-plane tensors tensor parallelism splits (codes and block scales); each expert's scalars and tables
# are copied to every rank.
SPLIT_BASE = frozenset((L.W13_BASE, L.W2_BASE, L.W13_SCALE, L.W2_SCALE))

# --- GPUs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuPreset:
    name: str
    total_bytes: int   # the memory the driver reports (nvidia-smi "memory.total"), not the marketing GB
    note: str
    capability: tuple[int, int] | None = None   # CUDA compute capability (None: not known)


# nvidia-smi's memory.total (MiB) for each card, as the cards commonly report it (the 48 GB workstation cards
# with ECC off; with ECC on an A6000 or RTX 6000 Ada reports 46068 MiB, as the L40S does by default); vLLM's
# --gpu-memory-utilization is a fraction of it. The compute capability decides which attention backends run.
GPU_PRESETS: dict[str, GpuPreset] = {
    "rtx-pro-6000": GpuPreset("rtx-pro-6000", 97887 * MIB, "RTX PRO 6000 Blackwell, sold as 96 GB", (12, 0)),
    "h100-80g": GpuPreset("h100-80g", 81559 * MIB, "H100 SXM/PCIe, sold as 80 GB", (9, 0)),
    "h200": GpuPreset("h200", 143771 * MIB, "H200 SXM, sold as 141 GB", (9, 0)),
    "rtx-6000-ada": GpuPreset("rtx-6000-ada", 49140 * MIB, "RTX 6000 Ada, sold as 48 GB", (8, 9)),
    "l40s": GpuPreset("l40s", 46068 * MIB, "L40S, sold as 48 GB", (8, 9)),
    "a6000": GpuPreset("a6000", 49140 * MIB, "RTX A6000, sold as 48 GB", (8, 6)),
    "rtx-5090": GpuPreset("rtx-5090", 32607 * MIB, "GeForce RTX 5090, sold as 32 GB", (12, 0)),
    "rtx-4090": GpuPreset("rtx-4090", 24564 * MIB, "GeForce RTX 4090, sold as 24 GB", (8, 9)),
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


class AttentionKind(StrEnum):
    MLA = "mla"                      # DeepSeek latent attention
    DEEPSEEK_V4 = "deepseek_v4"      # compressed (kv_v4.py)
    UNKNOWN = "unknown"              # needs --kv-bytes-per-token


class Speculative(StrEnum):
    """Speculative decoding the plan counts (--speculative)."""

    NONE = "none"
    MTP = "mtp"                      # the MTP block(s): V4-Flash's mtp.0, V3's nextn layers
    DSPARK = "dspark"                # V4-Flash-0731's DSpark drafter: mtp.0-2 and its head stack (drafter_vram.py)


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


# --- what the weights take ------------------------------------------------------------------------


@dataclass(frozen=True)
class Footprint:
    """The resident weights of a served cache (exact from manifests, computed from a checkpoint)."""

    source: str                   # "cache", "checkpoint" or "given"
    path: str
    exact: bool
    base_bytes: int               # base planes (+ FP8 block scales, scalars, tables) of served main layers, and
                                  # their mid tier's planes and tables (resident beside them, a fixed size)
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
    source_format: str = ""       # the first served layer's expert format (formats.FORMATS) or source layout
    # For more than one GPU (parallel.py): the part of the base planes every tensor-parallel rank copies (each
    # expert's scalars and tables), the part of the dense bytes vLLM splits, and which experts the tier holds.
    base_replicated_bytes: int = 0
    dense_split_bytes: int = 0
    tier_layers: tuple[tuple[int, tuple[int, ...]], ...] | None = None   # None: not known (a checkpoint's tier)
    parallel: Parallel = Parallel()   # one rank's share when size > 1 (rank_footprint)
    whole: Footprint | None = None    # a rank's footprint: the whole model's
    drafter: DrafterWeights | None = None   # V4's mtp.K blocks (and DSpark's head stack), by term

    def with_tier(self, budget_bytes: int) -> Footprint:
        """The same cache with the tier a budget would choose (whole experts, at most every expert)."""
        n = min(self.total_experts, budget_bytes // self.expert_delta_bytes) if self.expert_delta_bytes else 0
        known = self.tier_layers if n == self.tier_experts else None
        return replace(self, delta_tier_bytes=n * self.expert_delta_bytes, tier_experts=n, tier_layers=known)


def rank_footprint(fp: Footprint, p: Parallel) -> Footprint:
    """What the fullest of `p.size` ranks holds. Tensor parallel: 1/N of every expert's codes and block scales
    (their scalars and tables on every rank), 1/N of each tier expert, vLLM's split dense tensors 1/N and the
    rest whole. Expert parallel: E/N whole experts a layer and the tier experts among them (the cache's delta
    index; for a checkpoint, whose tier is chosen at build, as many as could land on one rank), dense as for
    tensor parallelism. The drafter's weights stay whole (an upper bound)."""
    if p.size == 1:
        return fp
    dense = fp.dense_bytes - fp.dense_split_bytes + share(fp.dense_split_bytes, p.size)
    if not p.expert:
        base = fp.base_replicated_bytes + share(fp.base_bytes - fp.base_replicated_bytes, p.size)
        edb = fp.expert_delta_bytes // p.size
        return replace(fp, base_bytes=base, dense_bytes=dense, expert_delta_bytes=edb,
                       delta_tier_bytes=fp.tier_experts * edb, parallel=p, whole=fp)
    local = fp.total_experts // p.size
    if fp.tier_layers is not None:
        tier = fullest_rank_experts(fp.tier_layers, fp.total_experts // max(1, fp.served_layers), p.size)
    else:
        tier = min(fp.tier_experts, local)
    return replace(fp, base_bytes=share(fp.base_bytes, p.size), dense_bytes=dense, total_experts=local,
                   tier_experts=tier, delta_tier_bytes=tier * fp.expert_delta_bytes, parallel=p, whole=fp)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    from .stwriter import TensorSpec
    return TensorSpec("", dtype, shape).nbytes


def _layer_of(name: str, family: Family | None = None) -> int | None:
    """The layer a tensor name belongs to (through the checkpoint's naming family when known)."""
    if family is not None:
        return family.layer_of(name)
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isascii() and parts[2].isdigit():
        return int(parts[2])
    return None


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
    """Computed bytes of the cache a default build of this checkpoint would give (all main MoE layers).

    Each layer's base planes are counted in the block-scale form the build would store (Checkpoint.scale_forms:
    MXFP4 e8m0 by format; NVFP4 e8m0 only where every scale of the projection group allows it, which reads
    the NVFP4 scales; a scale that is not compact gives the e4m3 form)."""
    from .checkpoint import open_checkpoint
    from .families import PROJECTIONS
    from .geometry import LayerGeometry
    from .tiering import DEFAULT_DELTA_BUDGET
    with open_checkpoint(path) as ck:
        m, fam = ck.model, ck.family
        served = [i for i in fam.moe_layers
                  if any(n in ck.tensors for n in ck.expert_names(i, 0, PROJECTIONS[0]).values())]
        if not served:
            raise InputError(f"{path} has no routed-expert tensors in its MoE layers")
        # V4's drafter blocks get planes too (a build with --include-drafter): counted base-only, apart.
        drafters = [i for i in fam.mtp_layers if fam.name == "deepseek_v4" and i not in served]
        planed = ck.expert_tensor_names(served + drafters)

        def base_of(layers: list[int]) -> tuple[int, int]:
            """The layers' base-plane bytes, and the part of them every tensor-parallel rank copies."""
            n = replicated = 0
            for i in layers:
                fmt = ck.layer_format(i)
                specs = LayerGeometry(m.n_routed_experts, m.hidden_size, m.moe_intermediate_size,
                                      *ck.scale_forms(i, fmt), ck.has_input_scales(i, fmt)).base_specs()
                n += sum(t.nbytes for t in specs)
                replicated += sum(t.nbytes for t in specs if t.name not in SPLIT_BASE)
            return n, replicated
        (base, base_replicated), (drafter_base, _) = base_of(served), base_of(drafters)
        dense = mtp_dense = wkv = dense_split = 0
        for name, info in ck.tensors.items():
            if name in planed:
                continue
            n = _nbytes(info.dtype, info.shape)
            layer = _layer_of(name, fam)
            if (layer is not None and fam.is_mtp(layer)) or CONTEXT_WKV.match(name):
                mtp_dense += n
                wkv += n if BLOCK_WKV.match(name) else 0
            else:
                dense += n
                dense_split += n if is_split(name) else 0
        cfg = dict(ck.config)
        source_format = ck.layer_format(served[0]).name
        names = list(ck.tensors)
    edb = expert_delta_bytes(m)
    total_experts = len(served) * m.n_routed_experts
    budget = parse_budget(delta_budget or DEFAULT_DELTA_BUDGET, total_experts * edb, what="delta budget")
    drafter = None
    if drafters:
        drafter = DrafterWeights(layout_of(names), len(drafters), drafter_base, 0, 0,
                                 len(drafters) * m.n_routed_experts, mtp_dense, wkv,
                                 any(CONTEXT_WKV.match(n) for n in names), True)
    mtp = drafter.stored if drafter is not None else mtp_dense
    fp = Footprint("checkpoint", str(path), False, base, 0, dense, edb, 0, total_experts, len(served), mtp,
                   mtp > 0, attention_from_config(cfg), cfg, source_format, base_replicated, dense_split,
                   drafter=drafter)
    return fp.with_tier(budget)


def is_cache(path: Path) -> bool:
    return (path / CACHE_MANIFEST).is_file() or (path / COMMIT_RECORD).is_file()


def footprint_from_cache(root: str | os.PathLike[str], delta_budget: str | None = None) -> Footprint:
    """Exact bytes from a committed cache's manifests (tensor byte ranges, the delta index)."""
    return footprint_of_view(open_view(root), delta_budget)


def footprint_of_view(cf: CacheView, delta_budget: str | None = None) -> Footprint:
    """Exact bytes from an opened cache: its layer manifests, delta index, dense parts and model config, each
    read through the view (a damaged one is refused, never counted)."""
    m, fam = cf.manifest.model.config, cf.manifest.model.family
    base = mtp_base = base_replicated = 0
    main_layers: list[int] = []
    for layer, lm in cf.layers.items():
        base_files = {f.path for f in lm.files if f.role == L.Role.BASE}
        n = sum(t.end - t.begin for t in lm.tensors if t.file in base_files)
        if lm.kind == LayerKind.MTP:
            mtp_base += n
        else:
            base += n
            base_replicated += sum(t.end - t.begin for t in lm.tensors
                                   if t.file in base_files and t.name not in SPLIT_BASE)
            main_layers.append(layer)
    edb = next((lm.expert_delta_bytes for lm in cf.layers.values()), expert_delta_bytes(m))
    total_experts = sum(cf.layers[i].n_experts for i in main_layers)
    drafter_layers = [i for i, lm in cf.layers.items() if lm.kind == LayerKind.MTP]
    index = cf.delta_index
    tier_layers = tuple((layer, tuple(ex)) for layer, ex in index.layers if layer in main_layers) if index else ()
    tier_experts = sum(len(ex) for _, ex in tier_layers)
    drafter_tier = sum(len(ex) for layer, ex in index.layers if layer in drafter_layers) if index else 0
    if index is not None:   # the mid tier is resident weight, as the base planes
        base += sum(cf.layers[layer].geometry().expert_mid_bytes * len(ex) for layer, ex in index.mid_layers or ()
                    if layer in main_layers)
    dense = mtp_dense = dense_split = wkv = 0
    names: list[str] = []
    for part in cf.dense_parts:
        for t in part.tensors:
            layer = _layer_of(t.name, fam)
            if (layer is not None and layer >= m.num_hidden_layers) or CONTEXT_WKV.match(t.name):
                mtp_dense += t.end - t.begin
                wkv += t.end - t.begin if BLOCK_WKV.match(t.name) else 0
                names.append(t.name)
            else:
                dense += t.end - t.begin
                dense_split += t.end - t.begin if is_split(t.name) else 0
    served = cf.served_config
    cfg = cf.manifest.model.to_dict() if served is None else served
    # MTP tensors are in the cache with --include-mtp (planes + the rest) or --lossless (all at FP4).
    mtp_exact = bool(mtp_dense)
    mtp = mtp_base + drafter_tier * edb + mtp_dense if mtp_exact else 0
    if not mtp_exact and m.num_nextn_predict_layers:
        mtp = _mtp_estimate(m, dense // max(1, m.num_hidden_layers))
    drafter = None
    if mtp_exact and fam is not None and fam.name == "deepseek_v4":
        blocks = len({_layer_of(n, fam) for n in names} - {None})
        drafter = DrafterWeights(layout_of(names), blocks, mtp_base, drafter_tier * edb, drafter_tier,
                                 sum(cf.layers[i].n_experts for i in drafter_layers), mtp_dense, wkv,
                                 any(CONTEXT_WKV.match(n) for n in names), bool(drafter_layers))
    fp = Footprint("cache", str(cf.root), True, base, tier_experts * edb, dense, edb, tier_experts,
                   total_experts, len(main_layers), mtp, mtp_exact, attention_from_config(cfg), cfg,
                   _source_format(cf, main_layers), base_replicated, dense_split, tier_layers, drafter=drafter)
    if delta_budget is not None:
        fp = fp.with_tier(parse_budget(delta_budget, total_experts * edb, what="delta budget"))
    return fp


def _source_format(cf: CacheView, main_layers: list[int]) -> str:
    """The first served main layer's expert format, or the source layout where its manifest names none."""
    return (cf.layers[main_layers[0]].source_format if main_layers else "") or str(cf.manifest.source_layout)


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
# With more than one GPU, each rank also keeps NCCL's communicator buffers and vLLM's custom all-reduce
# buffers (vllm/distributed/device_communicators/: 8 MiB a buffer, up to 64 MiB of symmetric memory at TP 2):
# an estimate, not measured here.
COMM_RESERVE = 512 * MIB


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
    speculative: Speculative | str = Speculative.NONE
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_bytes_per_token: int | None = None      # per token per layer, for attention we do not know
    cudagraph_reserve: int | None = None       # override of the estimate
    activation_reserve: int | None = None      # override of the estimate
    batched_tokens: int = DEFAULT_BATCHED_TOKENS   # vLLM's --max-num-batched-tokens
    async_scheduling: bool = True              # vLLM's default: two batches in flight (V4's windows reserve both)
    parallel: Parallel = Parallel()            # --tensor-parallel-size, --enable-expert-parallel: plan one rank

    def check(self) -> None:
        if not 0.05 <= self.utilization <= 1.0:
            raise InputError(f"--gpu-memory-utilization {self.utilization} must be in [0.05, 1.0]")
        if self.max_model_len < 1:
            raise InputError("--max-model-len must be at least 1")
        if self.max_num_seqs < 1:
            raise InputError("--max-num-seqs must be at least 1")
        if self.block_size < 1:
            raise InputError("--block-size must be at least 1")
        if self.batched_tokens < 1:
            raise InputError("--max-num-batched-tokens must be at least 1")
        if self.speculative not in Speculative.names():
            raise InputError(f"--speculative {self.speculative!r}", "use dspark, mtp or none")
        if self.kv_cache_dtype not in KV_DTYPES and self.kv_bytes_per_token is None:
            raise InputError(f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}",
                             f"use one of {', '.join(KV_DTYPES)}, or give --kv-bytes-per-token")


# --- the plan ---------------------------------------------------------------------------------------

class Where(StrEnum):
    """Where a suggested change is made."""

    SERVE = "serve"    # a `vllm serve` flag
    CACHE = "cache"    # the cache: `moet-cache retier` (a --lossless cache) or `build` with that option
    CARD = "card"      # the GPU
    GPUS = "gpus"      # more GPUs of the same card: a larger --tensor-parallel-size


SERVE, CACHE, CARD, GPUS = Where.SERVE, Where.CACHE, Where.CARD, Where.GPUS   # the short names the code and tests use


@dataclass(frozen=True)
class Suggestion:
    change: str        # context, sequences, batched-tokens, tier, base-only, kv-cache-dtype, gpu
    setting: str       # the flag that gets there, e.g. "--max-model-len 131072"
    margin: int        # bytes left over with that change
    where: Where = SERVE  # SERVE: a serve (vLLM) flag; CACHE: `moet-cache retier` / `build` with that option; CARD
    tier_experts: int | None = None   # the tier's experts after the change; None: the tier stays as it is

    def thin(self, budget: int) -> bool:
        """The change fits by less than the estimates' error."""
        return self.where != CARD and self.margin < thin_margin(budget)

    def advice(self) -> str:
        """How to make the change, in words a user can act on."""
        if self.where == CACHE:
            serve = [w for w in self.setting.split("--") if w.strip() and not w.startswith("delta-budget")]
            tier = self.setting.split(" --max-model-len")[0]
            text = f"moet-cache retier CACHE {tier} (a --lossless cache; else build again with it)"
            return text + (f", then serve with --{serve[0].strip()}" if serve else "")
        if self.where == CARD:
            return f"another card: {self.setting.removeprefix('--gpu ')}"
        if self.where == GPUS:
            return f"more GPUs of this card: {self.setting}"
        return self.setting


def thin_margin(budget: int) -> int:
    """A margin under this is within the estimates' error: 256 MiB or 1% of the budget, whichever is more."""
    return max(256 * MIB, budget // 100)


@dataclass(frozen=True)
class Plan:
    footprint: Footprint
    settings: PlanSettings
    budget: int                    # gpu total x utilization
    base: int
    delta: int
    dense: int
    mtp_weights: int               # the drafter's weights (+ DSpark's wkv copies), counted only with --speculative
    cudagraph: int
    activations: int
    kv_per_token_layer: int        # MLA: bytes a token a layer; DeepSeek-V4: 0 (see kv_v4)
    kv_layers: int                 # attention layers that cache tokens (+ MTP layers when speculating)
    kv_tokens: int                 # tokens backed: max_num_seqs x max_model_len (MLA: rounded up to blocks)
    kv: int                        # what vLLM allocates for them (V4: pages, groups, windows, null block)
    static: int                    # everything but the KV cache
    need: int
    fits: bool
    margin: int                    # budget - need (negative: short by that much)
    deciding: str                  # what makes it not fit, or what limits the headroom
    kv_room: int                   # budget - static: what the KV cache can have
    max_kv_per_token_layer: int    # MLA: the largest per-token-per-layer KV that still fits (V4: 0)
    longest_context: int           # for max_num_seqs sequences, whole blocks (KV arithmetic only)
    extra_full_seqs: int
    extra_delta_experts: int
    mtp_need: int                  # MTP weights + its KV, for speculative decoding
    mtp_fits: bool
    suggestions: tuple[Suggestion, ...]
    notes: tuple[str, ...]
    kv_raw: int = 0                # the KV records themselves, before vLLM's rounding (MLA: = kv)
    v4_kv: V4Kv | None = None      # DeepSeek-V4: the allocator's figures
    thin: bool = False             # fits, by less than thin_margin(budget)
    context_limit: int = 0         # longest_context, capped at the model's max_position_embeddings
    comm: int = 0                  # more than one GPU: the communication buffers' reserve (in static)
    drafter: DrafterNeed | None = None     # the model's drafter, by term (counted when speculating; drafter_vram)
    drafter_reserves: int = 0      # its buffers, workspace lane and CUDA graphs, counted only with --speculative

    @property
    def warnings(self) -> tuple[str, ...]:
        """What serve must repeat: a thin margin, and the notes that make vLLM refuse or misbehave."""
        out = []
        if self.thin:
            out.append(f"fits by only {self.margin / MIB:.1f} MiB, less than the estimates' error "
                       f"({thin_margin(self.budget) / MIB:.0f} MiB): vLLM may still run out of memory")
        return tuple(out) + self.notes


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def max_position_embeddings(cfg: dict[str, Any]) -> int | None:
    """The model's positions, from config.json (None when it gives no positive count)."""
    mpe = cfg.get("max_position_embeddings")
    return mpe if isinstance(mpe, int) and not isinstance(mpe, bool) and mpe > 0 else None


@dataclass(frozen=True)
class _Kv:
    """The KV term's model for one plan: bytes for (seqs, len), the longest len for a room, per-sequence cost."""

    fp: Footprint
    s: PlanSettings
    per_layer: int        # MLA (or given): bytes a token a layer; 0 for V4
    kv_layers: int
    spec: bool
    draft_layers: int = 0  # the drafter's layers vLLM builds (V4: one sliding window each)

    @property
    def v4(self) -> V4Attention | None:
        v4 = self.fp.attention.v4 if self.per_layer == 0 else None
        return replace(v4, mtp_layers=self.draft_layers) if v4 is not None else None

    def v4_figures(self, seqs: int, max_len: int, batched: int | None = None) -> V4Kv:
        assert self.v4 is not None
        return v4_kv(self.v4, max_len, seqs, batched or self.s.batched_tokens, self.s.async_scheduling, self.spec)

    def bytes(self, seqs: int, max_len: int, batched: int | None = None) -> int:
        if self.v4 is not None:
            return self.v4_figures(seqs, max_len, batched).allocated
        return seqs * _round_up(max_len, self.s.block_size) * self.per_layer * self.kv_layers

    def longest(self, room: int, seqs: int) -> int:
        if room <= 0:
            return 0
        if self.v4 is not None:
            return longest_context(self.v4, room, seqs, self.s.batched_tokens, self.s.async_scheduling, self.spec)
        per_token = self.per_layer * self.kv_layers
        return (room // (per_token * seqs)) // self.s.block_size * self.s.block_size if per_token else 0

    def most_seqs(self, room: int) -> int:
        """The most full-length sequences whose KV fits in `room`."""
        if room <= 0:
            return 0
        if self.v4 is not None:
            f = self.v4_figures(1, self.s.max_model_len)
            return max(0, (room // f.bytes_per_block - 1) // f.blocks_per_seq)
        per_seq = self.bytes(1, self.s.max_model_len)
        return room // per_seq if per_seq else 0


def make_plan(fp: Footprint, s: PlanSettings, advise: bool = True) -> Plan:
    """The whole budget: terms, verdict, which term decides, what the free bytes buy or what would fit
    (`advise` False: no suggestions, for planning a suggestion's own settings)."""
    s.check()
    check_parallel(fp.model, s.parallel)
    fp = rank_footprint(fp, s.parallel)
    notes: list[str] = []
    att = fp.attention
    if s.parallel.expert and fp.tier_layers is None and fp.tier_experts:
        notes.append("expert parallel: which experts the tier holds is chosen at build, so the fullest rank is "
                     "counted with as many tier experts as could land on it; plan the built cache for the exact figure")
    spec = s.speculative != Speculative.NONE
    layout = fp.drafter.layout if fp.drafter is not None else DrafterLayout.MTP
    if spec and not fp.mtp_bytes:
        raise InputError(f"--speculative {s.speculative}: this model has no drafter (no mtp.* blocks, "
                         "num_nextn_predict_layers is 0)", "use --speculative none")
    if spec and s.speculative != layout:
        raise InputError(f"--speculative {s.speculative}: this model's drafter is {layout} "
                         f"({'the DSpark head stack' if layout == DrafterLayout.DSPARK else 'no DSpark head stack'} "
                         "in its mtp.* tensors)", f"use --speculative {layout}")
    layers = att.layers or fp.served_layers
    mtp_layers = draft_layers(layout, fp.model) if fp.mtp_bytes else 0
    kv_layers = layers + (mtp_layers if spec else 0)
    v4 = att.v4 if s.kv_bytes_per_token is None else None
    if s.kv_bytes_per_token is not None:
        per_layer = s.kv_bytes_per_token
        notes.append(f"KV: {per_layer} B per token per layer as given (--kv-bytes-per-token)")
    elif v4 is not None:
        per_layer = 0
        if s.kv_cache_dtype not in KV_DTYPES_V4:
            raise InputError(f"DeepSeek-V4 runs only with FP8 KV in vLLM 0.34, not --kv-cache-dtype {s.kv_cache_dtype}",
                             "use --kv-cache-dtype fp8_ds_mla (vLLM turns fp8 into it)")
        if s.block_size != BLOCK_SIZE_V4:
            raise InputError(f"DeepSeek-V4's attention in vLLM 0.34 takes only --block-size {BLOCK_SIZE_V4}, "
                             f"not {s.block_size}")
    else:
        per_layer = kv_bytes_per_token_layer(att, s.kv_cache_dtype)
        if att.note:
            notes.append(att.note)
        if s.kv_cache_dtype in SPARSE_ONLY and not att.index_head_dim:
            notes.append(f"{s.kv_cache_dtype} runs only on vLLM's sparse-MLA backends (DeepSeek V3.2 and later); "
                         "this config has no sparse indexer, so vLLM may refuse it")
    mpe = max_position_embeddings(fp.model)
    past_positions = mpe is not None and mpe < s.max_model_len   # vLLM refuses it: no memory makes it fit
    if past_positions:
        notes.append(f"--max-model-len {s.max_model_len} exceeds the model's max_position_embeddings {mpe}: "
                     "vLLM refuses it unless the rope scaling allows it (or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)")
    kvm = _Kv(fp, s, per_layer, kv_layers, spec, mtp_layers)
    v4f = kvm.v4_figures(s.max_num_seqs, s.max_model_len) if v4 is not None else None
    seq_tokens = s.max_model_len if v4 is not None else _round_up(s.max_model_len, s.block_size)
    kv_tokens = seq_tokens * s.max_num_seqs
    kv = kvm.bytes(s.max_num_seqs, s.max_model_len)
    budget = int(s.gpu.total_bytes * s.utilization)
    graphs = s.cudagraph_reserve if s.cudagraph_reserve is not None else cudagraph_reserve(len(s.cudagraph_sizes))
    acts = s.activation_reserve if s.activation_reserve is not None else \
        activation_reserve(fp.model, s.batched_tokens)
    drafter = None
    if fp.drafter is not None and v4 is not None:
        args = (replace(v4, mtp_layers=mtp_layers), s.max_model_len, s.max_num_seqs, s.batched_tokens,
                s.async_scheduling)
        drafter = drafter_need(fp.drafter, fp.model, s.batched_tokens, s.cudagraph_sizes, acts,
                               0 if s.cudagraph_reserve is not None else CUDAGRAPH_PER_SIZE,
                               v4_kv(*args, True).allocated - v4_kv(*args).allocated)
    mtp_w = (drafter.weights + drafter.copies if drafter is not None else fp.mtp_bytes) if spec else 0
    reserves = drafter.buffers + drafter.workspace + drafter.graphs if spec and drafter is not None else 0
    if spec and not fp.mtp_exact:
        notes.append("the MTP layer's weights are an estimate (the cache holds no MTP planes)")
    elif spec and fp.drafter is not None and not fp.drafter.planed:
        notes.append("the cache holds the drafter's tensors but no planes for its routed experts: the moet method "
                     "cannot serve it; build the cache with --include-drafter")
    comm = COMM_RESERVE if s.parallel.size > 1 else 0
    static = fp.base_bytes + fp.delta_tier_bytes + fp.dense_bytes + mtp_w + reserves + graphs + acts + comm
    need = static + kv
    margin = budget - need
    kv_room = budget - static
    refused = attention_refusal(att, s.gpu)
    fits = margin >= 0 and not past_positions and refused is None
    if refused is not None:
        deciding = refused
    elif past_positions:
        deciding = (f"context: --max-model-len {s.max_model_len:,} is past the model's {mpe:,} positions "
                    "(max_position_embeddings)")
    elif static > budget:
        terms = {"base planes": fp.base_bytes, "dense weights": fp.dense_bytes, "delta tier": fp.delta_tier_bytes,
                 "drafter weights": mtp_w, "drafter reserves": reserves, "CUDA-graph reserve": graphs,
                 "activation reserve": acts, "communication reserve": comm}
        top = max(terms, key=terms.__getitem__)
        alone = " (it alone exceeds the budget)" if terms[top] > budget else ""
        deciding = (f"weights and reserves exceed the budget before any KV: the largest term is {top}, "
                    f"{terms[top] / GIB:.3f} GiB{alone}")
    elif not fits and drafter is not None and spec and margin + drafter.total >= 0:
        deciding = (f"the {layout} drafter: {drafter.total / GIB:.3f} GiB with its KV; without it the rest fits "
                    f"with {(margin + drafter.total) / GIB:.3f} GiB to spare")
    elif not fits:
        deciding = "KV cache: the weights fit, the KV cache for these settings does not"
    else:
        deciding = "KV cache: the headroom is what the KV cache leaves"
    room = max(0, kv_room)
    max_per_layer = room // (kv_tokens * kv_layers) if v4 is None and kv_tokens and kv_layers else 0
    longest = kvm.longest(room, s.max_num_seqs)
    limit = min(longest, mpe) if mpe is not None else longest
    extra_seqs = max(0, kvm.most_seqs(room) - s.max_num_seqs) if fits else 0
    extra_experts = min(max(0, margin) // fp.expert_delta_bytes if fp.expert_delta_bytes else 0,
                        fp.total_experts - fp.tier_experts)
    if not fp.mtp_bytes:
        mtp_need = 0
    elif drafter is not None:
        mtp_need = drafter.total
    elif v4 is not None:  # the drafter's attention is a sliding window only (compress ratio 1 in vLLM)
        args = (replace(v4, mtp_layers=mtp_layers), s.max_model_len, s.max_num_seqs, s.batched_tokens,
                s.async_scheduling)
        mtp_need = fp.mtp_bytes + v4_kv(*args, True).allocated - v4_kv(*args).allocated
    else:
        mtp_need = fp.mtp_bytes + mtp_layers * per_layer * kv_tokens
    mtp_fits = bool(fp.mtp_bytes) and not past_positions and (fits if spec else margin >= mtp_need)
    thin = fits and margin < thin_margin(budget)
    if fits or not advise:
        suggestions: tuple[Suggestion, ...] = ()
    elif refused is not None:
        suggestions = _cards_it_runs_on(fp, s)
    elif past_positions:
        suggestions = _within_positions(fp, s, kvm, budget, static, acts, mpe)
    else:
        suggestions = _suggestions(fp, s, kvm, budget, static, acts, mpe)
    return Plan(fp, s, budget, fp.base_bytes, fp.delta_tier_bytes, fp.dense_bytes, mtp_w, graphs, acts,
                per_layer, kv_layers, kv_tokens, kv, static, need, fits, margin, deciding, kv_room,
                max_per_layer, longest, extra_seqs, extra_experts, mtp_need, mtp_fits, suggestions,
                tuple(notes), v4f.raw if v4f is not None else kv, v4f, thin, limit, comm, drafter, reserves)


def attention_refusal(att: Attention, gpu: GpuPreset) -> str | None:
    """Why vLLM 0.34 would refuse this model's attention on this card (None: it runs, or the card is not known)."""
    if att.kind != AttentionKind.DEEPSEEK_V4 or gpu.capability is None or gpu.capability[0] in V4_ATTENTION_MAJORS:
        return None
    cc = ".".join(map(str, gpu.capability))
    card = gpu.note.split(",")[0] if GPU_PRESETS.get(gpu.name) == gpu else gpu.name
    return (f"attention: vLLM 0.34 runs DeepSeek-V4's attention only on compute capability 9.x, 10.x and 12.x "
            f"(FlashMLA sparse, FlashInfer sparse); the {card} is {cc}, where vLLM refuses it")


def _cards_it_runs_on(fp: Footprint, s: PlanSettings) -> tuple[Suggestion, ...]:
    """The smallest preset card the attention runs on that fits the same settings, GPU for GPU."""
    whole = fp.whole or fp
    for g in sorted(GPU_PRESETS.values(), key=lambda g: g.total_bytes):
        if attention_refusal(fp.attention, g) is None:
            p = make_plan(whole, replace(s, gpu=g))
            if p.fits:
                each = f", {s.parallel.size} of them" if s.parallel.size > 1 else ""
                return (Suggestion("gpu", f"--gpu {g.name} ({g.note}{each})", p.margin, CARD),)
    return ()


def _within_positions(fp: Footprint, s: PlanSettings, kvm: _Kv, budget: int, static: int, acts: int,
                      mpe: int) -> tuple[Suggestion, ...]:
    """A context past the model's positions: the longest context within them that fits, else the changes that
    make the model's whole context fit, each with that --max-model-len."""
    within = replace(s, max_model_len=mpe)
    kvm_within = replace(kvm, s=within)
    left = budget - static - kvm_within.bytes(s.max_num_seqs, mpe)
    if left >= 0:
        return (Suggestion("context", f"--max-model-len {mpe}", left),)
    out = []
    for x in _suggestions(fp, within, kvm_within, budget, static, acts, mpe):
        if "--max-model-len" in x.setting:
            out.append(x)
        elif x.where == CARD:
            out.append(replace(x, setting=f"{x.setting}, with --max-model-len {mpe}"))
        else:
            out.append(replace(x, setting=f"{x.setting} --max-model-len {mpe}"))
    return tuple(out)


def _suggestions(fp: Footprint, s: PlanSettings, kvm: _Kv, budget: int, static: int, acts: int,
                 mpe: int | None) -> tuple[Suggestion, ...]:
    """The nearest single changes that fit, each with the margin it leaves. Only changes vLLM and the model
    accept: no context beyond max_position_embeddings, no KV dtype the attention cannot use; a tier change is
    a change to the cache (`where` CACHE), never offered as a serve flag."""
    out: list[Suggestion] = []
    room = budget - static
    n, L = s.max_num_seqs, s.max_model_len

    def context(room_: int) -> int:
        longest = kvm.longest(room_, n)
        return min(longest, mpe) if mpe is not None else longest

    if room > 0:
        longest = context(room)
        if longest >= min(s.block_size, L):
            out.append(Suggestion("context", f"--max-model-len {longest}", room - kvm.bytes(n, longest)))
        if n > 1:
            most = kvm.most_seqs(room)
            if most >= 1:
                out.append(Suggestion("sequences", f"--max-num-seqs {most}", room - kvm.bytes(most, L)))
        if kvm.v4 is not None:  # V4's windows are reserved for the tokens in flight: fewer batched tokens help
            for b in (4096, 2048, 1024, 512):
                if b >= s.batched_tokens:
                    continue
                m = make_plan(fp.whole or fp, replace(s, batched_tokens=b), advise=False).margin  # every term that scales with b
                if m >= 0:
                    out.append(Suggestion("batched-tokens", f"--max-num-batched-tokens {b}", m))
                    break
    if s.speculative != Speculative.NONE:
        m = make_plan(fp.whole or fp, replace(s, speculative=Speculative.NONE), advise=False).margin
        if m >= 0:
            out.append(Suggestion("no-drafter", "--no-speculative", m))
    kv = kvm.bytes(n, L)
    short = static + kv - budget
    # Expert parallelism: which rank a tier expert lands on depends on the build's choice, so no smaller tier
    # is named (base-only is); tensor parallelism: a rank holds 1/N of each tier expert, the cache all of it.
    whole_edb = (fp.whole or fp).expert_delta_bytes
    if fp.delta_tier_bytes and short <= fp.delta_tier_bytes:
        keep = (fp.delta_tier_bytes - short) // fp.expert_delta_bytes * fp.expert_delta_bytes
        if keep > 0 and not s.parallel.expert:
            experts = keep // fp.expert_delta_bytes
            # Exact bytes: a rounded GiB figure could round up past what fits.
            out.append(Suggestion("tier", f"--delta-budget {experts * whole_edb} ({experts} experts, "
                                          f"{experts * whole_edb / GIB:.3f} GiB)",
                                  budget - (static - fp.delta_tier_bytes + keep + kv), CACHE, experts))
        out.append(Suggestion("base-only", "--delta-budget 0", budget - (static - fp.delta_tier_bytes + kv), CACHE, 0))
    elif fp.delta_tier_bytes:  # dropping the tier is not enough alone: base-only and a shorter context
        room0 = room + fp.delta_tier_bytes
        longest = context(room0)
        if longest >= min(s.block_size, L):
            out.append(Suggestion("base-only+context", f"--delta-budget 0 --max-model-len {longest}",
                                  room0 - kvm.bytes(n, longest), CACHE, 0))
    if s.kv_bytes_per_token is None and fp.attention.kind == AttentionKind.MLA:
        for dtype in ("fp8_ds_mla", "fp8"):
            if dtype not in fp.attention.kv_dtypes:
                continue
            p = kv_bytes_per_token_layer(fp.attention, dtype)
            if p < kvm.per_layer:
                m = budget - (static + _round_up(L, s.block_size) * n * p * kvm.kv_layers)
                if m >= 0:
                    out.append(Suggestion("kv-cache-dtype", f"--kv-cache-dtype {dtype}", m))
                    break
    if not out:
        out.append(Suggestion("gpu", f"a card with {short / GIB:.2f} GiB more usable memory", 0, CARD))
        need = static + kv
        for g in sorted(GPU_PRESETS.values(), key=lambda g: g.total_bytes):
            m = int(g.total_bytes * s.utilization) - need
            if m >= 0 and g.total_bytes > s.gpu.total_bytes and attention_refusal(fp.attention, g) is None:
                out.append(Suggestion("gpu", f"--gpu {g.name} ({g.note})", m, CARD))
                break
    more = _more_gpus(fp, s)
    return tuple(out) + ((more,) if more is not None else ())


def _more_gpus(fp: Footprint, s: PlanSettings) -> Suggestion | None:
    """The fewest more GPUs of the same card that make the same settings fit (a size the model allows)."""
    whole = fp.whole or fp
    if not whole.model.get("n_routed_experts"):   # a footprint without the model's dims: no split to check
        return None
    for n in allowed_sizes(whole.model, s.parallel.expert):
        if n <= s.parallel.size:
            continue
        p = make_plan(whole, replace(s, parallel=Parallel(n, s.parallel.expert)))
        if p.fits:
            more = n - s.parallel.size
            return Suggestion("gpus", f"{' '.join(p.settings.parallel.flags())} ({more} more GPU"
                                      f"{'s' if more > 1 else ''}, {n} in all)", p.margin, GPUS)
    return None


def plan_for(path: str | os.PathLike[str], settings: PlanSettings, delta_budget: str | None = None) -> Plan:
    """Read a cache or checkpoint and plan it (the library entry point of `moet-cache plan`)."""
    return make_plan(read_footprint(path, delta_budget), settings)


def parse_sizes_list(text: str) -> tuple[int, ...]:
    """'1,2,4,8', vLLM's own '1 2 4 8' or '[1, 2, 4, 8]' -> (1, 2, 4, 8); 'none' or '' -> () (no CUDA graphs)."""
    t = str(text).strip().lower().strip("[]").strip()
    if t in ("", "none", "0"):
        return ()
    try:
        sizes = tuple(int(x) for x in t.replace(" ", ",").split(",") if x.strip())
    except ValueError:
        raise InputError(f"cannot read the capture sizes {text!r}", "write them as vLLM does, e.g. 1 2 4 8") from None
    if not sizes or any(x < 1 or x > 1 << 16 for x in sizes):
        raise InputError(f"capture sizes {text!r} must be positive batch sizes")
    return tuple(sorted(set(sizes)))


def detect_gpu(visible_devices: str) -> GpuPreset | None:
    """The memory of the first GPU of `visible_devices` (CUDA_VISIBLE_DEVICES as the process that will use it
    sees it; "" = the first GPU), from nvidia-smi (no CUDA context is created); None without one."""
    import shutil
    import subprocess
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    visible = visible_devices.split(",")[0].strip()
    args = [smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    if visible.isdigit():
        args += ["-i", visible]
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=20, check=True).stdout
        name, mib = out.strip().splitlines()[0].rsplit(",", 1)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    # The compute capability, where this nvidia-smi reports it (older drivers do not): which attention runs.
    capability = None
    try:
        cc = subprocess.run([*args[:1], "--query-gpu=compute_cap", *args[2:]], capture_output=True, text=True,
                            timeout=20, check=True).stdout.strip().splitlines()[0].split(".")
        capability = (int(cc[0]), int(cc[1])) if len(cc) == 2 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    return GpuPreset(name.strip(), int(mib.strip()) * MIB, "seen by nvidia-smi", capability)
