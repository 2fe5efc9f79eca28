"""What a build is asked for (BuildOptions), how it uses the machine (BuildTuning), and what it reports."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.commit import KillHook
from ..enums import BaseTable, StrEnum
from ..errors import InputError
from ..machine import usable_cores
from ..codec.planes import KERNEL, HostKernel
from ..cache.tiering import DEFAULT_DELTA_BUDGET


class SplitDevice(StrEnum):
    """Where the split runs (BuildTuning.split_device); the CLI takes it from MOET_CACHE_SPLIT_DEVICE."""

    AUTO = "auto"
    CPU = "cpu"
    TORCH_CPU = "torch-cpu"
    CUDA = "cuda"


SPLIT_DEVICES = SplitDevice.names()


@dataclass(frozen=True)
class BuildTuning:
    """How a build uses the machine. Never what it writes: every setting builds the same bytes (tested).

    split_device: auto (the host's C kernels where they are built, else the GPU when one is present),
      cpu (the host kernels), torch-cpu (the torch kernels on the host: how the tests check the GPU
      path's maths without a GPU), cuda (the GPU). On the H200 machine (4 GiB, 16 cores) a build took
      5.4 s with the C kernels on 8 threads and 10.0 s with the GPU split, whose per-tensor copies and
      syncs cost more than the kernel saves (benchmarks/NOTES.md).
    host_kernel: the host kernels of a host split (planes.HostKernel): c where moet_cache.codec._kernels is
      built (the default there), numpy (the default without it; the CLI's MOET_CACHE_KERNELS=numpy asks for
      it on A/B runs). With numpy, `auto` splits on the GPU where there is one, as without the C kernels.
    plane_workers: threads for the split; None: the cores this process may use, at most 8.
    read_threads: source reads in flight beside the plane workers (the disk wants a queue).
    read_ahead_bytes: source bytes read ahead of the writer at most (bounded memory).
    dense_chunk_bytes: dense tensors are copied in chunks of this size (bounded memory, reused buffers).
    device_min_bytes: smaller tensors stay on the host on a GPU split (~20 launches and 3 syncs cost more).
    """

    split_device: SplitDevice | str = SplitDevice.AUTO
    host_kernel: HostKernel | str = KERNEL
    plane_workers: int | None = None
    read_threads: int = 2
    read_ahead_bytes: int = 256 << 20
    dense_chunk_bytes: int = 16 << 20
    device_min_bytes: int = 512 << 10

    def __post_init__(self) -> None:
        if self.split_device not in SPLIT_DEVICES:
            raise InputError(f"unknown split device {self.split_device!r}", f"use one of {', '.join(SPLIT_DEVICES)}")
        if self.host_kernel not in HostKernel.names():
            raise InputError(f"unknown host kernel {self.host_kernel!r}", f"use one of {', '.join(HostKernel.names())}")
        for name in ("read_threads", "read_ahead_bytes", "dense_chunk_bytes"):
            if getattr(self, name) < 1:
                raise InputError(f"build tuning: {name} must be at least 1")
        if self.plane_workers is not None and self.plane_workers < 1:
            raise InputError("build tuning: plane_workers must be at least 1")

    def workers(self) -> int:
        return self.plane_workers or plane_workers()

    def device(self) -> str | None:
        return plane_device(self.split_device, self.kernel())

    def kernel(self) -> HostKernel:
        """The host kernels a host split runs: the C ones only where asked for and built."""
        return HostKernel.C if self.host_kernel == HostKernel.C and KERNEL == HostKernel.C else HostKernel.NUMPY

    def read_window(self, workers: int, expert_bytes: int) -> int:
        return read_window(workers, expert_bytes, self.read_ahead_bytes)


def plane_workers() -> int:
    """Threads for the split by default: the cores this process may use, at most 8."""
    return min(8, usable_cores())


def plane_device(want: str = SplitDevice.AUTO, kernel: HostKernel = KERNEL) -> str | None:
    """Where the split runs: None for the host kernels (C, or numpy), else a torch device (BuildTuning)."""
    if want == SplitDevice.CPU:
        return None
    if want == SplitDevice.TORCH_CPU:
        return "cpu"
    if want == SplitDevice.CUDA or (kernel != HostKernel.C and torch.cuda.is_available()):
        return "cuda"
    return None


def read_window(workers: int, expert_bytes: int, ahead_bytes: int = BuildTuning.read_ahead_bytes) -> int:
    """Experts in flight (read, being split, or waiting to be written): enough to keep the reads going
    while the workers compute, never more than `ahead_bytes` of source."""
    return max(2, min(4 * workers, ahead_bytes // max(1, expert_bytes)))


@dataclass(frozen=True)
class BuildOptions:
    """What a build writes (BuildTuning: how it uses the machine).

    base_table: the form of every base table (enums.BaseTable): fitted, the default (the mean FP4 value of
      each base code: the smallest base error, and on the quality ladder's reference models the lower KL to
      the FP4 model: base only 0.0689 against x4's 0.0791 on MXFP4, 0.0890 against 0.0906 on NVFP4;
      docs/QUALITY.md), or x4 (a * X4_PATTERN, decoded by the GPU with bit arithmetic: 5-16% faster decode
      at up to 16 tokens on an H200, docs/RUNTIME.md). Recorded in the cache manifest; a rerun with the
      other form rebuilds every layer, as a changed --lossless does.
    """

    delta_budget: str = DEFAULT_DELTA_BUDGET
    profile: str | None = None
    lossless: bool = False
    layers: str | None = None
    include_mtp: bool = False
    wait: bool = False
    tuning: BuildTuning = field(default_factory=BuildTuning)
    kill_at: KillHook | None = None   # tests only: signal this process at a commit window (moet_cache.cache.commit)
    base_table: BaseTable | str = BaseTable.FITTED
    # The mid tier's budget (bytes or a percentage of every expert's mid tier); None: no mid tier. Its experts
    # (outside the 4-bit tier) keep base + the delta's high bit through a fitted 8-entry table: 3 bits a weight.
    mid_budget: str | None = None

    def __post_init__(self) -> None:
        BaseTable.of(self.base_table, "base table")  # an InputError naming the forms for any other value


@dataclass(frozen=True)
class BuildResult:
    cache: str
    already_complete: bool
    layers: tuple[int, ...]
    layers_built: tuple[int, ...]
    layers_reused: tuple[int, ...]
    source_bytes: int
    cache_bytes: int
    tier_experts: int
    tier_bytes: int         # the delta planes of the tier: what the budget counts (never above it)
    tier_file_bytes: int    # delta/tier.safetensors on disk: the planes plus the file's header
    budget_bytes: int
    seconds: float
    mid_experts: int = 0    # the mid tier's experts (3 bits a weight)
    mid_bytes: int = 0      # their mid planes and tables (what --mid-budget counts)


@dataclass(frozen=True)
class RetierResult:
    cache: str
    budget_bytes: int
    tier_experts: int
    tier_bytes: int         # the delta planes of the tier: what the budget counts (never above it)
    tier_file_bytes: int    # delta/tier.safetensors on disk: the planes plus the file's header
    weighted_by_profile: bool
