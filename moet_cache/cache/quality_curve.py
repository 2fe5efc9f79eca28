"""What the delta tier's and the mid tier's sizes do to a model's output, in the quality ladder's terms.

The ladder (benchmarks/quality.py, docs/QUALITY.md) measures the mean KL divergence of a small trained MoE
model's next-byte distributions to its FP4 model, for caches built the default way (fitted base tables,
the tier chosen by squared weight error) at several tier sizes, on two reference models: one MXFP4 (trained
quantization-aware, as DeepSeek-V4-Flash ships) and one NVFP4 (a post-training export, as the V3/R1 NVFP4
releases); and, over each of those tiers, with a 3-bit mid tier of several sizes (`build --mid-budget`, chosen
among the other experts by the squared error its mid plane removes). `quality_curve.json`, packaged beside
this module, holds those points: the 4-bit tier's curve, and the mid tier's curves, one per measured tier
size, by the share of the experts outside the tier that the mid tier holds. `benchmarks/quality.py
--write-curve` writes it from the ladder's results file. `plan` and `inspect` read it to say what a cache's
tier mix means on the reference model: the figures rank tier mixes, they are not the served model's own.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import InputError

CURVE_FILE = "quality_curve.json"
CURVE_FORMAT = "moet-cache-quality-curve"
CURVE_VERSION = 2
REFERENCE_MODELS = ("mxfp4", "nvfp4")
QUALITY_DOC = "docs/QUALITY.md"


@dataclass(frozen=True)
class CurvePoint:
    fraction: float     # tier experts / routed experts of the reference model's cache
    kl: float           # mean KL(FP4 || cache) in nats a byte on the held-out text
    row: str            # the ladder row it comes from (benchmarks/results/quality.json)


@dataclass(frozen=True)
class MidPoint:
    share: float        # mid-tier experts / the experts outside the 4-bit tier
    kl: float
    row: str


@dataclass(frozen=True)
class MidCurve:
    """KL to FP4 against the mid tier's share, over a 4-bit tier of one measured fraction; points sorted by
    share, the first at 0 (that tier alone: the 4-bit curve's point) and the last at 1 (every other expert at
    3 bits)."""

    fraction: float     # the 4-bit tier's fraction (a point of the 4-bit curve)
    points: tuple[MidPoint, ...]

    def kl_at(self, share: float) -> float:
        return _interpolate([(p.share, p.kl) for p in self.points], share)


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Linear interpolation between the two points (x, y) around x; x within the points' span; a measured x
    gives its own y exactly (y0 + (y1 - y0) need not round to y1)."""
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= x <= x1:
            if x == x0:
                return y0
            if x == x1:
                return y1
            t = (x - x0) / (x1 - x0)
            return y0 + t * (y1 - y0)
    raise AssertionError("a checked curve spans 0 to 1")


def _check_fraction(what: str, x: float) -> None:
    if not 0.0 <= x <= 1.0:
        raise InputError(f"a {what} must be within 0 and 1, got {x}")


