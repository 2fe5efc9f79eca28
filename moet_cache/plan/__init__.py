"""Plan the VRAM of serving a cache or checkpoint: what its weights take on each GPU, what is left for the KV
cache, what fits, and the nearest changes that fit when it does not.

    gpus       the preset cards, a size given on the command line, the card nvidia-smi sees
    attention  the model's attention from config.json: KV bytes a token a layer, the KV dtypes and cards it runs on
    footprint  the record of the resident weights by term, and the fullest rank's share of them
    measure    a footprint read: exact from a cache's manifests, computed from a checkpoint's headers
    settings   the serve settings a plan is asked, their defaults, the reserves estimated from them
    record     the plan's records: its terms and verdict, a suggested change
    kv         the KV term: bytes for (sequences, length), the longest length and most sequences a room holds
    budget     make_plan: the terms summed against the budget, the deciding term, the suggestions
Layered in that order: gpus imports none of the others, budget imports them all. Below them:
    kv_v4         DeepSeek-V4's KV cache as vLLM allocates it: the per-layer caches, pages, groups, blocks
    drafter_vram  what a speculative drafter adds to the plan
    parallel      what one GPU holds when vLLM splits a model over N GPUs, and which N the planes allow
"""

from __future__ import annotations

from .attention import (KV_DTYPES, SPARSE_ONLY, Attention, AttentionKind, attention_from_config, attention_refusal,
                        kv_bytes_per_token_layer)
from .budget import make_plan, plan_for
from .footprint import Footprint, rank_footprint
from .gpus import DEFAULT_GPU, GPU_PRESETS, GpuPreset, detect_gpu, resolve_gpu
from .kv import KvTerm, max_position_embeddings
from .measure import (SPLIT_BASE, expert_delta_bytes, footprint_from_cache, footprint_from_checkpoint, footprint_of_view,
                      is_cache, read_footprint)
from .record import CACHE, CARD, GPUS, SERVE, Plan, Suggestion, Where, thin_margin
from .settings import (COMM_RESERVE, CUDAGRAPH_BASE, CUDAGRAPH_PER_SIZE, DEFAULT_BATCHED_TOKENS, DEFAULT_BLOCK_SIZE,
                       DEFAULT_CUDAGRAPH_SIZES, DEFAULT_KV_DTYPE, DEFAULT_MAX_MODEL_LEN, DEFAULT_UTILIZATION,
                       PlanSettings, Speculative, activation_reserve, cudagraph_reserve, parse_sizes_list)

__all__ = [
    "CACHE", "CARD", "COMM_RESERVE", "CUDAGRAPH_BASE", "CUDAGRAPH_PER_SIZE", "DEFAULT_BATCHED_TOKENS",
    "DEFAULT_BLOCK_SIZE", "DEFAULT_CUDAGRAPH_SIZES", "DEFAULT_GPU", "DEFAULT_KV_DTYPE", "DEFAULT_MAX_MODEL_LEN",
    "DEFAULT_UTILIZATION", "GPUS", "GPU_PRESETS", "KV_DTYPES", "SERVE", "SPARSE_ONLY", "SPLIT_BASE", "Attention",
    "AttentionKind", "Footprint", "GpuPreset", "KvTerm", "Plan", "PlanSettings", "Speculative", "Suggestion", "Where",
    "activation_reserve", "attention_from_config", "attention_refusal", "cudagraph_reserve", "detect_gpu",
    "expert_delta_bytes", "footprint_from_cache", "footprint_from_checkpoint", "footprint_of_view", "is_cache",
    "kv_bytes_per_token_layer", "make_plan", "max_position_embeddings", "parse_sizes_list", "plan_for",
    "rank_footprint", "read_footprint", "resolve_gpu", "thin_margin",
]
