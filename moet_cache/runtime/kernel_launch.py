"""Launching an NVRTC-compiled kernel (torch.cuda._compile_kernel), plainly or as a programmatic dependent
launch: the kernel may then start while the one ahead of it in the stream finishes, loading what does not
depend on it (its weights) and waiting for that kernel's output itself (mma_bits.cu wait_prior). torch's
launcher cannot set launch attributes, so this calls the driver's cuLaunchKernelEx (libcuda, loaded here
rather than through torch's private helpers); stream capture turns the attribute into a programmatic edge
of the CUDA graph. Where any piece is missing the kernel is launched plainly: slower, never wrong."""

from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Any

import torch

#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)
_PROGRAMMATIC_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_ubyte * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("n_attrs", ctypes.c_uint)]


def _argument(a: Any) -> ctypes._SimpleCData:
    """A kernel argument as torch's launcher passes it: a tensor's address, an int as int, a float as double."""
    if isinstance(a, torch.Tensor):
        return ctypes.c_void_p(a.data_ptr())
    if isinstance(a, int):
        return ctypes.c_int(a)
    if isinstance(a, float):
        return ctypes.c_double(a)
    raise TypeError(f"unsupported kernel argument type {type(a).__name__}")


@lru_cache(maxsize=None)
def _driver() -> Any:
    """The CUDA driver library if it has cuLaunchKernelEx (CUDA 12.0 and up), else None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return lib if hasattr(lib, "cuLaunchKernelEx") else None


def dependent_launch_runs(device: torch.device) -> bool:
    """Whether kernels on this device can start before the one ahead ends (compute capability 9.0 and up;
    griddepcontrol compiles to nothing below it)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def launch(kernel: Any, grid: tuple[int, int, int], block: tuple[int, int, int], args: list[Any],
           dependent: bool = False) -> None:
    """Launch `kernel` on the current stream; `dependent`: as a programmatic dependent launch, where the
    device takes it (dependent_launch_runs), else plainly."""
    func = getattr(kernel, "func", None)  # the CUfunction of torch's compiled kernel
    if not (dependent and func is not None and torch.cuda.is_available() and _driver() is not None
            and dependent_launch_runs(torch.device("cuda", torch.cuda.current_device()))):
        kernel(grid=grid, block=block, args=args)
        return
    values = [_argument(a) for a in args]  # kept alive until the launch has copied them
    params = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values))
    attr = _LaunchAttribute(id=_PROGRAMMATIC_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), 0,
                           ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), ctypes.pointer(attr), 1)
    result = _driver().cuLaunchKernelEx(ctypes.byref(config), func, params, None)
    if result:
        raise RuntimeError(f"cuLaunchKernelEx failed (CUresult {result})")
