"""The Triton kernels on the CPU through Triton's interpreter, tiny shapes, against the reference.

Skipped where Triton is not installed (CI's CPU torch has none); the GPU run of the same kernels at
V4 dims is tests/test_runtime_gpu.py. The interpreter runs in a child process: TRITON_INTERPRET
must be set before Triton is first imported.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from triton_interpreter import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")

CHILD = textwrap.dedent("""
    import torch
    from moet_cache.runtime.dequant import LayerPlanes
    from moet_cache.runtime.launch import Config, Grouped, Pairs, fused_moe_cuda
    from moet_cache.runtime.reference import fused_moe_reference
    from moet_cache.runtime.synthetic_layer import random_layer

    E, H, I = 8, 64, 32
    for e8m0 in (False, True):
        planes = LayerPlanes.from_tensors(random_layer(E, H, I, n_tier=3, e8m0=e8m0, device="cpu", seed=4))
        for i, (T, cfg) in enumerate(((3, Config.only(Pairs(16, 2, 4))),
                                      (9, Config.only(Grouped(16, 16, 2, 4, 2, False))),
                                      (9, Config.only(Grouped(16, 16, 2, 4, 2, True))))):
            g = torch.Generator().manual_seed(T)
            x = torch.randn((T, H), generator=g)
            ids = torch.randint(0, E, (T, 4), generator=g)
            ids[0, 1] = ids[0, 0]
            w = torch.rand((T, 4), generator=g)
            # each kernel with and without the clamp, over the two scale forms (the interpreter is slow)
            limit = 0.05 if (i + e8m0) % 2 else None
            got = fused_moe_cuda(x, planes, w, ids, limit, cfg)
            ref = fused_moe_reference(x, planes, w, ids, limit)
            rel = ((got - ref).norm() / ref.norm()).item()
            assert rel < 1e-5, (e8m0, T, limit, rel)
    print("ok")
""")


def test_kernels_in_interpreter() -> None:
    run_interpreted(CHILD)
