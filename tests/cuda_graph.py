"""One CUDA-graph check for the GPU tests: vLLM captures decode steps in CUDA graphs, so a step must
replay to exactly what it computes eagerly (no host sync, no allocation that moves between runs)."""

from __future__ import annotations

from typing import Callable

import torch


def replayed(step: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`step` run eagerly, warmed up on a side stream (compiled outside the capture), captured in a CUDA
    graph and replayed; asserts the replay equals the eager result and returns it."""
    eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    return out
