"""The GPUs a plan is made for: the preset cards (the memory the driver reports, the compute capability),
a size given on the command line, and the card nvidia-smi sees."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from ..errors import InputError
from ..units import GIB, MIB, parse_size


@dataclass(frozen=True)
class GpuPreset:
    name: str
    total_bytes: int   # the memory the driver reports (nvidia-smi "memory.total"), not the marketing GB
    note: str
    capability: tuple[int, int] | None = None   # CUDA compute capability (None: not known)


# nvidia-smi's memory.total (MiB) for each card, as the cards commonly report it (the 48 GB workstation cards
# with ECC off; with ECC on an A6000 or RTX 6000 Ada reports 46068 MiB, as the L40S does by default); vLLM's
# --gpu-memory-utilization is a fraction of it. The compute capability decides which attention backends run.
GPU_PRESETS: dict[str, GpuPreset] = {
    "rtx-pro-6000": GpuPreset("rtx-pro-6000", 97887 * MIB, "RTX PRO 6000 Blackwell, sold as 96 GB", (12, 0)),
    "h100-80g": GpuPreset("h100-80g", 81559 * MIB, "H100 SXM/PCIe, sold as 80 GB", (9, 0)),
    "h200": GpuPreset("h200", 143771 * MIB, "H200 SXM, sold as 141 GB", (9, 0)),
    "rtx-6000-ada": GpuPreset("rtx-6000-ada", 49140 * MIB, "RTX 6000 Ada, sold as 48 GB", (8, 9)),
    "l40s": GpuPreset("l40s", 46068 * MIB, "L40S, sold as 48 GB", (8, 9)),
    "a6000": GpuPreset("a6000", 49140 * MIB, "RTX A6000, sold as 48 GB", (8, 6)),
    "rtx-5090": GpuPreset("rtx-5090", 32607 * MIB, "GeForce RTX 5090, sold as 32 GB", (12, 0)),
    "rtx-4090": GpuPreset("rtx-4090", 24564 * MIB, "GeForce RTX 4090, sold as 24 GB", (8, 9)),
}
DEFAULT_GPU = "rtx-pro-6000"


def resolve_gpu(text: str) -> GpuPreset:
    """A preset name, or a size with a unit ("96GB", "95.6GiB", bytes)."""
    key = str(text).strip().lower()
    if key in GPU_PRESETS:
        return GPU_PRESETS[key]
    try:
        n = parse_size(key, what="GPU memory")
    except InputError:
        raise InputError(f"unknown GPU {text!r}",
                         f"use one of {', '.join(GPU_PRESETS)} or a size such as 96GB or 95.6GiB") from None
    if n < GIB:
        raise InputError(f"GPU memory {text!r} is under 1 GiB", "give the card's size with a unit, e.g. 96GB")
    return GpuPreset(f"custom ({n / GIB:.2f} GiB)", n, "given on the command line")


def detect_gpu(visible_devices: str) -> GpuPreset | None:
    """The memory of the first GPU of `visible_devices` (CUDA_VISIBLE_DEVICES as the process that will use it
    sees it; "" = the first GPU), from nvidia-smi (no CUDA context is created); None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    visible = visible_devices.split(",")[0].strip()
    args = [smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    if visible.isdigit():
        args += ["-i", visible]
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=20, check=True).stdout
        name, mib = out.strip().splitlines()[0].rsplit(",", 1)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    # The compute capability, where this nvidia-smi reports it (older drivers do not): which attention runs.
    capability = None
    try:
        cc = subprocess.run([*args[:1], "--query-gpu=compute_cap", *args[2:]], capture_output=True, text=True,
                            timeout=20, check=True).stdout.strip().splitlines()[0].split(".")
        capability = (int(cc[0]), int(cc[1])) if len(cc) == 2 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    return GpuPreset(name.strip(), int(mib.strip()) * MIB, "seen by nvidia-smi", capability)
