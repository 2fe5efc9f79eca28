"""The KV term of a plan: the bytes vLLM allocates for (sequences, length), the longest length and the most
sequences a room holds, for MLA (bytes a token a layer) and DeepSeek-V4 (kv_v4's allocator figures)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .kv_v4 import V4Attention, V4Kv, longest_context, v4_kv
from .footprint import Footprint
from .settings import PlanSettings


def round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def max_position_embeddings(cfg: dict[str, Any]) -> int | None:
    """The model's positions, from config.json (None when it gives no positive count)."""
    mpe = cfg.get("max_position_embeddings")
    return mpe if isinstance(mpe, int) and not isinstance(mpe, bool) and mpe > 0 else None


@dataclass(frozen=True)
class KvTerm:
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
        return seqs * round_up(max_len, self.s.block_size) * self.per_layer * self.kv_layers

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
