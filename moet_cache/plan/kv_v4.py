"""DeepSeek-V4's KV cache as vLLM 0.34 allocates it: the per-layer caches, their pages, the groups, the blocks.

V4 caches far less than V3's MLA, but not per token alone: every layer keeps a 128-token sliding
window, the compressed layers keep one 584-byte record per `ratio` tokens, the ratio-4 layers add the
indexer's 132-byte keys, and each compressor keeps a float32 state of its last few tokens. vLLM 0.34
pages all of these, packs the layers into KV-cache groups that draw equal-sized blocks from one pool,
and reserves each sliding window for the tokens a step may have in flight. This module redoes that
arithmetic (docs/SERVING.md "The KV term of DeepSeek-V4" states the formula and its sources):

- `vllm/models/deepseek_v4/attention.py`: `DeepseekV4Attention.get_kv_cache_spec` (584 B a record,
  `tokens_per_state = ratio`, pages aligned to 576 B), `DeepseekV4IndexerCache` (head 128 fp8 + one
  fp32 scale per 128 = 132 B), `DeepseekV4SWACache` (block 64, 584 B, window `sliding_window`);
- `vllm/models/deepseek_v4/compressor.py`: `CompressorStateCache` (float32, 2 x coff x dim a state,
  coff = 2 for ratio 4 else 1; block 4 for ratio 4, 8 for ratio 128; window coff x ratio);
- `vllm/v1/kv_cache_interface.py`: page = states x content, rounded up to the alignment; a full-attention
  cache needs cdiv(len, block) pages, a sliding window cdiv(min(window - 1 + in-flight, len), block) + 1;
- `vllm/v1/core/kv_cache_planning.py`: `_get_packed_kv_cache_groups` (buckets, the repeat pattern,
  `_approximate_gcd`), `_get_kv_cache_bytes_per_block` (the widest group's page sum),
  `_max_memory_usage_bytes_from_groups` (bytes a block x the blocks of every group), one null block;
- `vllm/config/vllm.py`: in-flight tokens = max_num_batched_tokens x (2 with async scheduling, the default).

tests/test_kv_v4.py pins the figures; tests/test_kv_v4_vllm.py (marker vllm) checks them against
vLLM 0.34's own planning functions when vLLM is installed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

RECORD_BYTES = 584          # 448 fp8 latent + 64 bf16 rope (128 B) + 8 e8m0 scale bytes (fp8_ds_mla layout)
PAGE_ALIGN = 576            # FlashMLA's packing: every page of the fp8_ds_mla layout is a multiple of 576 B
SWA_BLOCK = 64              # DeepseekV4SWACache's block size (tokens), whatever --block-size says
STATE_DTYPE_BYTES = 4       # compressor states are float32
KV_DTYPES_V4 = ("fp8", "fp8_ds_mla")   # FlashMLA (Hopper) and FlashInfer SM120 (RTX PRO 6000) run only these
BLOCK_SIZE_V4 = 256         # DeepseekV4SparseMLABackend.get_supported_kernel_block_sizes()
# The compute capabilities (major) V4's attention runs on in vLLM 0.34: FlashMLA sparse 9.x and 10.x
# (`models/deepseek_v4/sparse_mla.py` DeepseekV4SparseMLABackend.supports_compute_capability), FlashInfer
# sparse 10.x and 12.x (`models/deepseek_v4/nvidia/flashinfer_sparse.py`); none runs on 8.x (Ampere, Ada).
V4_ATTENTION_MAJORS = (9, 10, 12)
REASONING_MAX_CONTEXT = 393_216        # reasoning_effort "max" needs this --max-model-len (vLLM recipes)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(n: int, k: int) -> int:
    return _cdiv(n, k) * k


@dataclass(frozen=True)
class CacheSpec:
    """One layer's cache as vLLM sees it: full attention (a page per block of tokens) or a sliding window."""

    name: str
    window: int          # 0: full attention
    block: int           # tokens a block covers
    page: int            # bytes a page, after the alignment

    @property
    def bucket(self) -> tuple[int, int]:
        return (self.window, self.block)

    def pages(self, max_len: int, in_flight: int) -> int:
        """Pages one request at `max_len` tokens holds at most (FullAttentionSpec / SlidingWindowSpec)."""
        if not self.window:
            return _cdiv(max_len, self.block)
        return _cdiv(min(self.window - 1 + in_flight, max_len), self.block) + 1


