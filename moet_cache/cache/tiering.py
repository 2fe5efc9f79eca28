"""Choosing the FP4 delta tier: which experts keep their low planes, under a byte budget.

Each expert's value is the squared error its delta removes (FP4 vs base-only, over w13 and w2),
times its routing weight when a profile is given (its share of the layer's tokens, times the
number of experts, so a uniform router weighs 1). Experts are taken greedily by value per byte.
All experts of a layer cost the same, so greedy is optimal within a layer and near-optimal across.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..fsutil import read_json_file
from ..hashing import xxh3_hex

DEFAULT_DELTA_BUDGET = "4.5GB"  # the tier planned for DeepSeek-V4-Flash on one 96 GB card (docs/SERVING.md)


@dataclass(frozen=True)
class Candidate:
    layer: int
    expert: int
    nbytes: int
    sq_error: float
    weight: float = 1.0

    @property
    def value(self) -> float:
        return self.sq_error * self.weight


@dataclass(frozen=True)
class RoutingProfile:
    """Per-layer per-expert token counts from a router trace (manifests/routing-profile.v1.schema.json)."""

    counts: dict[int, tuple[float, ...]]
    digest: str

    def weights(self, layer: int, n_experts: int) -> tuple[float, ...]:
        c = self.counts.get(layer)
        if c is None or sum(c) <= 0:
            return (1.0,) * n_experts
        total = sum(c)
        return tuple(n_experts * x / total for x in c)


def load_profile(path: str | Path) -> RoutingProfile:
    """Read and check a routing profile; every problem is an InputError naming the place."""
    p = Path(path)
    data = read_json_file(p)
    where = f"routing profile {p.name}"
    if not isinstance(data, dict) or data.get("format") != "moet-cache-routing-profile":
        raise InputError(f"{where}: format must be 'moet-cache-routing-profile'",
                         "see manifests/routing-profile.v1.schema.json")
    if data.get("format_version") != 1:
        raise InputError(f"{where}: format_version must be 1")
    layers = data.get("layers")
    if not isinstance(layers, list) or len(layers) > 1 << 16:
        raise InputError(f"{where}: layers must be a list of {{layer, counts}}")
    counts: dict[int, tuple[float, ...]] = {}
    for item in layers:
        if not isinstance(item, dict):
            raise InputError(f"{where}: each layer entry must be an object")
        layer, c = item.get("layer"), item.get("counts")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < 1 << 16:
            raise InputError(f"{where}: layer must be a layer number, found {layer!r}")
        if layer in counts:
            raise InputError(f"{where}: layer {layer} appears twice")
        if not isinstance(c, list) or not c or len(c) > 1 << 16 or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1e30 and math.isfinite(x)
                for x in c):
            raise InputError(f"{where}: layer {layer} counts must be a list of non-negative numbers")
        counts[layer] = tuple(float(x) for x in c)
    return RoutingProfile(counts, xxh3_hex(p.read_bytes()))


def check_profile(profile: RoutingProfile, experts_per_layer: dict[int, int]) -> None:
    """Every profiled layer must be served and have one count per expert."""
    for layer, c in profile.counts.items():
        if layer not in experts_per_layer:
            raise InputError(f"the routing profile has layer {layer}, which this cache does not serve",
                             f"served layers: {sorted(experts_per_layer)}")
        if len(c) != experts_per_layer[layer]:
            raise InputError(f"the routing profile has {len(c)} counts for layer {layer}, "
                             f"the model has {experts_per_layer[layer]} experts")


def choose_tier(candidates: list[Candidate], budget: int) -> dict[int, tuple[int, ...]]:
    """The experts to keep at FP4, per layer (every candidate layer gets an entry, maybe empty)."""
    chosen: dict[int, list[int]] = {c.layer: [] for c in candidates}
    order = sorted(candidates, key=lambda c: (-(c.value / c.nbytes) if c.nbytes else -math.inf,
                                              c.layer, c.expert))
    left = budget
    for c in order:
        if c.nbytes <= left and c.value > 0:
            chosen[c.layer].append(c.expert)
            left -= c.nbytes
    return {layer: tuple(sorted(ex)) for layer, ex in sorted(chosen.items())}
