"""moet-cache: an NVFP4 MoE checkpoint as a verified 2-bit base-plane + FP4 delta-tier cache.

The public API; the CLI (moet_cache.cli) is a thin layer over these functions.
"""

from typing import TYPE_CHECKING, Any

from .cancel import CancelToken
from .errors import (DiskFullError, EnvironmentProblem, InputError, LockHeldError, MoetError,
                     UnsupportedCheckpointError, VerificationError)
from .version import __version__

if TYPE_CHECKING:
    from .build import BuildOptions, BuildResult, BuildTuning, RetierResult, build_cache, retier_cache
    from .source.exporter import ExportResult, export_checkpoint
    from .cache.inspection import CacheInfo, inspect_cache
    from .load import Cache, LoadedLayer, open_cache
    from .source.synthetic import SyntheticSpec, V4Spec, make_checkpoint, make_v4_checkpoint, small_spec, small_v4_spec
    from .verify import VerifyReport, boot_check, full_verify, verify_against

# The API's modules load on first use (PEP 562): build, exporter and synthetic import torch, which
# costs seconds, and `moet-cache verify` (the boot check, run at every start) needs none of it.
_LAZY = {
    "build": ("BuildOptions", "BuildResult", "BuildTuning", "RetierResult", "build_cache", "retier_cache"),
    "source.exporter": ("ExportResult", "export_checkpoint"),
    "cache.inspection": ("CacheInfo", "inspect_cache"),
    "load": ("Cache", "LoadedLayer", "open_cache"),
    "source.synthetic": ("SyntheticSpec", "make_checkpoint", "small_spec", "V4Spec", "make_v4_checkpoint",
                         "small_v4_spec"),
    "verify": ("VerifyReport", "boot_check", "full_verify", "verify_against"),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'moet_cache' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f".{module}", __name__), name)

__all__ = [
    "BuildOptions", "BuildResult", "BuildTuning", "RetierResult", "build_cache", "retier_cache", "CancelToken",
    "MoetError", "InputError", "UnsupportedCheckpointError", "VerificationError", "EnvironmentProblem",
    "LockHeldError", "DiskFullError", "ExportResult", "export_checkpoint", "CacheInfo", "inspect_cache",
    "SyntheticSpec", "make_checkpoint", "small_spec", "V4Spec", "make_v4_checkpoint", "small_v4_spec", "VerifyReport", "boot_check", "full_verify",
    "verify_against", "__version__", "open_cache", "Cache", "LoadedLayer",
]
