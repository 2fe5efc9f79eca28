"""What a plan is asked: the serve settings (card, utilization, context, sequences, KV dtype, CUDA-graph
sizes, speculative decoding, parallelism), their defaults, and the CUDA-graph, activation and communication
reserves estimated from them (docs/SERVING.md "reserves")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..enums import StrEnum
from ..errors import InputError
from .parallel import Parallel
from ..units import MIB
from .attention import KV_DTYPES
from .gpus import DEFAULT_GPU, GPU_PRESETS, GpuPreset

DEFAULT_UTILIZATION = 0.96
DEFAULT_MAX_MODEL_LEN = 260_000
DEFAULT_KV_DTYPE = "fp8_ds_mla"
DEFAULT_CUDAGRAPH_SIZES = (1, 2, 4, 8)
DEFAULT_BLOCK_SIZE = 256
DEFAULT_BATCHED_TOKENS = 8192
# Estimates (docs/SERVING.md "reserves"): a CUDA-graph pool of a base plus a share per captured size,
# and activations of one batched forward pass that scale with the tokens batched and the model's width.
CUDAGRAPH_BASE = 128 * MIB
CUDAGRAPH_PER_SIZE = 32 * MIB
# With more than one GPU, each rank also keeps NCCL's communicator buffers and vLLM's custom all-reduce
# buffers (vllm/distributed/device_communicators/: 8 MiB a buffer, up to 64 MiB of symmetric memory at TP 2):
# an estimate, not measured here.
COMM_RESERVE = 512 * MIB


def cudagraph_reserve(n_sizes: int) -> int:
    return 0 if n_sizes == 0 else CUDAGRAPH_BASE + CUDAGRAPH_PER_SIZE * n_sizes


def activation_reserve(model: dict[str, Any], batched_tokens: int) -> int:
    """A batched forward pass: ~24 bytes per hidden unit per token (residual, norms, attention in bf16)
    plus the fused MoE's gate/up/activation buffers (8 bytes per routed intermediate unit)."""
    H = model.get("hidden_size", 7168)
    k = model.get("num_experts_per_tok", 8)
    I = model.get("moe_intermediate_size", 2048)
    vals = [v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0 for v in (H, k, I)]
    H, k, I = vals
    return batched_tokens * (24 * H + 8 * k * I)


class Speculative(StrEnum):
    """Speculative decoding the plan counts (--speculative)."""

    NONE = "none"
    MTP = "mtp"                      # the MTP block(s): V4-Flash's mtp.0, V3's nextn layers
    DSPARK = "dspark"                # V4-Flash-0731's DSpark drafter: mtp.0-2 and its head stack (drafter_vram.py)


@dataclass(frozen=True)
class PlanSettings:
    gpu: GpuPreset = GPU_PRESETS[DEFAULT_GPU]
    utilization: float = DEFAULT_UTILIZATION
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    kv_cache_dtype: str = DEFAULT_KV_DTYPE
    max_num_seqs: int = 1                      # full-length sequences the KV cache must back at once
    cudagraph_sizes: tuple[int, ...] = DEFAULT_CUDAGRAPH_SIZES
    speculative: Speculative | str = Speculative.NONE
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_bytes_per_token: int | None = None      # per token per layer, for attention we do not know
    cudagraph_reserve: int | None = None       # override of the estimate
    activation_reserve: int | None = None      # override of the estimate
    batched_tokens: int = DEFAULT_BATCHED_TOKENS   # vLLM's --max-num-batched-tokens
    async_scheduling: bool = True              # vLLM's default: two batches in flight (V4's windows reserve both)
    parallel: Parallel = Parallel()            # --tensor-parallel-size, --enable-expert-parallel: plan one rank

    def check(self) -> None:
        if not 0.05 <= self.utilization <= 1.0:
            raise InputError(f"--gpu-memory-utilization {self.utilization} must be in [0.05, 1.0]")
        if self.max_model_len < 1:
            raise InputError("--max-model-len must be at least 1")
        if self.max_num_seqs < 1:
            raise InputError("--max-num-seqs must be at least 1")
        if self.block_size < 1:
            raise InputError("--block-size must be at least 1")
        if self.batched_tokens < 1:
            raise InputError("--max-num-batched-tokens must be at least 1")
        if self.speculative not in Speculative.names():
            raise InputError(f"--speculative {self.speculative!r}", "use dspark, mtp or none")
        if self.kv_cache_dtype not in KV_DTYPES and self.kv_bytes_per_token is None:
            raise InputError(f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}",
                             f"use one of {', '.join(KV_DTYPES)}, or give --kv-bytes-per-token")


def parse_sizes_list(text: str) -> tuple[int, ...]:
    """'1,2,4,8', vLLM's own '1 2 4 8' or '[1, 2, 4, 8]' -> (1, 2, 4, 8); 'none' or '' -> () (no CUDA graphs)."""
    t = str(text).strip().lower().strip("[]").strip()
    if t in ("", "none", "0"):
        return ()
    try:
        sizes = tuple(int(x) for x in t.replace(" ", ",").split(",") if x.strip())
    except ValueError:
        raise InputError(f"cannot read the capture sizes {text!r}", "write them as vLLM does, e.g. 1 2 4 8") from None
    if not sizes or any(x < 1 or x > 1 << 16 for x in sizes):
        raise InputError(f"capture sizes {text!r} must be positive batch sizes")
    return tuple(sorted(set(sizes)))
