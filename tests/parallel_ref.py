"""The reference for a rank's share of a layer (tests/test_parallel_*.py): vLLM's placements written out
and a whole layer's tensors sliced the simple exact way."""

from __future__ import annotations

import torch

from moet_cache.load import Shard


def linear(ep: int, rank: int, n: int) -> tuple[int, ...]:
    """vLLM's linear placement (fused_moe/expert_map_manager.py determine_expert_map), written out here."""
    base, rem = divmod(n, ep)
    start = rank * base + min(rank, rem)
    return tuple(range(start, start + base + (rank < rem)))


def round_robin(ep: int, rank: int, n: int) -> tuple[int, ...]:
    return tuple(range(rank, n, ep))


def expert_map(experts: tuple[int, ...] | None, n: int, device: str = "cpu") -> torch.Tensor:
    """vLLM's expert_map for a rank holding `experts` of n (local id = position), -1 elsewhere."""
    m = torch.full((n,), -1, dtype=torch.int32, device=device)
    if experts is not None:
        m[list(experts)] = torch.arange(len(experts), dtype=torch.int32, device=device)
    return m


def reference_share(full: dict[str, torch.Tensor], shard: Shard, E: int, I: int) -> dict[str, torch.Tensor]:
    """The simple exact version: a rank's tensors sliced out of the whole layer's (E experts I wide)."""
    ids = list(shard.experts) if shard.experts is not None else list(range(E))
    part = I // shard.tp_size
    lo, hi = shard.tp_rank * part, (shard.tp_rank + 1) * part
    out: dict[str, torch.Tensor] = {}
    tier = full.get("delta_experts")
    rows: list[int] = []
    if tier is not None:
        where = {int(e): k for k, e in enumerate(tier.tolist())}
        rows = [where[e] for e in ids if e in where]
        out["delta_experts"] = torch.tensor([ids.index(int(tier[k])) for k in rows], dtype=torch.int64,
                                            device=tier.device)
    for name, t in full.items():
        if name == "delta_experts":
            continue
        t = t[rows] if name in ("w13_delta", "w2_delta") else t[ids]
        if name in ("w13_base", "w13_weight_scale", "w13_delta"):
            t = torch.cat([t[:, lo:hi], t[:, I + lo:I + hi]], dim=1)
        elif name in ("w2_base", "w2_weight_scale", "w2_delta"):
            cols = t.shape[2]
            t = t[:, :, lo * cols // I:hi * cols // I]
        out[name] = t
    return out
