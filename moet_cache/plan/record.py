"""The plan's records: the terms and verdict of one plan, and a suggested change with the margin it leaves."""

from __future__ import annotations

from dataclasses import dataclass

from .drafter_vram import DrafterNeed
from ..enums import StrEnum
from .kv_v4 import V4Kv
from ..units import MIB
from .footprint import Footprint
from .settings import PlanSettings


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
    mid_tier: bool = False            # the cache has a mid tier, which retier does not keep (it needs the source)

    def thin(self, budget: int) -> bool:
        """The change fits by less than the estimates' error."""
        return self.where != CARD and self.margin < thin_margin(budget)

    def advice(self) -> str:
        """How to make the change, in words a user can act on."""
        if self.where == CACHE:
            serve = [w for w in self.setting.split("--") if w.strip() and not w.startswith("delta-budget")]
            tier = self.setting.split(" --max-model-len")[0]
            text = (f"build again with {tier} and the same --mid-budget (retier drops the mid tier)" if self.mid_tier
                    else f"moet-cache retier CACHE {tier} (a --lossless cache; else build again with it)")
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
    extra_mid_experts: int = 0     # a cache with a mid tier: the mid-tier experts the free bytes would add

    @property
    def warnings(self) -> tuple[str, ...]:
        """What serve must repeat: a thin margin, and the notes that make vLLM refuse or misbehave."""
        out = []
        if self.thin:
            out.append(f"fits by only {self.margin / MIB:.1f} MiB, less than the estimates' error "
                       f"({thin_margin(self.budget) / MIB:.0f} MiB): vLLM may still run out of memory")
        return tuple(out) + self.notes
