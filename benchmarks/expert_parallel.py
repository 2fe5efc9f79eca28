"""An expert-parallel rank's MoE layer, for `bench_moe.py --expert-parallel`: which experts rank r of N holds,
its layer cut from the whole one, the routed pairs it computes, and its time per routed pair against the
whole layer's.

Rank r of N holds the experts of vLLM's default linear placement (fused_moe/expert_map_manager.py
`determine_expert_map`, written out here; tests/test_bench_ep.py checks it against vLLM's), in local order,
with the tier rows of its experts renumbered to local ids, as the loader hands a rank its share
(load.Shard, docs/LOADER.md "A rank's share"). It is called as the served path calls it
(integrations/vllm/method.py `apply`): the router's global ids mapped through the rank's expert map
(runtime.padding.to_local, another rank's expert -1), then runtime.fused_moe.

A rank's time per routed pair is its time over the pairs routed to its experts; N ranks together: the sum of
their times over the sum of their pairs (every routed pair, once), so a rank that gets no pair at a small
batch still counts its time. The ratio is that against the whole layer's time over its pairs. On CUDA the
kernels of a rank run every one of the T x top_k pairs: another rank's pair, like a padding pair, is computed
on a stand-in expert with weight 0 (runtime/padding.py skip_padding), so it costs a rank what its own pairs
cost, and the ratio shows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moet_cache.load.assemble import DELTA_EXPERTS, MID_EXPERTS, MID_NAMES
from moet_cache.runtime.padding import to_local

#: the goal (docs/RUNTIME.md, "Measuring"): the ranks' time a routed pair within 5% of the whole layer's
GOAL_RATIO = 1.05

#: the tier's planes: rows of the experts `delta_experts` names, not one row an expert (docs/LOADER.md)
TIER_PLANES = ("w13_delta", "w2_delta")


def expert_map(ep: int, rank: int, n_experts: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """vLLM's expert_map of rank `rank` of `ep` under its linear placement: int32 [n_experts], global id ->
    local id, -1 where another rank holds the expert; the first n_experts % ep ranks hold one more."""
    base, extra = divmod(n_experts, ep)
    start = rank * base + min(rank, extra)
    count = base + (rank < extra)
    out = torch.full((n_experts,), -1, dtype=torch.int32, device=device)
    out[start:start + count] = torch.arange(count, dtype=torch.int32, device=device)
    return out


def rank_experts(emap: torch.Tensor) -> tuple[int, ...]:
    """The global ids of the experts an expert map gives its rank, in local order (as the method's shard_of
    reads them)."""
    local = emap.tolist()
    return tuple(sorted((g for g, k in enumerate(local) if k >= 0), key=lambda g: local[g]))


def rank_layer(whole: dict[str, torch.Tensor], experts: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """A rank's tensors cut from a whole layer's (the loader's natural layout, expand=False): one row an
    expert of `experts`, in that order; the tier's rows of those experts, `delta_experts` renumbered to local
    ids; an empty mid tier as it is."""
    if MID_EXPERTS in whole and whole[MID_EXPERTS].numel():
        # as the loader, which refuses a rank's load of such a layer (docs/RUNTIME.md)
        raise ValueError("a layer with a mid tier is not cut into ranks' shares")
    device, n = whole["w13_base"].device, whole["w13_base"].shape[0]
    local = {e: k for k, e in enumerate(experts)}
    tier = whole[DELTA_EXPERTS].tolist() if DELTA_EXPERTS in whole else []
    rows = sorted((k for k, e in enumerate(tier) if e in local), key=lambda k: local[tier[k]])
    pick = {"expert": torch.tensor(experts, dtype=torch.long, device=device),
            "tier": torch.tensor(rows, dtype=torch.long, device=device)}
    out: dict[str, torch.Tensor] = {}
    for name, t in whole.items():
        if name == DELTA_EXPERTS:
            out[name] = torch.tensor([local[tier[k]] for k in rows], dtype=t.dtype, device=device)
        elif name in TIER_PLANES:
            out[name] = t[pick["tier"]]
        elif name in MID_NAMES:
            out[name] = t  # empty (refused above otherwise)
        elif t.dim() and t.shape[0] == n:
            out[name] = t[pick["expert"]]
        else:
            raise ValueError(f"{name} {tuple(t.shape)} is neither one row an expert nor a tier's rows")
    return out


def pairs_of(ids: torch.Tensor, emap: torch.Tensor | None = None) -> int:
    """The routed pairs among `ids` (global ids, -1 skipped) that a rank computes: those of its experts
    (to_local gives them a local id), or every pair for the whole layer (emap None)."""
    return int(((ids if emap is None else to_local(ids, emap)) >= 0).sum())


@dataclass(frozen=True)
class RankTime:
    """One rank's (or, rank None, the whole layer's) time for a layer call, as the routed pairs it computes
    averaged over the routings a harness times."""

    rank: int | None
    us: float
    pairs: float

    @property
    def us_per_pair(self) -> float | None:
        return self.us / self.pairs if self.pairs else None


def ep_figures(whole: RankTime, ranks: list[RankTime]) -> dict[str, float | bool]:
    """N ranks against the whole layer: µs a routed pair of each (the ranks': their summed time over their
    summed pairs), the ratio, the slowest rank's (of those with pairs) against the whole layer's, and whether
    the ratio is over GOAL_RATIO."""
    whole_per_pair = whole.us / whole.pairs
    ranks_per_pair = sum(r.us for r in ranks) / sum(r.pairs for r in ranks)
    slowest = max(r.us_per_pair for r in ranks if r.pairs)
    return {"whole_us_per_pair": whole_per_pair, "ranks_us_per_pair": ranks_per_pair,
            "ratio": ranks_per_pair / whole_per_pair, "worst_rank_ratio": slowest / whole_per_pair,
            "over_goal": ranks_per_pair / whole_per_pair > GOAL_RATIO}


def print_table(rows: list[dict]) -> None:
    """The `ep` rows (bench_moe.py --expert-parallel) as a table, '!' beside a ratio over GOAL_RATIO, then the
    rows over it counted."""
    ep = [r for r in rows if r["what"] == "ep"]
    print(f"\nexpert parallel: µs a routed pair, N ranks together against the whole layer; goal <= {GOAL_RATIO}x "
          "('!' marks a row over it); worst: the slowest rank with pairs", flush=True)
    print(f"{'harness':8s} {'T':>5s} {'N':>2s} {'whole us/pair':>13s} {'ranks us/pair':>13s} {'ratio':>7s} "
          f"{'worst':>7s}", flush=True)
    for r in ep:
        mark = "!" if r["over_goal"] else " "
        print(f"{r['harness']:8s} {r['tokens']:5d} {r['ep']:2d} {r['whole_us_per_pair']:13.3f} "
              f"{r['ranks_us_per_pair']:13.3f} {r['ratio']:6.3f}{mark} {r['worst_rank_ratio']:7.3f}", flush=True)
    over = [f"{r['harness']} T={r['tokens']} N={r['ep']}" for r in ep if r["over_goal"]]
    print(f"over {GOAL_RATIO}x: {len(over)} of {len(ep)}" + (f": {', '.join(over)}" if over else ""), flush=True)
