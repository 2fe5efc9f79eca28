"""Every plane kernel a layer can launch, compiled at load, in threads, so that none is compiled mid-serving.

Each kernel is compiled by NVRTC at its first use, once a process (mma_moe.compiled). Left to first use, a
V4-Flash x4 layer's 14 kernels cost 7.4 s of first calls, one after another, where the driver's JIT cache
is cold: a fresh container, and every start with torch 2.13 and up (2.14 is vLLM 0.34's pin), whose NVRTC
wrapper hands the driver a cubin, which that cache does not keep. A step that vLLM's profile run and graph
captures had not met stalled serving for its two kernels' compile (0.7-1.1 s; 2.9 s for the last prefill
step). NVRTC runs outside the GIL, so in threads they take about the longest kernel's own time: 3.0 s at
load on 16 cores, cold; 0.5 s where the JIT cache is warm (docs/RUNTIME.md). Each compiled image is
also kept on disk (kernel_cache.py), and a later start loads them all in 0.02 s."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from . import mma_moe, mma_prefill
from .dequant import LayerPlanes
from .launch import Config, config_for, layer_form


def kernel_names(planes: LayerPlanes, device: torch.device, config: Config | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, str]]:
    """(kernel file, instantiation) of every plane kernel `fused_moe` can launch for this layer on this device
    under `config` (the device's, launch.config_for, unless given), for activations of `dtype`: the layer form's decode steps that the kernels run here, the
    prefill steps as this device's shared memory lets them run (mma_prefill.within), and the kernels around
    them (pair_rows, moe_sum). None where the plane kernels do not run here."""
    if not mma_moe.runs_here(device):
        return []
    config = config_for(device) if config is None else config
    e8m0 = {2: planes.e8m0[0], 1: planes.e8m0[1]}  # by the kernels' tiles: w13 2, w2 1
    names = {("mma_moe.cu", "pair_rows")}
    if (moe_sum := mma_moe.sum_name(dtype)) is not None:
        names.add(("mma_moe.cu", moe_sum))
    for _, block in config.decode_steps(**layer_form(planes)):
        if mma_moe.supported(planes, device, block):
            names |= {("mma_moe.cu", mma_moe.kernel_name(block, tiles, e8m0[tiles], planes.layout))
                      for tiles in (2, 1)}
    limit = mma_prefill.smem_limit(device)
    for _, step in config.prefill:
        if (block := mma_prefill.within(step, limit)) is not None:
            names |= {("mma_prefill.cu", mma_prefill.kernel_name(block, tiles, e8m0[tiles], planes.layout))

                      for tiles in (2, 1)}
    return sorted(names)


def warm_up(planes: LayerPlanes, config: Config | None = None, dtype: torch.dtype = torch.bfloat16) -> int:
    """Compile (once a process: later calls find them compiled) every kernel of `kernel_names` for the layer's
    device, in threads; returns how many kernels that is. A kernel that does not compile fails here, at load."""
    device = planes.w13_base.device
    names = kernel_names(planes, device, config, dtype)
    if not names:
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()

    def compile_one(item: tuple[str, str]) -> None:
        torch.cuda.set_device(index)  # a new thread has no current context, which loading a module needs
        mma_moe.compiled(*item, index)

    with ThreadPoolExecutor(max_workers=min(len(names), os.cpu_count() or 1)) as pool:
        list(pool.map(compile_one, names))
    return len(names)