@dataclass(frozen=True)
class QualityCurve:
    """KL to FP4 against the tier fraction, one curve per reference model, points sorted by fraction, the
    first at 0 (base only) and the last at 1 (every expert at FP4: KL exactly 0); and per reference model the
    mid tier's curves, one at each of those fractions but 1."""

    table_form: str                     # the base tables the caches were built with
    tier_policy: str                    # how their tiers were chosen
    measure: str
    model: str                          # what the reference model is
    results: str                        # the results file the points come from
    results_commit: str                 # the commit that recorded it
    command: str                        # the command that measured it
    curves: tuple[tuple[str, tuple[CurvePoint, ...]], ...]
    mid_policy: str                     # how the mid tiers were chosen
    mid_curves: tuple[tuple[str, tuple[MidCurve, ...]], ...]

    def points(self, reference: str) -> tuple[CurvePoint, ...]:
        return dict(self.curves)[reference]

    def mid(self, reference: str) -> tuple[MidCurve, ...]:
        return dict(self.mid_curves)[reference]

    def kl_at(self, fraction: float, reference: str) -> float:
        """The KL at a tier fraction by linear interpolation between the two measured points around it (the
        curve spans 0 to 1, so nothing is extrapolated)."""
        _check_fraction("tier fraction", fraction)
        return _interpolate([(p.fraction, p.kl) for p in self.points(reference)], fraction)

    def mix_kl_at(self, fraction: float, mid_share: float, reference: str) -> float:
        """The KL of a tier of `fraction` with a mid tier of `mid_share` of the other experts: on each of the two
        measured tier fractions around `fraction`, the mid curve at `mid_share` (at fraction 1, FP4: 0), and
        linear between the two. Exact at every measured point; at share 0 it is kl_at."""
        _check_fraction("tier fraction", fraction)
        _check_fraction("mid-tier share", mid_share)
        if mid_share == 0.0:
            return self.kl_at(fraction, reference)
        columns = [(c.fraction, c.kl_at(mid_share)) for c in self.mid(reference)] + [(1.0, 0.0)]
        return _interpolate(columns, fraction)

    def to_dict(self) -> dict[str, object]:
        return {"format": CURVE_FORMAT, "format_version": CURVE_VERSION, "table_form": self.table_form,
                "tier_policy": self.tier_policy, "measure": self.measure, "model": self.model,
                "results": self.results, "results_commit": self.results_commit, "command": self.command,
                "curves": {ref: [{"fraction": p.fraction, "kl": p.kl, "row": p.row} for p in pts]
                           for ref, pts in self.curves},
                "mid_policy": self.mid_policy,
                "mid_curves": {ref: [{"fraction": c.fraction,
                                      "points": [{"share": p.share, "kl": p.kl, "row": p.row} for p in c.points]}
                                     for c in cols] for ref, cols in self.mid_curves}}


@dataclass(frozen=True)
class TierKl:
    """The reference model's KL at one cache's tier mix."""

    reference: str      # the reference model whose curve applies (REFERENCE_MODELS)
    fraction: float     # 4-bit tier experts / routed experts
    kl: float
    mid_fraction: float = 0.0   # mid-tier experts / routed experts


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


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _mid_curves(d: dict, ref: str, pts: tuple[CurvePoint, ...], where: str) -> tuple[MidCurve, ...]:
    """One reference model's mid curves: one at each 4-bit point but FP4's, each rising strictly in share from 0
    (that very point: its KL and row) to 1, KLs >= 0."""
    cols = d["mid_curves"].get(ref) if isinstance(d.get("mid_curves"), dict) else None
    if not isinstance(cols, list) or [c.get("fraction") if isinstance(c, dict) else None for c in cols] != \
            [p.fraction for p in pts[:-1]]:
        raise _bad(where, f"the {ref} mid curves must be one at each {ref} tier fraction but 1, in order")
    out = []
    for c, at in zip(cols, pts):
        mids = []
        for m in c["points"] if isinstance(c.get("points"), list) and sorted(c) == ["fraction", "points"] else [None]:
            if not (isinstance(m, dict) and sorted(m) == ["kl", "row", "share"] and isinstance(m["row"], str)
                    and _is_number(m["share"]) and _is_number(m["kl"]) and m["kl"] >= 0):
                raise _bad(where, f"each {ref} mid point must be {{share, kl, row}} with finite numbers, KL >= 0")
            mids.append(MidPoint(float(m["share"]), float(m["kl"]), m["row"]))
        shares = [m.share for m in mids]
        if len(mids) < 2 or shares[0] != 0.0 or shares[-1] != 1.0 or shares != sorted(set(shares)):
            raise _bad(where, f"the {ref} mid points at tier {at.fraction} must rise strictly in share from 0 to 1")
        if (mids[0].kl, mids[0].row) != (at.kl, at.row):
            raise _bad(where, f"the {ref} mid curve at tier {at.fraction} must start at that tier's point")
        out.append(MidCurve(at.fraction, tuple(mids)))
    return tuple(out)


