"""What a load is asked to do, checked in one place: `Cache.load`, `Cache.load_dense` and the vLLM
plugin's extra config all go through these checks, so an argument means the same thing everywhere.

`LoadOptions.parse` turns the API's loose arguments ("cuda", "2GiB", workers=None) into a record of
resolved values; the record checks itself on construction, so an engine never sees a bad one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..enums import DeltaMode, VerifyMode
from ..errors import InputError
from ..machine import usable_cores
from ..units import parse_size
from .shard import Shard

DELTA_MODES = DeltaMode.names()
VERIFY_MODES = VerifyMode.names()
MIN_INFLIGHT = 64 << 10          # below this a GPU load's slots would be smaller than a page run


@dataclass(frozen=True)
class Tuning:
    """The engine's sizes. The defaults are the fastest measured on the H200 machine (docs/LOADER.md,
    "How the GPU figure moved"); a benchmark sweeps them by passing another Tuning, never by patching."""

    cpu_chunk: int = 8 << 20            # one read on the CPU path: big enough for disk speed, small for the cache
    gpu_slot: int = 32 << 20            # one pinned staging slot = one host-to-device copy
    gpu_slots_per_worker: int = 2       # slots a worker may hold at most (staging = workers x this x gpu_slot)
    gpu_jobs_in_flight: int = 3         # layers whose windows are queued at once (no hashing): enough to keep
                                        # every worker busy across a layer's end, few enough to finish in order
    dense_job: int = 64 << 20           # load_dense groups small tensors into jobs of about this many bytes

    def __post_init__(self) -> None:
        for name in ("cpu_chunk", "gpu_slot", "gpu_slots_per_worker", "gpu_jobs_in_flight", "dense_job"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InputError(f"tuning {name} must be a positive integer, got {value!r}")


def check_delta(delta: object) -> DeltaMode:
    return DeltaMode.of(delta, "delta")


def check_verify(verify: object) -> VerifyMode:
    return VerifyMode.of(verify, "verify")


def check_workers(workers: object) -> int:
    # bool is an int in Python: workers=True is a mistake, not one thread
    if type(workers) is not int or workers < 1:
        raise InputError(f"workers must be an integer of at least 1, got {workers!r}")
    return workers


def check_inflight(max_inflight: str | int) -> int:
    """A size ("2GiB", bytes) of at least MIN_INFLIGHT, in bytes."""
    budget = parse_size(max_inflight, what="max_inflight")
    if budget < MIN_INFLIGHT:
        raise InputError(f"max_inflight must be at least 64 KiB, got {budget} bytes")
    return budget


def resolve_device(device: str | torch.device) -> torch.device:
    """The device as torch names it, with the CUDA index filled in ("cuda" -> the current device)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"device must be 'cpu' or a CUDA device, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device must be 'cpu' or a CUDA device, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device {device!r} asked for, but this machine has no CUDA device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def default_workers(device: torch.device) -> int:
    """Reader threads when the caller names none: 4 into host memory; into a GPU, 12 (the fastest on
    the 16-core H200 machine, docs/LOADER.md), never more than the cores this process may use."""
    return 4 if device.type != "cuda" else min(12, usable_cores())


@dataclass(frozen=True)
class LoadOptions:
    """One load's resolved arguments (docs/LOADER.md, `Cache.load`). `load_dense` uses the same record:
    delta, expand and layers are the MoE layers' and it ignores them."""

    device: torch.device
    workers: int
    max_inflight: int                       # bytes
    delta: DeltaMode = DeltaMode.TIER
    verify: VerifyMode = VerifyMode.BOOT
    expand: bool = False
    layers: tuple[int, ...] | None = None   # None: every served layer
    tuning: Tuning = field(default_factory=Tuning)
    shard: Shard = field(default_factory=Shard)  # a rank's share of the experts (shard.py); default: all

    def __post_init__(self) -> None:
        if not isinstance(self.device, torch.device) or self.device.type not in ("cpu", "cuda") or \
                (self.device.type == "cuda" and self.device.index is None):
            raise InputError(f"device must be a resolved torch.device (cpu or cuda:N), got {self.device!r}")
        if not isinstance(self.delta, DeltaMode) or not isinstance(self.verify, VerifyMode):
            raise InputError(f"delta and verify must be DeltaMode and VerifyMode members (LoadOptions.parse "
                             f"takes their names), got {self.delta!r} and {self.verify!r}")
        check_workers(self.workers)
        if type(self.max_inflight) is not int or self.max_inflight < MIN_INFLIGHT:
            raise InputError(f"max_inflight must be at least 64 KiB, got {self.max_inflight!r} bytes")
        if not isinstance(self.expand, bool):
            raise InputError(f"expand must be true or false, got {self.expand!r}")
        if self.layers is not None and not all(type(x) is int for x in self.layers):
            raise InputError(f"layers must be layer numbers, got {list(self.layers)!r}")
        if not isinstance(self.shard, Shard):
            raise InputError(f"shard must be a moet_cache.load.Shard, got {self.shard!r}")
        if not self.shard.whole and self.verify == VerifyMode.HASH:
            # a digest covers a whole tensor, and a shard reads only its part of each
            raise InputError("verify='hash' checks whole tensors against their digests, and a shard reads "
                             "only its part of each", "use verify='boot' (after moet-cache verify --full), or "
                             "load every expert whole")
        if not self.shard.whole and self.expand:
            raise InputError("expand=True expands whole experts, not a shard's part of them",
                             "load the planes (expand=False)")

    @classmethod
    def parse(cls, device: str | torch.device = "cpu", delta: DeltaMode | str = DeltaMode.TIER,
              verify: VerifyMode | str = VerifyMode.BOOT,
              workers: int | None = None, max_inflight: str | int = "2GiB", expand: bool = False,
              layers: Sequence[int] | None = None, tuning: Tuning | None = None,
              shard: Shard | None = None) -> LoadOptions:
        """The API's arguments, checked (InputError names the first bad one) and resolved."""
        dev = resolve_device(device)
        mode = check_delta(delta)
        n = default_workers(dev) if workers is None else check_workers(workers)
        return cls(dev, n, check_inflight(max_inflight), mode, check_verify(verify), expand,
                   None if layers is None else tuple(layers), tuning or Tuning(), shard or Shard())

    @property
    def verify_hash(self) -> bool:
        return self.verify == VerifyMode.HASH


__all__ = ["DELTA_MODES", "VERIFY_MODES", "LoadOptions", "Tuning", "check_delta", "check_verify", "check_workers",
           "check_inflight", "default_workers", "resolve_device"]
