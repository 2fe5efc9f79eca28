"""Closed sets of names as str-valued enums: the format's (scale forms, base tables, source layouts) and the choices a
caller names when loading a cache. layout.Role, manifest.LayerKind, verify.State and commit.Window are
the others, beside what they name.

A member IS its string (`Role.BASE == "base"`, same hash): the JSON we write, the CLI's text and every
comparison with a plain string stay as they were, while a wrong name is caught where it is read. This
module imports nothing heavy (the CLI loads without numpy or torch).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

from .errors import InputError

_E = TypeVar("_E", bound="StrEnum")


class StrEnum(str, Enum):
    """enum.StrEnum for Python 3.10 too: str() and f-strings give the value, not `Class.MEMBER`."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)

    @classmethod
    def of(cls: type[_E], value: Any, what: str) -> _E:
        """The member named `value`; anything else is an InputError naming `what` and the choices."""
        try:
            return cls(value)
        except ValueError:
            raise InputError(f"{what} must be one of {', '.join(cls.names())}, got {value!r}") from None


class DeltaMode(StrEnum):
    """Which delta planes a load applies: the tier's experts, none (base only) or all (--lossless caches)."""

    TIER = "tier"
    NONE = "none"
    ALL = "all"


class VerifyMode(StrEnum):
    """What a load checks first: the boot check, a re-hash of what it reads, or nothing."""

    BOOT = "boot"
    HASH = "hash"
    NONE = "none"


class ScaleForm(StrEnum):
    """How a base-plane file stores a block-scale tensor (formats.py; a layer manifest's scale_forms)."""

    E4M3_16 = "e4m3-16"
    E8M0_32 = "e8m0-32"


class BaseTable(StrEnum):
    """The form of every base table of a cache (the build's --base-table; the cache manifest's
    build.base_table, written for x4 only: absent means fitted). planes.fit_base_table fits each form."""

    FITTED = "fitted"   # the mean FP4 value each base code stands for: four free entries
    X4 = "x4"           # a * X4_PATTERN = (+a, +4a, -a, -4a): the GPU decodes it by bit arithmetic


class SourceLayout(StrEnum):
    """What a checkpoint's config.json declares (checkpoint.detect_layout; the cache manifest's source
    layout). Each projection's expert format is still read from its tensors (formats.format_of)."""

    MODELOPT = "modelopt"
    COMPRESSED_TENSORS = "compressed-tensors"
    MXFP4 = "mxfp4"                   # DeepSeek-V4's official release: FP8 dense, MXFP4 experts


class TensorKind(StrEnum):
    """The tensors of one quantized projection of an expert (formats.ExpertFormat names each one's suffix);
    a delta-all file keeps the scalars as `source.{proj}.{kind}` (layout.source_scalar)."""

    CODES = "codes"                   # the packed FP4 codes
    BLOCK_SCALE = "block_scale"       # one scale per block of 16 or 32
    GLOBAL_SCALE = "global_scale"     # the per-tensor scale (NVFP4)
    INPUT_SCALE = "input_scale"       # the activation scale (NVFP4, optional)
