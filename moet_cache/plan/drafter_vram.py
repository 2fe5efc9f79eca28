"""What a speculative drafter adds to the VRAM plan of DeepSeek-V4, as vLLM 0.34 allocates it.

Two drafters ship inside V4 checkpoints as `mtp.K.*` blocks: the MTP block of the first V4-Flash release
(`mtp.0`) and the DSpark drafter of V4-Flash-0731 (`mtp.0`-`mtp.2` plus a head stack: `main_proj`,
`main_norm`, `markov_head`, `confidence_head`, `norm`, `hc_head_*`). vLLM builds either as a second model
that takes the target's quantization, so the moet method serves the drafter's routed experts on their
planes. What it adds on the GPU (docs/SERVING.md "The drafter" cites the code for each term):

- weights: the blocks' planes (base, and tier experts where the cache's tier holds them) and every other
  drafter tensor as the cache stores it; the embedding and LM head are the target's
  (`share_target_lm_head`, `maybe_share_target_embed`: no bytes);
- DSpark's `context_wkv_proj`, filled with a copy of each block's `attn.wkv` unless the checkpoint ships it
  (`_duplicate_context_wkv_weights`);
- persistent buffers: the speculator's `hidden_states` (max_num_batched_tokens x hidden, bf16); DSpark's
  own `topk_indices_buffer` (max_num_batched_tokens x index_topk int32; MTP shares the target's) and its
  `context_positions` (int64 a token);
- DSpark's second workspace lane (`uses_separate_workspace_lane`): estimated as one more activation reserve;
- the drafter's CUDA graphs: one a decode size, the request counts vLLM derives from the capture sizes
  and the query length 1 + num_speculative_tokens (`VllmConfig._split_cudagraph_capture_sizes`);
- KV: one sliding-window cache a draft layer (compress ratio 0), packed into the target's groups
  (kv_v4.layer_specs); DSpark builds `n_mtp_layers` (else 3) layers, MTP `num_nextn_predict_layers`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..enums import StrEnum

# DSpark's head-stack tensors as the checkpoint names them (vLLM 0.34 DSparkDeepseekV4ForCausalLM._remap_dspark_name).
HEAD_STACK = re.compile(r"^mtp\.\d+\.(main_proj|main_norm|markov_head|confidence_head)\.|^context_wkv_proj\.")
CONTEXT_WKV = re.compile(r"^context_wkv_proj\.")
BLOCK_WKV = re.compile(r"^mtp\.\d+\.attn\.wkv\.")
DSPARK_DEFAULT_LAYERS = 3          # DSparkDeepseekV4Model: getattr(config, "n_mtp_layers", None) or 3
BF16, INT32, INT64 = 2, 4, 8


class DrafterLayout(StrEnum):
    """Which drafter a checkpoint's `mtp.K` blocks are."""

    MTP = "mtp"          # e_proj/h_proj blocks, vLLM's DeepSeekV4MTP
    DSPARK = "dspark"    # the head stack above, vLLM's DSparkDeepseekV4ForCausalLM


def layout_of(names: list[str] | set[str]) -> DrafterLayout:
    """DSpark when any head-stack tensor is present, else MTP."""
    return DrafterLayout.DSPARK if any(HEAD_STACK.match(n) for n in names) else DrafterLayout.MTP


@dataclass(frozen=True)
class DrafterWeights:
    """The drafter's tensors as a cache holds them (exact) or a build of a checkpoint would (computed)."""

    layout: DrafterLayout
    blocks: int                # mtp.K blocks present
    expert_bytes: int          # the routed experts: base planes, or their FP4 bytes where not planed
    tier_bytes: int            # drafter experts in the cache's delta tier
    tier_experts: int
    experts: int               # routed experts over the drafter blocks
    dense_bytes: int           # every other drafter tensor (the blocks' attention, norms, shared experts, head stack)
    wkv_bytes: int             # the blocks' attn.wkv weights and scales
    context_wkv_shipped: bool  # the checkpoint ships context_wkv_proj (then no copy is made)
    planed: bool               # False: the cache holds no planes for the drafter (FP4 estimate; build with it)

    @property
    def stored(self) -> int:
        return self.expert_bytes + self.tier_bytes + self.dense_bytes


def draft_layers(layout: DrafterLayout, cfg: dict[str, Any]) -> int:
    """The draft layers vLLM 0.34 builds: DSpark `n_mtp_layers or 3`, MTP `num_nextn_predict_layers`."""
    if layout == DrafterLayout.DSPARK:
        n = cfg.get("n_mtp_layers")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else DSPARK_DEFAULT_LAYERS
    n = cfg.get("num_nextn_predict_layers")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def speculative_tokens(layout: DrafterLayout, cfg: dict[str, Any]) -> int:
    """num_speculative_tokens as vLLM resolves it: DSpark its block size (`block_size`, else
    `dspark_block_size`; DSparkSpeculatorConfig.resolve_num_speculative_tokens), MTP one a draft layer."""
    if layout == DrafterLayout.DSPARK:
        for key in ("block_size", "dspark_block_size"):
            n = cfg.get(key)
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                return n
        return 1
    return draft_layers(layout, cfg)


def decode_graph_sizes(capture_sizes: tuple[int, ...], query_len: int) -> tuple[int, ...]:
    """The request counts of the decode graphs vLLM 0.34 captures for a query length (legacy capture sizes:
    {cdiv(s, q) for s in sizes if cdiv(s, q) * q <= max(sizes)})."""
    if not capture_sizes:
        return ()
    top = max(capture_sizes)
    return tuple(sorted({-(-s // query_len) for s in capture_sizes if -(-s // query_len) * query_len <= top}))


@dataclass(frozen=True)
class DrafterNeed:
    """What serving with the drafter adds to the plan, by term (bytes)."""

    layout: DrafterLayout
    layers: int                # draft layers vLLM builds
    speculative_tokens: int
    weights: int               # planes + tier + dense as stored
    copies: int                # DSpark's context_wkv_proj filled from the blocks' wkv
    buffers: int               # topk indices, hidden states, context positions
    workspace: int             # DSpark's second workspace lane (an estimate)
    graphs: int                # the drafter's CUDA graphs (an estimate)
    kv: int                    # the KV allocation with the draft layers minus without

    @property
    def static(self) -> int:
        return self.weights + self.copies + self.buffers + self.workspace + self.graphs

    @property
    def total(self) -> int:
        return self.static + self.kv


def drafter_need(d: DrafterWeights, cfg: dict[str, Any], batched_tokens: int, capture_sizes: tuple[int, ...],
                 activation_lane: int, graph_per_size: int, kv: int) -> DrafterNeed:
    """The drafter's terms for these settings; `kv` is the KV difference the caller's allocator model gives."""
    dspark = d.layout == DrafterLayout.DSPARK
    hidden = cfg.get("hidden_size", 0)
    topk = cfg.get("index_topk", 0)
    k = speculative_tokens(d.layout, cfg)
    buffers = batched_tokens * hidden * BF16                      # the speculator's hidden_states
    if dspark:
        buffers += batched_tokens * (topk * INT32 + INT64)         # its own topk_indices_buffer, context_positions
    copies = d.wkv_bytes if dspark and not d.context_wkv_shipped else 0
    graphs = graph_per_size * len(decode_graph_sizes(capture_sizes, 1 + k))
    return DrafterNeed(d.layout, draft_layers(d.layout, cfg), k, d.stored, copies, buffers,
                       activation_lane if dspark else 0, graphs, kv)