@dataclass(frozen=True)
class V4Attention:
    """DeepSeek-V4's attention dims, from config.json."""

    compress_ratios: tuple[int, ...]   # one per main layer: 0 sliding window only, 4 CSA + indexer, 128 HCA
    head_dim: int = 512
    sliding_window: int = 128
    index_head_dim: int = 128
    mtp_layers: int = 0                # drafter blocks vLLM builds for speculative decoding (window only)


def compress_ratios_of(cfg: dict[str, Any]) -> list[int] | None:
    """Per-layer ratios as vLLM reads them: `compress_ratios`, or `compress_rates` over `layer_types`."""
    r = cfg.get("compress_ratios")
    if r is None and isinstance(cfg.get("compress_rates"), dict) and isinstance(cfg.get("layer_types"), list):
        r = [cfg["compress_rates"].get(t, 0) for t in cfg["layer_types"]]
    if not isinstance(r, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in r):
        return None
    return r


def layer_specs(att: V4Attention, with_mtp: bool = False) -> list[CacheSpec]:
    """Every cache vLLM 0.34 registers for V4 with fp8_ds_mla KV and --block-size 256."""
    D, h = att.head_dim, att.index_head_dim
    swa_page = _round_up(SWA_BLOCK * RECORD_BYTES, PAGE_ALIGN)
    out: list[CacheSpec] = []
    ratios = list(att.compress_ratios) + ([0] * att.mtp_layers if with_mtp else [])
    for i, r in enumerate(ratios):
        p = f"layer {i}"
        out.append(CacheSpec(f"{p} window", att.sliding_window, SWA_BLOCK, swa_page))
        if r <= 1:
            continue
        out.append(CacheSpec(f"{p} compressed", 0, BLOCK_SIZE_V4,
                             _round_up(BLOCK_SIZE_V4 // r * RECORD_BYTES, PAGE_ALIGN)))
        coff = 2 if r == 4 else 1
        sblock = 4 if r == 4 else 8
        out.append(CacheSpec(f"{p} compressor state", coff * r, sblock,
                             _round_up(sblock * 2 * coff * D * STATE_DTYPE_BYTES, PAGE_ALIGN)))
        if r == 4:
            out.append(CacheSpec(f"{p} indexer", 0, BLOCK_SIZE_V4,
                                 _round_up(BLOCK_SIZE_V4 // r * (h + h // 128 * 4), PAGE_ALIGN)))
            out.append(CacheSpec(f"{p} indexer compressor state", 2 * r, 4,
                                 _round_up(4 * 2 * 2 * h * STATE_DTYPE_BYTES, PAGE_ALIGN)))
    return out


def _approximate_gcd(values: list[int], lower_bound: int) -> int:
    """vLLM's chunk size with the least upward padding, ties to the larger (kv_cache_planning.py)."""
    lo, hi = max(1, lower_bound), max(values)
    if lo > hi:
        return lo
    best, best_pad = lo, None
    for d in range(lo, hi + 1):
        pad = sum((d - x % d) % d for x in values)
        if best_pad is None or pad < best_pad or (pad == best_pad and d > best):
            best, best_pad = d, pad
    return best


@dataclass(frozen=True)
class Group:
    """One KV-cache group: the layers that share a block table."""

    bucket: tuple[int, int]        # (window, block)
    page_sum: int                  # bytes of one block of this group (its layers' pages)
    spec: CacheSpec                # a representative layer spec (same pages per request for all)


def groups(specs: list[CacheSpec]) -> list[Group]:
    """vLLM's block-outermost packing of mixed page sizes (`_get_packed_kv_cache_groups`)."""
    buckets: dict[tuple[int, int], list[CacheSpec]] = {}
    for s in specs:
        buckets.setdefault(s.bucket, []).append(s)
    info = []
    for key, members in buckets.items():
        by_page = Counter(s.page for s in members)
        balanced = len(set(by_page.values())) == 1
        info.append((key, members, by_page, balanced))
    floor = max((max(c.values()) for _, _, c, b in info if b and len(c) > 1), default=0)
    repeats = _approximate_gcd([max(c.values()) for _, _, c, b in info if b], floor) if floor else None

    def n_groups(by_page: Counter[int], balanced: bool) -> int:
        return _cdiv(max(by_page.values()), repeats) if balanced and repeats is not None else 1

    def widest(by_page: Counter[int], n: int) -> int:
        return sum(_cdiv(count, n) * page for page, count in by_page.items())

    def is_state(members: list[CacheSpec]) -> bool:
        return repeats is None and members[0].window > 0

    anchor = max(widest(c, len(m) if is_state(m) else n_groups(c, b)) for _, m, c, b in info)
    out: list[Group] = []
    for key, members, by_page, balanced in info:
        n = n_groups(by_page, balanced)
        if is_state(members):
            n = max(n, _cdiv(len(members), max(anchor // members[0].page, 1)))
        if n == 1:
            out.append(Group(key, sum(s.page for s in members), members[0]))
            continue
        # Pattern repeats go round-robin to the n groups: group i takes repeats i, i + n, ...
        reps = max(by_page.values())
        per_repeat = sum(by_page)  # one layer of each page size a repeat
        for i in range(n):
            k = len(range(i, reps, n))
            out.append(Group(key, k * per_repeat, members[0]))
    return out


@dataclass(frozen=True)
class V4Kv:
    """The KV cache of `seqs` requests of `max_len` tokens, as vLLM 0.34 sizes it, and the raw records."""

    max_len: int
    seqs: int
    in_flight: int
    bytes_per_block: int           # the widest group's page sum: every block of the pool has this size
    blocks_per_seq: int            # the sum over groups of the pages one full-length request holds
    window_blocks_per_seq: int     # of which the sliding windows and compressor states (length-independent)
    groups: int
    allocated: int                 # (seqs x blocks_per_seq + 1 null block) x bytes_per_block
    raw: int                       # the records themselves: compressed + indexer + windows + states
    raw_per_token: float           # compressed + indexer records a token of context, all layers


def v4_kv(att: V4Attention, max_len: int, seqs: int = 1, max_num_batched_tokens: int = 8192,
          async_scheduling: bool = True, with_mtp: bool = False) -> V4Kv:
    specs = layer_specs(att, with_mtp)
    gs = groups(specs)
    in_flight = max_num_batched_tokens * (2 if async_scheduling else 1)
    bpb = max(g.page_sum for g in gs)
    per_group = [g.spec.pages(max_len, in_flight) for g in gs]
    blocks = sum(per_group)
    window_blocks = sum(n for g, n in zip(gs, per_group) if g.spec.window)
    D, h = att.head_dim, att.index_head_dim
    idx = h + h // 128 * 4
    raw = per_token = 0.0
    ratios = list(att.compress_ratios) + ([0] * att.mtp_layers if with_mtp else [])
    for r in ratios:
        raw += min(att.sliding_window, max_len) * RECORD_BYTES
        if r <= 1:
            continue
        coff = 2 if r == 4 else 1
        raw += _cdiv(max_len, r) * RECORD_BYTES + min(coff * r, max_len) * 2 * coff * D * STATE_DTYPE_BYTES
        per_token += RECORD_BYTES / r
        if r == 4:
            raw += _cdiv(max_len, r) * idx + min(2 * r, max_len) * 2 * 2 * h * STATE_DTYPE_BYTES
            per_token += idx / r
    return V4Kv(max_len, seqs, in_flight, bpb, blocks, window_blocks, len(gs), (seqs * blocks + 1) * bpb,
                int(raw) * seqs, per_token)


def longest_context(att: V4Attention, room: int, seqs: int, max_num_batched_tokens: int,
                    async_scheduling: bool, with_mtp: bool = False, upper: int = 1 << 24) -> int:
    """The longest max_len whose allocation for `seqs` requests fits in `room` bytes (0: none)."""
    def fits(n: int) -> bool:
        return v4_kv(att, n, seqs, max_num_batched_tokens, async_scheduling, with_mtp).allocated <= room
    if not fits(1):
        return 0
    lo, hi = 1, upper
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
