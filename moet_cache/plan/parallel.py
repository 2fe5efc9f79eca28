"""What one GPU holds when vLLM 0.34 splits a model over N GPUs, and which N the planes allow.

`--tensor-parallel-size N` splits every routed expert (w13 on its output rows, w2 on its input columns,
the block-scale groups kept whole) and the linear layers vLLM builds as column- or row-parallel; it copies
the rest to every rank. `--enable-expert-parallel` instead gives rank r the experts r x E/N to
(r + 1) x E/N - 1 whole (vLLM's default linear placement), while attention stays split N ways. Each rank
keeps the whole KV cache: DeepSeek's latent attention caches one head (V4: `num_kv_heads=1, max_tp_shards=1`
in `vllm/models/deepseek_v4/attention.py` `get_kv_cache_spec`; V3: `num_kv_heads=1` in
`vllm/model_executor/layers/attention/mla_attention.py`), which every rank holds in full.

What vLLM 0.34 splits (docs/SERVING.md, "More than one GPU", cites the classes):
- DeepSeek-V4 (`vllm/models/deepseek_v4/attention.py`, `nvidia/model.py`): `attn.wq_b` (ColumnParallel),
  `attn.wo_a` (DeepseekV4GroupedWoA, ColumnParallel over the output groups), `attn.wo_b` (RowParallel),
  `attn.attn_sink` (per local head), `ffn.shared_experts` (MergedColumnParallel / RowParallel), `embed`
  (VocabParallelEmbedding) and `head` (ParallelLMHead); replicated: `wq_a` + `wkv` (fused, disable_tp),
  the compressors (disable_tp), the indexer (ReplicatedLinear), the router gate, hyper-connections, norms.
- DeepSeek-V3 (`vllm/model_executor/models/deepseek_v2.py`): `q_b_proj`/`q_proj`, `kv_b_proj`
  (ColumnParallel), `o_proj` (RowParallel), the dense layers' MLP and the shared experts, `embed_tokens`
  and `lm_head`; replicated: `q_a_proj` + `kv_a_proj_with_mqa` (fused, disable_tp), the V3.2 indexer,
  the router gate and its bias, norms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from ..errors import InputError

# The sizes vLLM's moet method takes: powers of two up to one 8-GPU host (docs/LOADER.md).
PARALLEL_SIZES = (1, 2, 4, 8)
# The most weights one block scale covers (MXFP4 and the compact e8m0 form: 32; NVFP4's e4m3: 16): a rank's
# share of an expert's width must hold whole blocks of this size.
SCALE_BLOCK = 32
# Under tensor parallelism on a GPU a rank's expert width must be a multiple of this: the plane kernels'
# decode steps take w2's K (the width) in chunks of 16 * CHUNK_WORDS = 256 codes, ks2 = 2 chunks a warp
# step (runtime/mma_moe.py `supported`, runtime/configs/NVIDIA_H200.json); a narrower width would send
# the layer to the Triton kernels with its planes put back into the natural layout on every call.
# V4-Flash (width 2048): TP 1, 2 and 4.
TP_KERNEL_WIDTH = 512

# Tensors vLLM 0.34 splits across tensor-parallel ranks, by checkpoint name (V4's and V3's namings).
_SPLIT = re.compile(
    r"^(embed\.weight|head\.weight|model\.embed_tokens\.weight|lm_head\.weight)$"
    r"|^(layers|mtp)\.\d+\.attn\.(wq_b|wo_a|wo_b)\.(weight|scale)$"
    r"|^(layers|mtp)\.\d+\.attn\.attn_sink$"
    r"|^(layers|mtp)\.\d+\.ffn\.shared_experts\.w[123]\.(weight|scale)$"
    r"|^model\.layers\.\d+\.self_attn\.(q_b_proj|q_proj|kv_b_proj|o_proj)\."
    r"|^model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj|shared_experts\.[a-z_]+)\."
)


@dataclass(frozen=True)
class Parallel:
    """How vLLM spreads the model: `size` GPUs (--tensor-parallel-size), experts whole per rank or split."""

    size: int = 1
    expert: bool = False          # --enable-expert-parallel

    @property
    def label(self) -> str:
        if self.size == 1:
            return "one GPU"
        return f"tensor parallel {self.size}" + (", expert parallel" if self.expert else "")

    def flags(self) -> list[str]:
        """The vLLM flags that ask for it."""
        return ["--tensor-parallel-size", str(self.size)] + (["--enable-expert-parallel"] if self.expert else [])


def is_split(name: str) -> bool:
    """Whether vLLM 0.34 splits this checkpoint tensor across tensor-parallel ranks (else every rank holds it)."""
    return _SPLIT.match(name) is not None


def share(nbytes: int, size: int) -> int:
    """One rank's part of a split tensor (rounded up: the last rank may be padded)."""
    return -(-nbytes // size)


def _dim(cfg: dict[str, Any], key: str) -> int:
    v = cfg.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def why_not(cfg: dict[str, Any], p: Parallel) -> str | None:
    """Why the planes or vLLM cannot be split this way (None: they can)."""
    if p.size not in PARALLEL_SIZES:
        return f"--tensor-parallel-size {p.size}: the moet method takes {', '.join(map(str, PARALLEL_SIZES))}"
    if p.size == 1:
        return None
    E, I = _dim(cfg, "n_routed_experts"), _dim(cfg, "moe_intermediate_size")
    heads = _dim(cfg, "num_attention_heads")
    if heads and heads % p.size:
        return f"--tensor-parallel-size {p.size} does not divide the model's {heads} attention heads"
    groups = _dim(cfg, "o_groups")
    if groups and groups % p.size:   # DeepSeek-V4's grouped output projection: whole groups a rank
        return f"--tensor-parallel-size {p.size} does not divide DeepSeek-V4's {groups} output groups (o_groups)"
    if p.expert:
        if E and E % p.size:
            return f"--enable-expert-parallel over {p.size} GPUs does not divide the model's {E} routed experts"
    elif I and (I % p.size or (I // p.size) % SCALE_BLOCK):
        return (f"--tensor-parallel-size {p.size} leaves each rank {I / p.size:g} of an expert's {I} columns, "
                f"not whole {SCALE_BLOCK}-weight scale blocks")
    elif I and (I // p.size) % TP_KERNEL_WIDTH:
        return (f"--tensor-parallel-size {p.size} leaves each rank {I // p.size} of an expert's {I} columns; "
                f"the plane kernels take multiples of {TP_KERNEL_WIDTH}")
    return None


def check(cfg: dict[str, Any], p: Parallel) -> None:
    """Refuse (one line, exit 2) a split the planes or vLLM do not allow."""
    reason = why_not(cfg, p)
    if reason is not None:
        sizes = [n for n in PARALLEL_SIZES if why_not(cfg, Parallel(n, p.expert)) is None]
        raise InputError(reason, f"use --tensor-parallel-size {' or '.join(map(str, sizes))}")


def allowed_sizes(cfg: dict[str, Any], expert: bool) -> tuple[int, ...]:
    return tuple(n for n in PARALLEL_SIZES if why_not(cfg, Parallel(n, expert)) is None)


def fullest_rank_experts(tier: Iterable[tuple[int, Iterable[int]]], n_experts: int, size: int) -> int:
    """Expert parallelism: the most tier experts any rank holds, rank r holding experts [r E/N, (r+1) E/N)
    of every layer (vLLM 0.34's default `--expert-placement-strategy linear`)."""
    per_rank = [0] * size
    local = n_experts // size
    for _, experts in tier:
        for e in experts:
            per_rank[min(e // local, size - 1)] += 1
    return max(per_rank)