def curve_from_dict(d: object, where: str) -> QualityCurve:
    """A curve from its JSON form; InputError for anything malformed (a missing key or model, a point out of
    order, a KL that is negative or not a number, a curve that does not span 0 to 1 with 0 KL at 1, a mid curve
    missing or not starting at its tier's point)."""
    keys = ("table_form", "tier_policy", "measure", "model", "results", "results_commit", "command")
    if not isinstance(d, dict):
        raise _bad(where, "not a JSON object")
    if d.get("format") != CURVE_FORMAT or d.get("format_version") != CURVE_VERSION:
        raise _bad(where, f"format must be {CURVE_FORMAT} version {CURVE_VERSION}")
    for k in (*keys, "mid_policy"):
        if not isinstance(d.get(k), str) or not d[k]:
            raise _bad(where, f"{k} must be a non-empty string")
    for key in ("curves", "mid_curves"):
        if not isinstance(d.get(key), dict) or sorted(d[key]) != sorted(REFERENCE_MODELS):
            raise _bad(where, f"{key} must hold exactly {', '.join(REFERENCE_MODELS)}")
    curves = d["curves"]
    out, mid = [], []
    for ref in REFERENCE_MODELS:
        pts = []
        for p in curves[ref] if isinstance(curves[ref], list) else [None]:
            if not (isinstance(p, dict) and sorted(p) == ["fraction", "kl", "row"] and isinstance(p["row"], str)
                    and _is_number(p["fraction"]) and _is_number(p["kl"])):
                raise _bad(where, f"each {ref} point must be {{fraction, kl, row}} with finite numbers")
            pts.append(CurvePoint(float(p["fraction"]), float(p["kl"]), p["row"]))
        fracs = [p.fraction for p in pts]
        if len(pts) < 2 or fracs[0] != 0.0 or fracs[-1] != 1.0 or fracs != sorted(set(fracs)):
            raise _bad(where, f"the {ref} points must rise strictly in fraction from 0 to 1")
        if any(p.kl < 0 for p in pts) or pts[-1].kl != 0.0:
            raise _bad(where, f"the {ref} KLs must be >= 0, and 0 at fraction 1 (every expert at FP4)")
        out.append((ref, tuple(pts)))
        mid.append((ref, _mid_curves(d, ref, tuple(pts), where)))
    return QualityCurve(*(d[k] for k in keys), tuple(out), d["mid_policy"], tuple(mid))


def read_curve(path: str | Path) -> QualityCurve:
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _bad(str(path), str(e)) from e
    return curve_from_dict(d, str(path))


def packaged_curve() -> QualityCurve:
    """The curve shipped with moet-cache (moet_cache/cache/quality_curve.json)."""
    with resources.as_file(resources.files(__package__) / CURVE_FILE) as path:
        return read_curve(path)


def tier_kl(curve: QualityCurve, tier_experts: int, total_experts: int, source_format: str,
            mid_experts: int = 0) -> TierKl | None:
    """The reference model's KL at a tier of `tier_experts` of `total_experts` and a mid tier of `mid_experts`
    (the 4-bit curve without one, the mid curves with one); None when no reference model matches the source
    format or there are no experts."""
    ref = reference_for(source_format)
    if ref is None or total_experts <= 0:
        return None
    tier = min(tier_experts, total_experts)
    mid = min(mid_experts, total_experts - tier)
    share = mid / (total_experts - tier) if mid else 0.0
    return TierKl(ref, tier / total_experts, curve.mix_kl_at(tier / total_experts, share, ref), mid / total_experts)


@dataclass(frozen=True)
class TierChange:
    """The reference model's KL before and after a tier or a mid tier grows (or shrinks) by some experts."""

    reference: str
    fraction: float
    fraction_after: float
    kl: float
    kl_after: float
    mid_fraction: float = 0.0
    mid_fraction_after: float = 0.0

    @property
    def change_percent(self) -> float:
        """The KL's relative change in percent (negative: closer to FP4); 0 when the tier is already FP4."""
        return (self.kl_after - self.kl) / self.kl * 100 if self.kl else 0.0


def tier_change(curve: QualityCurve, tier_experts: int, added: int, total_experts: int,
                source_format: str, mid_experts: int = 0, mid_added: int = 0) -> TierChange | None:
    """What `added` more tier experts and `mid_added` more mid-tier experts do on the reference model for this
    source format (None: no model); a cache's mid tier, kept as it is, is `mid_experts` with `mid_added` 0."""
    now = tier_kl(curve, tier_experts, total_experts, source_format, mid_experts)
    after = tier_kl(curve, tier_experts + added, total_experts, source_format, mid_experts + mid_added)
    if now is None or after is None:
        return None
    return TierChange(now.reference, now.fraction, after.fraction, now.kl, after.kl, now.mid_fraction,
                      after.mid_fraction)
