"""The footprint record: the resident weights of a served cache, term by term, and the share of them the
fullest rank holds when vLLM splits the model over several GPUs (parallel.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .drafter_vram import DrafterWeights
from .parallel import Parallel, fullest_rank_experts, share
from .attention import Attention


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
    mid_experts: int = 0          # the served main layers' mid-tier experts (their bytes are in base_bytes)
    expert_mid_bytes: int = 0     # one expert's mid planes and tables (what --mid-budget counts)

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
