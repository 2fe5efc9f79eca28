"""The routed-expert sum the ladder evaluates with: model.routed_from_weights, faster, the same bits.

`model.routed_from_weights` (the model's own definition, which training runs) accumulates each expert's
weighted output with an out-of-place `index_add`, which copies the whole [T, H] output once per expert;
on a CPU that copy, not the experts' matmuls, is most of a forward's time. Here the accumulation is the
in-place `index_add_` on one buffer. Every matmul is the same call on the same rows, and each output row
receives the same float additions in the same order (experts in ascending id, from a zero buffer), so
the result is bit for bit the model's (tests/test_quality.py checks it with torch.equal).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

RoutedLayer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def routed_sum(w13: torch.Tensor, w2: torch.Tensor) -> RoutedLayer:
    """Routed experts from stacked weights w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]."""
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
            out.index_add_(0, t, (act @ w2[e].T) * flat_w[pick].unsqueeze(1))
        return out
    return run
