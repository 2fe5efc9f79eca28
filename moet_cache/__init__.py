"""moet-cache: an NVFP4 MoE checkpoint as a verified 2-bit base-plane + FP4 delta-tier cache.

The public API; the CLI (moet_cache.cli) is a thin layer over these functions.
"""

from .builder import BuildOptions, BuildResult, RetierResult, build_cache, retier_cache
from .errors import (DiskFullError, EnvironmentProblem, InputError, LockHeldError, MoetError,
                     UnsupportedCheckpointError, VerificationError)
from .exporter import ExportResult, export_checkpoint
from .inspection import CacheInfo, inspect_cache
from .synthetic import SyntheticSpec, make_checkpoint, small_spec
from .verifier import VerifyReport, boot_check, full_verify, verify_against
from .version import __version__

__all__ = [
    "BuildOptions", "BuildResult", "RetierResult", "build_cache", "retier_cache",
    "MoetError", "InputError", "UnsupportedCheckpointError", "VerificationError", "EnvironmentProblem",
    "LockHeldError", "DiskFullError", "ExportResult", "export_checkpoint", "CacheInfo", "inspect_cache",
    "SyntheticSpec", "make_checkpoint", "small_spec", "VerifyReport", "boot_check", "full_verify",
    "verify_against", "__version__",
]
