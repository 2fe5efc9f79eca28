"""Pairs whose expert id is -1: skipped, with no host sync, on every path.

vLLM 0.34 marks the rows that pad a batch to a CUDA-graph size (and data-parallel padding) with expert
id -1 in every top-k slot (VLLM_MOE_SKIP_PADDING, on by default: fused_moe/router/base_router.py,
get_moe_padding_mask), for the dispatch and experts to skip. The plane kernels read an expert id as an
index (its planes, tables, tier row; align.py counts and sorts by it), so no -1 may reach them:
`skip_padding` rewrites the routing first, with tensor ops only, so that a CUDA graph holds it.

- A -1 pair takes the expert of the same slot of row 0, with weight 0. Where row 0 is a real row (vLLM pads
  at the end of the batch) that expert's weights are read anyway: padding costs no extra weight traffic.
- A row whose every slot is -1 gets zero activations, so its pairs compute exact zeros and its output is
  0: a weight of 0 times an output made non-finite by whatever the padding row holds would be NaN.

Why the real rows' bits do not change: every kernel computes a pair's output from its own token's row
alone (a column of an mma, a row of a tl.dot), and each token's top-k slots are summed from +0 (moe_sum,
the w2 kernel's sum_when_last, torch's sum), to which a padding pair's +-0 adds nothing. Only the kernels'
choice, which follows the padded pair count (launch.Config.pick), can differ from a batch without the
padding rows. A -1 slot beside real ones (under expert parallelism another rank's expert: `to_local`) adds
+-0 as long as the stand-in expert's output for that token is finite.
"""

from __future__ import annotations

import torch


def skip_padding(x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, topk_weights, topk_ids) with every -1 pair pointed at a valid expert with weight 0, and the rows
    of only -1 pairs zeroed in x; new tensors, the inputs untouched. For T > 0 and top_k > 0."""
    pad = topk_ids < 0
    ids = torch.where(pad, topk_ids[:1].clamp(min=0), topk_ids)
    weights = topk_weights.masked_fill(pad, 0)
    return x.masked_fill(pad.all(dim=1, keepdim=True), 0), weights, ids


def to_local(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """Expert parallelism: global expert ids -> this rank's local ids through vLLM's `expert_map` (global id ->
    local id, -1 where another rank holds the expert), -1 kept; tensor ops only (a CUDA graph holds it).
    The pairs that come out -1 are skipped as padding is, so the rank returns its experts' part of the sum."""
    local = expert_map.to(device=topk_ids.device, dtype=topk_ids.dtype)[topk_ids.clamp(min=0).long()]
    return torch.where(topk_ids < 0, topk_ids, local)
