"""kernel_launch: the driver structs laid out as cuda.h has them (a wrong offset would hand
cuLaunchKernelEx a wrong stream or attribute, and no GPU is in CI to notice), the arguments passed as
torch's launcher passes them, and the plain launch where a dependent one cannot run."""

from __future__ import annotations

import ctypes

import pytest
import torch

from moet_cache.runtime import kernel_launch
from moet_cache.runtime.kernel_launch import _argument, _LaunchAttribute, _LaunchConfig, dependent_launch_runs, launch


def test_structs_match_cuda_h() -> None:
    # CUlaunchAttribute: CUlaunchAttributeID id; char pad[8 - sizeof(id)]; CUlaunchAttributeValue value
    # (a union padded to 64 bytes)
    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
    # CUlaunchConfig: six unsigned dims, sharedMemBytes, CUstream, CUlaunchAttribute*, numAttrs
    offsets = {name: getattr(_LaunchConfig, name).offset for name, _ in _LaunchConfig._fields_}
    assert offsets == {"grid": 0, "block": 12, "shared": 24, "stream": 32, "attrs": 40, "n_attrs": 48}
    assert ctypes.sizeof(_LaunchConfig) == 56
    assert kernel_launch._PROGRAMMATIC_SERIALIZATION == 6


def test_arguments_as_torch_passes_them() -> None:
    t = torch.zeros(4)
    assert _argument(t).value == t.data_ptr()
    assert isinstance(_argument(7), ctypes.c_int) and _argument(-1).value == -1
    assert isinstance(_argument(True), ctypes.c_int) and _argument(True).value == 1
    assert isinstance(_argument(0.5), ctypes.c_double) and _argument(0.5).value == 0.5
    with pytest.raises(TypeError):
        _argument("x")


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, **kw) -> None:
        self.calls.append(kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for devices without dependent launch")
def test_plain_launch_where_dependent_cannot_run() -> None:
    assert not dependent_launch_runs(torch.device("cpu"))
    k = _Recorder()
    for dependent in (False, True):
        launch(k, (2, 1, 1), (64, 1, 1), [1, 2.0], dependent=dependent)
    assert k.calls == [{"grid": (2, 1, 1), "block": (64, 1, 1), "args": [1, 2.0]}] * 2
