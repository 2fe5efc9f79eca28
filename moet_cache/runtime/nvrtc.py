"""Compiling and loading the plane kernels (the .cu files here) by NVRTC, and whether they run on a device:
what the decode and prefill kernels and the x4 repack kernel share, below all of them."""

from __future__ import annotations

from functools import lru_cache
from importlib.resources import files
from typing import Any

import torch

from .kernel_cache import load_kernel

#: words (16 codes each) of a chunk, the unit of K a warp reads per row (mma_moe.cu) and of the layouts'
#: tiles (tiles.tile); K per warp must be a multiple of it. The kernels get it as a define (`compiled`).
CHUNK_WORDS = 16


def runs_here(device: torch.device) -> bool:
    """Whether the plane kernels (mma_moe.cu, mma_prefill.cu) can run on this device: CUDA sm_80+ (bf16
    mma.sync, cp.async, ldmatrix) and torch's NVRTC wrapper (torch 2.8+); else Triton runs."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
            and hasattr(torch.cuda, "_compile_kernel"))


@lru_cache(maxsize=None)
def kernel_source(name: str) -> str:
    """A kernel file with the shared device helpers (mma_bits.cu) in front: NVRTC compiles one string."""
    here = files(__package__)
    return here.joinpath("mma_bits.cu").read_text() + "\n" + here.joinpath(name).read_text()


@lru_cache(maxsize=None)
def compiled(file: str, name: str, device: int) -> Any:
    """A kernel of a kernel file by its instantiated name, for the device's compute capability, loaded once a
    process and device (a loaded module belongs to one device's context): from its image kept on disk, or
    compiled by NVRTC and kept (kernel_cache.py)."""
    capability = torch.cuda.get_device_capability(device)
    return load_kernel(kernel_source(file), name, f"{capability[0]}{capability[1]}",
                       ("-std=c++17", f"-DCHUNK_WORDS={CHUNK_WORDS}"))
