"""What the delta tier's size does to a model's output, in the quality ladder's terms.

The ladder (benchmarks/quality.py, docs/QUALITY.md) measures the mean KL divergence of a small trained MoE
model's next-byte distributions to its FP4 model, for caches built the default way (fitted base tables,
the tier chosen by squared weight error) at several tier sizes, on two reference models: one MXFP4 (trained
quantization-aware, as DeepSeek-V4-Flash ships) and one NVFP4 (a post-training export, as the V3/R1 NVFP4
releases). `quality_curve.json`, packaged beside this module, holds those points; `benchmarks/quality.py
--write-curve` writes it from the ladder's results file. `plan` and `inspect` read it to say what a tier
size means on the reference model: the figures rank tier sizes, they are not the served model's own.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .errors import InputError

CURVE_FILE = "quality_curve.json"
CURVE_FORMAT = "moet-cache-quality-curve"
CURVE_VERSION = 1
REFERENCE_MODELS = ("mxfp4", "nvfp4")
QUALITY_DOC = "docs/QUALITY.md"


@dataclass(frozen=True)
class CurvePoint:
    fraction: float     # tier experts / routed experts of the reference model's cache
    kl: float           # mean KL(FP4 || cache) in nats a byte on the held-out text
    row: str            # the ladder row it comes from (benchmarks/results/quality.json)


@dataclass(frozen=True)
class QualityCurve:
    """KL to FP4 against the tier fraction, one curve per reference model, points sorted by fraction, the
    first at 0 (base only) and the last at 1 (every expert at FP4: KL exactly 0)."""

    table_form: str                     # the base tables the caches were built with
    tier_policy: str                    # how their tiers were chosen
    measure: str
    model: str                          # what the reference model is
    results: str                        # the results file the points come from
    results_commit: str                 # the commit that recorded it
    command: str                        # the command that measured it
    curves: tuple[tuple[str, tuple[CurvePoint, ...]], ...]

    def points(self, reference: str) -> tuple[CurvePoint, ...]:
        return dict(self.curves)[reference]

    def kl_at(self, fraction: float, reference: str) -> float:
        """The KL at a tier fraction by linear interpolation between the two measured points around it (the
        curve spans 0 to 1, so nothing is extrapolated)."""
        if not 0.0 <= fraction <= 1.0:
            raise InputError(f"a tier fraction must be within 0 and 1, got {fraction}")
        pts = self.points(reference)
        for lo, hi in itertools.pairwise(pts):
            if lo.fraction <= fraction <= hi.fraction:
                if hi.fraction == lo.fraction:
                    return lo.kl
                t = (fraction - lo.fraction) / (hi.fraction - lo.fraction)
                return lo.kl + t * (hi.kl - lo.kl)
        raise AssertionError("a checked curve spans 0 to 1")

    def to_dict(self) -> dict[str, object]:
        return {"format": CURVE_FORMAT, "format_version": CURVE_VERSION, "table_form": self.table_form,
                "tier_policy": self.tier_policy, "measure": self.measure, "model": self.model,
                "results": self.results, "results_commit": self.results_commit, "command": self.command,
                "curves": {ref: [{"fraction": p.fraction, "kl": p.kl, "row": p.row} for p in pts]
                           for ref, pts in self.curves}}


@dataclass(frozen=True)
class TierKl:
    """The reference model's KL at one cache's tier fraction."""

    reference: str      # the reference model whose curve applies (REFERENCE_MODELS)
    fraction: float
    kl: float


#: expert formats (formats.FORMATS) and source layouts (enums.SourceLayout) by name -> the reference model; names,
#: not the records, so that the CLI's start does not import formats (numpy); tests/test_quality_curve.py checks
#: it against formats.FORMATS and LAYOUT_FORMAT
_REFERENCE_OF = {"mxfp4": "mxfp4", "modelopt-nvfp4": "nvfp4", "ct-nvfp4": "nvfp4", "modelopt": "nvfp4",
                 "compressed-tensors": "nvfp4"}


def reference_for(source_format: str) -> str | None:
    """The reference model for an expert format (formats.FORMATS) or a source layout (enums.SourceLayout):
    MXFP4 gets the MXFP4 model's curve, NVFP4 (ModelOpt or compressed-tensors) the NVFP4 one; None for
    anything else."""
    return _REFERENCE_OF.get(source_format)


def _bad(path: str, what: str) -> InputError:
    return InputError(f"{path} is not a quality curve: {what}",
                      "reinstall moet-cache, or write it again with `python benchmarks/quality.py --write-curve`")


def curve_from_dict(d: object, where: str) -> QualityCurve:
    """A curve from its JSON form; InputError for anything malformed (a missing key or model, a point out of
    order, a KL that is negative or not a number, a curve that does not span 0 to 1 with 0 KL at 1)."""
    keys = ("table_form", "tier_policy", "measure", "model", "results", "results_commit", "command")
    if not isinstance(d, dict):
        raise _bad(where, "not a JSON object")
    if d.get("format") != CURVE_FORMAT or d.get("format_version") != CURVE_VERSION:
        raise _bad(where, f"format must be {CURVE_FORMAT} version {CURVE_VERSION}")
    for k in keys:
        if not isinstance(d.get(k), str) or not d[k]:
            raise _bad(where, f"{k} must be a non-empty string")
    curves = d.get("curves")
    if not isinstance(curves, dict) or sorted(curves) != sorted(REFERENCE_MODELS):
        raise _bad(where, f"curves must hold exactly {', '.join(REFERENCE_MODELS)}")
    out = []
    for ref in REFERENCE_MODELS:
        pts = []
        for p in curves[ref] if isinstance(curves[ref], list) else [None]:
            if not (isinstance(p, dict) and sorted(p) == ["fraction", "kl", "row"] and isinstance(p["row"], str)
                    and all(isinstance(p[k], (int, float)) and not isinstance(p[k], bool) and math.isfinite(p[k])
                            for k in ("fraction", "kl"))):
                raise _bad(where, f"each {ref} point must be {{fraction, kl, row}} with finite numbers")
            pts.append(CurvePoint(float(p["fraction"]), float(p["kl"]), p["row"]))
        fracs = [p.fraction for p in pts]
        if len(pts) < 2 or fracs[0] != 0.0 or fracs[-1] != 1.0 or fracs != sorted(set(fracs)):
            raise _bad(where, f"the {ref} points must rise strictly in fraction from 0 to 1")
        if any(p.kl < 0 for p in pts) or pts[-1].kl != 0.0:
            raise _bad(where, f"the {ref} KLs must be >= 0, and 0 at fraction 1 (every expert at FP4)")
        out.append((ref, tuple(pts)))
    return QualityCurve(*(d[k] for k in keys), tuple(out))


def read_curve(path: str | Path) -> QualityCurve:
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _bad(str(path), str(e)) from e
    return curve_from_dict(d, str(path))


def packaged_curve() -> QualityCurve:
    """The curve shipped with moet-cache (moet_cache/quality_curve.json)."""
    with resources.as_file(resources.files(__package__) / CURVE_FILE) as path:
        return read_curve(path)


def tier_kl(curve: QualityCurve, tier_experts: int, total_experts: int, source_format: str) -> TierKl | None:
    """The reference model's KL at a tier of `tier_experts` of `total_experts`; None when no reference model
    matches the source format or there are no experts."""
    ref = reference_for(source_format)
    if ref is None or total_experts <= 0:
        return None
    fraction = min(tier_experts, total_experts) / total_experts
    return TierKl(ref, fraction, curve.kl_at(fraction, ref))


@dataclass(frozen=True)
class TierChange:
    """The reference model's KL before and after a tier grows (or shrinks) by some experts."""

    reference: str
    fraction: float
    fraction_after: float
    kl: float
    kl_after: float

    @property
    def change_percent(self) -> float:
        """The KL's relative change in percent (negative: closer to FP4); 0 when the tier is already FP4."""
        return (self.kl_after - self.kl) / self.kl * 100 if self.kl else 0.0


def tier_change(curve: QualityCurve, tier_experts: int, added: int, total_experts: int,
                source_format: str) -> TierChange | None:
    """What `added` more tier experts do on the reference model for this source format (None: no model)."""
    now = tier_kl(curve, tier_experts, total_experts, source_format)
    after = tier_kl(curve, tier_experts + added, total_experts, source_format)
    if now is None or after is None:
        return None
    return TierChange(now.reference, now.fraction, after.fraction, now.kl, after.kl)
