"""The quality curve plan and inspect read: its figures are the ladder's results, it interpolates between
them and nothing beyond, a malformed file is refused, and plan and inspect print and emit its figures for
real caches (a synthetic NVFP4 one, and the MXFP4 reference model itself built as the default build does,
without and with a mid tier: a cache with one is quoted from the mid curves, never the 4-bit one)."""

from __future__ import annotations

import copy
import itertools
import json
import re
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moet_cache import BuildOptions, build_cache, make_checkpoint, small_spec
from moet_cache.cli.app import app
from moet_cache.errors import InputError
from moet_cache.format.formats import FORMATS, LAYOUT_FORMAT, MXFP4
from moet_cache.cache.quality_curve import (CURVE_FILE, REFERENCE_MODELS, packaged_curve, read_curve, reference_for,
                                      tier_change, tier_kl)
from quality import MID_SERIES, MID_SHARES, curve_from_results  # benchmarks/quality.py (pytest's pythonpath)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "quality.json"
CURVE_JSON = REPO / "moet_cache" / "cache" / CURVE_FILE
MXFP4_CKPT = REPO / "benchmarks" / "data" / "quality_model" / "mxfp4"
EXPERT_DELTA, EXPERT_MID = 24576, 12384   # one reference-model expert's delta planes; its mid planes and tables
MIX_ROW = "tier 8/128 + mid 15/120: sq. weight error (--mid-budget)"   # the ladder's row of the mid_cache build


def _row(ref: str, name: str) -> dict:
    rows = json.loads(RESULTS.read_text())["result"]["models"][ref]["rows"]
    return next(r for r in rows if r["name"] == name)


def test_the_packaged_curve_is_the_ladders_results() -> None:
    """Every point is a row of results/quality.json with its KL as recorded and its fraction the row's N/M;
    the points are base only (fitted tables: the build's default form), every default-build tier and FP4 (KL 0,
    measured as float rounding of 0)."""
    results = json.loads(RESULTS.read_text())["result"]
    curve = packaged_curve()
    assert curve.results == "benchmarks/results/quality.json" and curve.table_form == "fitted"
    assert all(results["models"][ref]["default_table_form"] == "fitted" for ref in REFERENCE_MODELS)
    for ref in REFERENCE_MODELS:
        rows = {r["name"]: r for r in results["models"][ref]["rows"]}
        default_tiers = sorted(r["name"] for r in rows.values()
                               if r["series"] == "tier by sq. weight error (the default)")
        pts = curve.points(ref)
        assert sorted(p.row for p in pts[1:-1]) == default_tiers
        assert pts[0].row == "base only, fitted tables" and pts[-1].row == "FP4 (every delta plane)"
        assert len(pts) == 6   # 0, 5%, the preset's 8/128, 10%, 25%, 100%
        for p in pts[:-1]:
            assert p.kl == rows[p.row]["kl"]
        assert abs(rows[pts[-1].row]["kl"]) < 1e-6 and pts[-1].kl == 0.0
        for p in pts[1:-1]:
            n, m = p.row.split("tier ")[1].split(" ")[0].split("/")
            assert p.fraction == int(n) / int(m)


def test_the_packaged_mid_curves_are_the_ladders_mid_tier_rows() -> None:
    """At each 4-bit tier fraction but 1, a mid curve: that tier's own point at share 0, then every row of the
    mid series over that tier, its KL as recorded and its share the row's K/R, up to 1 (every other expert at
    3 bits)."""
    results = json.loads(RESULTS.read_text())["result"]
    curve = packaged_curve()
    for ref in REFERENCE_MODELS:
        rows = {r["name"]: r for r in results["models"][ref]["rows"] if r["series"] == MID_SERIES}
        assert all(r["path"] == "cache" for r in rows.values())
        cols = curve.mid(ref)
        assert [c.fraction for c in cols] == [p.fraction for p in curve.points(ref)[:-1]]
        assert sorted(p.row for c in cols for p in c.points[1:]) == sorted(rows)
        assert len(rows) == len(cols) * len(MID_SHARES)
        for col, at in zip(cols, curve.points(ref)):
            assert (col.points[0].share, col.points[0].kl, col.points[0].row) == (0.0, at.kl, at.row)
            assert col.points[-1].share == 1.0
            for p in col.points[1:]:
                n, m, k, r = (int(x) for x in re.match(r"tier (\d+)/(\d+) \+ mid (\d+)/(\d+):", p.row).groups())
                assert n / m == col.fraction and p.share == k / r and p.kl == rows[p.row]["kl"]


def test_the_curve_is_what_its_writer_makes_of_the_results_at_its_commit() -> None:
    """Writing the curve again from results/quality.json gives the packaged file; the commit it names holds
    that results file as it is now."""
    doc = json.loads(CURVE_JSON.read_text())
    results = json.loads(RESULTS.read_text())["result"]
    assert curve_from_results(results, doc["results"], doc["results_commit"], doc["command"]) == doc
    assert packaged_curve().to_dict() == doc   # the records hold every figure and name the file has
    at_commit = subprocess.run(["git", "show", f"{doc['results_commit']}:{doc['results']}"], cwd=REPO,
                               capture_output=True, check=True).stdout
    assert json.loads(at_commit)["result"] == results


def test_kl_at_is_exact_at_measured_points_and_linear_between() -> None:
    curve = packaged_curve()
    for ref in REFERENCE_MODELS:
        pts = curve.points(ref)
        for p in pts:
            assert curve.kl_at(p.fraction, ref) == p.kl
        for lo, hi in itertools.pairwise(pts):
            mid = (lo.fraction + hi.fraction) / 2
            assert curve.kl_at(mid, ref) == pytest.approx((lo.kl + hi.kl) / 2, rel=1e-12)
    with pytest.raises(InputError):
        curve.kl_at(1.01, "mxfp4")
    with pytest.raises(InputError):
        curve.kl_at(-0.01, "nvfp4")


def test_mix_kl_is_exact_at_measured_points_and_the_4_bit_curve_without_a_mid_tier() -> None:
    """At every measured (tier, share) point the mid curves' KL; at share 0 the 4-bit curve at any fraction;
    between two measured tiers, linear at a measured share; past the last one, towards 0 at FP4."""
    curve = packaged_curve()
    for ref in REFERENCE_MODELS:
        cols = curve.mid(ref)
        for col in cols:
            for p in col.points:
                assert curve.mix_kl_at(col.fraction, p.share, ref) == p.kl
        for f in (0.0, 0.03, 0.0625, 0.2, 0.6, 1.0):
            assert curve.mix_kl_at(f, 0.0, ref) == curve.kl_at(f, ref)
        for lo, hi in itertools.pairwise(cols):
            assert lo.points[-1].share == hi.points[-1].share == 1.0
            mid = (lo.fraction + hi.fraction) / 2
            assert curve.mix_kl_at(mid, 1.0, ref) == pytest.approx((lo.points[-1].kl + hi.points[-1].kl) / 2,
                                                                   rel=1e-12)
        last = cols[-1]
        assert curve.mix_kl_at((last.fraction + 1) / 2, 1.0, ref) == pytest.approx(last.points[-1].kl / 2, rel=1e-12)
        assert curve.mix_kl_at(1.0, 0.5, ref) == 0.0
    for f, share in ((1.01, 0.5), (0.5, 1.01), (0.5, -0.01)):
        with pytest.raises(InputError):
            curve.mix_kl_at(f, share, "mxfp4")


def test_tier_kl_reads_the_mid_curves_for_a_cache_with_a_mid_tier() -> None:
    """The ladder's tier 8/128 + mid 15/120 is that row's KL, not the 4-bit curve's at 8/128; no mid tier is
    the 4-bit curve."""
    curve = packaged_curve()
    mixed = tier_kl(curve, 8, 128, "mxfp4", mid_experts=15)
    assert mixed.kl == _row("mxfp4", MIX_ROW)["kl"] and mixed.mid_fraction == 15 / 128
    assert mixed.kl != curve.kl_at(8 / 128, "mxfp4")
    assert tier_kl(curve, 8, 128, "mxfp4").kl == curve.kl_at(8 / 128, "mxfp4") == 0.0667297


def test_kl_at_is_monotone_where_the_data_are() -> None:
    """Within each pair of neighbouring measured points the curve moves one way, the way the data do, and
    stays between them (the MXFP4 data rise from 5% to 10%: the curve rises there too)."""
    curve = packaged_curve()
    for ref in REFERENCE_MODELS:
        pts = curve.points(ref)
        for lo, hi in itertools.pairwise(pts):
            grid = [lo.fraction + (hi.fraction - lo.fraction) * k / 20 for k in range(21)]
            kls = [curve.kl_at(f, ref) for f in grid]
            steps = [b - a for a, b in itertools.pairwise(kls)]
            assert all(s <= 1e-15 for s in steps) if hi.kl <= lo.kl else all(s >= -1e-15 for s in steps)
            assert min(lo.kl, hi.kl) - 1e-15 <= min(kls) and max(kls) <= max(lo.kl, hi.kl) + 1e-15


def test_reference_model_by_expert_format() -> None:
    assert reference_for("mxfp4") == "mxfp4"
    assert reference_for("modelopt-nvfp4") == reference_for("ct-nvfp4") == "nvfp4"
    assert reference_for("modelopt") == reference_for("compressed-tensors") == "nvfp4"   # source layouts
    assert reference_for("fp8") is None and reference_for("") is None
    # every expert format and source layout the project reads has its curve, MXFP4's the MXFP4 model's
    for name, fmt in [*FORMATS.items(), *LAYOUT_FORMAT.items()]:
        assert reference_for(str(name)) == ("mxfp4" if fmt is MXFP4 else "nvfp4"), name


def _mutations() -> list[tuple[str, object]]:
    good = json.loads(CURVE_JSON.read_text())

    def changed(fn) -> dict:
        d = copy.deepcopy(good)
        fn(d)
        return d
    return [
        ("not an object", [1, 2]),
        ("other format", changed(lambda d: d.update(format="moet-cache"))),
        ("no commit", changed(lambda d: d.pop("results_commit"))),
        ("a model missing", changed(lambda d: d["curves"].pop("nvfp4"))),
        ("points out of order", changed(lambda d: d["curves"]["mxfp4"].reverse())),
        ("no point at 0", changed(lambda d: d["curves"]["mxfp4"].pop(0))),
        ("KL at 1 not 0", changed(lambda d: d["curves"]["nvfp4"][-1].update(kl=0.01))),
        ("negative KL", changed(lambda d: d["curves"]["mxfp4"][2].update(kl=-0.1))),
        ("KL not a number", changed(lambda d: d["curves"]["mxfp4"][2].update(kl="0.07"))),
        ("KL NaN", changed(lambda d: d["curves"]["mxfp4"][2].update(kl=float("nan")))),
        ("a point without its row", changed(lambda d: d["curves"]["mxfp4"][1].pop("row"))),
        ("no mid policy", changed(lambda d: d.pop("mid_policy"))),
        ("a model's mid curves missing", changed(lambda d: d["mid_curves"].pop("nvfp4"))),
        ("a mid curve missing", changed(lambda d: d["mid_curves"]["mxfp4"].pop(2))),
        ("a mid curve at FP4", changed(lambda d: d["mid_curves"]["mxfp4"].append(
            {"fraction": 1.0, "points": [{"share": 0.0, "kl": 0.0, "row": "FP4 (every delta plane)"},
                                         {"share": 1.0, "kl": 0.0, "row": "x"}]}))),
        ("a mid curve not from its tier's point", changed(
            lambda d: d["mid_curves"]["mxfp4"][1]["points"][0].update(kl=0.05))),
        ("mid shares out of order", changed(lambda d: d["mid_curves"]["nvfp4"][0]["points"].reverse())),
        ("a mid curve short of share 1", changed(lambda d: d["mid_curves"]["nvfp4"][3]["points"].pop())),
        ("a negative mid KL", changed(lambda d: d["mid_curves"]["mxfp4"][0]["points"][2].update(kl=-0.01))),
        ("a mid KL not a number", changed(lambda d: d["mid_curves"]["mxfp4"][0]["points"][2].update(kl=None))),
    ]


@pytest.mark.parametrize("what, doc", _mutations(), ids=[m[0] for m in _mutations()])
def test_a_malformed_curve_is_refused(tmp_path: Path, what: str, doc: object) -> None:
    path = tmp_path / CURVE_FILE
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="is not a quality curve"):
        read_curve(path)


def test_a_curve_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / CURVE_FILE
    path.write_bytes(CURVE_JSON.read_bytes()[:-40])
    with pytest.raises(InputError, match="is not a quality curve"):
        read_curve(path)
    assert read_curve(CURVE_JSON) == packaged_curve()


@pytest.fixture(scope="module")
def nvfp4_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("curve")
    src = make_checkpoint(d / "src", small_spec(seed=7, n_routed_experts=8, num_hidden_layers=3))
    build_cache(src, d / "cache", BuildOptions(delta_budget="25%"))
    return d / "cache"


@pytest.fixture(scope="module")
def reference_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MXFP4 reference model built as the ladder's default cache row was: fitted tables, 8 of its 128
    experts (24,576 bytes of delta planes each) by squared weight error."""
    out = tmp_path_factory.mktemp("curve-ref") / "cache"
    build_cache(MXFP4_CKPT, out, BuildOptions(delta_budget=str(8 * 24576)))
    return out


@pytest.fixture(scope="module")
def mid_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MXFP4 reference model built as the ladder's MIX_ROW was: fitted tables, 8 of its 128 experts in the
    tier, 15 of the other 120 in the mid tier, both by squared weight error."""
    out = tmp_path_factory.mktemp("curve-mid") / "cache"
    build_cache(MXFP4_CKPT, out, BuildOptions(delta_budget=str(8 * EXPERT_DELTA), mid_budget=str(15 * EXPERT_MID)))
    return out


@pytest.fixture(scope="module")
def nvfp4_mid_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("curve-nv-mid")
    src = make_checkpoint(d / "src", small_spec(seed=7, n_routed_experts=8, num_hidden_layers=3))
    build_cache(src, d / "cache", BuildOptions(delta_budget="25%", mid_budget="25%"))
    return d / "cache"


def test_plan_says_what_the_free_bytes_tier_does_to_the_reference_kl(nvfp4_cache: Path) -> None:
    args = ["plan", str(nvfp4_cache), "--gpu", "h100-80g", "--max-model-len", "4096"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    tier, total = doc["buys"]["delta_experts"]
    extra = doc["buys"]["extra_delta_experts"]
    assert (tier, total) == (4, 16) and extra == 12
    gain = doc["buys"]["delta_experts_reference_kl"]
    curve = packaged_curve()
    assert gain["reference_model"] == "nvfp4"   # a ModelOpt NVFP4 source
    assert gain["tier_fraction"] == 0.25 and gain["tier_fraction_after"] == 1.0
    assert gain["kl_to_fp4"] == curve.kl_at(0.25, "nvfp4") == 0.0742765   # the ladder's 32/128 row
    assert gain["kl_to_fp4_after"] == 0.0 and gain["kl_change_percent"] == -100.0
    assert gain["tier_bytes_added"] == 12 * (doc["terms_bytes"]["delta_tier"] // 4)
    assert gain["results_commit"] == curve.results_commit and gain["doc"] == "docs/QUALITY.md"
    text = CliRunner().invoke(app, args)
    assert text.exit_code == 0
    assert ("25.0% -> 100.0% of experts: KL to FP4 -100.0% on the NVFP4 reference model "
            "(0.0743 -> 0.0000 nats a byte; docs/QUALITY.md)") in " ".join(text.stdout.split())


def test_plan_of_a_retiered_budget_interpolates_between_measured_tiers(nvfp4_cache: Path) -> None:
    """--delta-budget 1 expert's bytes: 1 of 16 (6.25%) now, 16 of 16 after; both figures from the curve."""
    r = CliRunner().invoke(app, ["plan", str(nvfp4_cache), "--json", "--gpu", "h100-80g", "--max-model-len",
                                 "4096", "--delta-budget", "6.25%"])
    gain = json.loads(r.stdout)["buys"]["delta_experts_reference_kl"]
    want = tier_change(packaged_curve(), 1, 15, 16, "modelopt-nvfp4")
    assert gain["tier_fraction"] == 1 / 16 and gain["kl_to_fp4"] == want.kl == 0.0868162   # the preset row
    assert gain["kl_change_percent"] == want.change_percent == -100.0


def test_plan_of_the_mxfp4_reference_checkpoint_uses_the_mxfp4_curve() -> None:
    r = CliRunner().invoke(app, ["plan", str(MXFP4_CKPT), "--json", "--gpu", "1GiB", "--kv-bytes-per-token",
                                 "1024", "--max-model-len", "256", "--delta-budget", str(8 * 24576)])
    assert r.exit_code == 0, r.output
    buys = json.loads(r.stdout)["buys"]
    gain = buys["delta_experts_reference_kl"]
    assert buys["delta_experts"] == [8, 128] and gain["reference_model"] == "mxfp4"
    assert gain["kl_to_fp4"] == 0.0667297   # the ladder's default cache row: this very build
    n = 8 + buys["extra_delta_experts"]
    assert gain["kl_to_fp4_after"] == packaged_curve().kl_at(n / 128, "mxfp4")


def test_inspect_says_the_reference_kl_at_the_caches_tier(reference_cache: Path) -> None:
    r = CliRunner().invoke(app, ["inspect", str(reference_cache), "--json"])
    assert r.exit_code == 0, r.output
    ref = json.loads(r.stdout)["reference_kl"]
    assert ref == {"reference": "mxfp4", "fraction": 8 / 128, "kl": 0.0667297, "mid_fraction": 0.0}
    text = " ".join(CliRunner().invoke(app, ["inspect", str(reference_cache)]).stdout.split())
    assert ("tier 6.2% of the main layers' experts: on the MXFP4 reference model a default build's tier of "
            "that fraction gives KL to FP4 0.0667 nats a byte (docs/QUALITY.md)") in text


def test_inspect_of_an_nvfp4_cache_uses_the_nvfp4_curve(nvfp4_cache: Path) -> None:
    ref = json.loads(CliRunner().invoke(app, ["inspect", str(nvfp4_cache), "--json"]).stdout)["reference_kl"]
    assert ref == {"reference": "nvfp4", "fraction": 0.25, "kl": 0.0742765, "mid_fraction": 0.0}


def test_inspect_of_a_cache_with_a_mid_tier_quotes_the_mid_curve(mid_cache: Path) -> None:
    """The cache the ladder measured as MIX_ROW: inspect says that row's KL, never the 4-bit curve's 0.0667."""
    r = CliRunner().invoke(app, ["inspect", str(mid_cache), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert (doc["tier_experts"], doc["mid_experts"]) == (8, 15)
    kl = _row("mxfp4", MIX_ROW)["kl"]
    assert doc["reference_kl"] == {"reference": "mxfp4", "fraction": 8 / 128, "kl": kl, "mid_fraction": 15 / 128}
    text = " ".join(CliRunner().invoke(app, ["inspect", str(mid_cache)]).stdout.split())
    assert (f"tier 6.2% and mid tier 11.7% of the main layers' experts: on the MXFP4 reference model a default "
            f"build with a tier and mid tier of those fractions gives KL to FP4 {kl:.4f} nats a byte") in text
    assert "0.0667" not in text


def test_plan_of_a_cache_with_a_mid_tier_says_what_more_mid_tier_buys(mid_cache: Path) -> None:
    """The free bytes: more tier experts beside the mid tier, and more mid-tier experts, each from the mid
    curves (the cache's own figure is the ladder's MIX_ROW, not the 4-bit curve's)."""
    r = CliRunner().invoke(app, ["plan", str(mid_cache), "--json", "--gpu", "1GiB", "--kv-bytes-per-token",
                                 "1024", "--max-model-len", "256"])
    assert r.exit_code == 0, r.output
    buys = json.loads(r.stdout)["buys"]
    curve, kl = packaged_curve(), _row("mxfp4", MIX_ROW)["kl"]
    assert buys["mid_experts"] == [15, 128] and buys["delta_experts"] == [8, 128]
    extra_mid = buys["extra_mid_experts"]
    assert extra_mid == 128 - 8 - 15     # 1 GiB: room for every other expert's mid planes
    mid = buys["mid_experts_reference_kl"]
    assert mid["kl_to_fp4"] == kl and mid["mid_fraction"] == 15 / 128 and mid["mid_bytes_added"] == extra_mid * EXPERT_MID
    assert mid["kl_to_fp4_after"] == curve.mix_kl_at(8 / 128, 1.0, "mxfp4") == _row(
        "mxfp4", "tier 8/128 + mid 120/120: sq. weight error (--mid-budget)")["kl"]
    assert mid["mid_policy"] == curve.mid_policy and mid["tier_fraction_after"] == 8 / 128
    tier = buys["delta_experts_reference_kl"]
    assert tier["kl_to_fp4"] == kl and tier["mid_fraction"] == 15 / 128
    assert tier["kl_to_fp4_after"] == 0.0   # every expert at FP4
    text = " ".join(CliRunner().invoke(app, ["plan", str(mid_cache), "--gpu", "1GiB", "--kv-bytes-per-token",
                                             "1024", "--max-model-len", "256"]).stdout.split())
    pct = (mid["kl_to_fp4_after"] - kl) / kl * 100
    assert (f"105 more mid-tier experts (120 of 128): build again with --mid-budget {105 * EXPERT_MID:,} bytes "
            f"larger") in text
    assert (f"GiB of mid tier, mid tier 11.7% -> 93.8% of experts (beside a tier of 6.2%): KL to FP4 {pct:+.1f}% on "
            f"the MXFP4 reference model ({kl:.4f} -> {mid['kl_to_fp4_after']:.4f} nats a byte") in text
    assert ("120 more delta-tier experts (128 of 128): build again with a larger --delta-budget (retier drops the "
            "mid tier)") in text
    assert "6.2% -> 100.0% of experts (mid tier 11.7% -> 0.0%): KL to FP4 -100.0%" in text


def test_plan_of_a_mid_tier_cache_with_every_expert_in_the_tier_offers_no_more_mid_tier(mid_cache: Path) -> None:
    """--delta-budget 100% leaves no expert outside the tier: no mid tier to grow, and the tier's figure is FP4."""
    r = CliRunner().invoke(app, ["plan", str(mid_cache), "--json", "--gpu", "1GiB", "--kv-bytes-per-token", "1024",
                                 "--max-model-len", "256", "--delta-budget", "100%"])
    assert r.exit_code == 0, r.output
    buys = json.loads(r.stdout)["buys"]
    assert buys["delta_experts"] == [128, 128] and buys["extra_mid_experts"] == 0
    assert buys["mid_experts_reference_kl"] is None and buys["delta_experts_reference_kl"]["kl_to_fp4"] == 0.0


def test_plan_of_a_cache_without_a_mid_tier_offers_none(reference_cache: Path) -> None:
    r = CliRunner().invoke(app, ["plan", str(reference_cache), "--json", "--gpu", "1GiB", "--kv-bytes-per-token",
                                 "1024", "--max-model-len", "256"])
    buys = json.loads(r.stdout)["buys"]
    assert buys["mid_experts"] == [0, 128] and buys["extra_mid_experts"] == 0
    assert buys["mid_experts_reference_kl"] is None
    assert buys["delta_experts_reference_kl"]["mid_policy"] is None


def test_plan_says_what_a_smaller_tier_costs_when_it_does_not_fit(nvfp4_cache: Path) -> None:
    """A KV size per token that leaves the plan short by two to three experts' delta bytes: the tier and
    base-only suggestions say the reference model's KL at their tier sizes; the context one says none."""
    fixed = ["plan", str(nvfp4_cache), "--gpu", "1GiB", "--max-model-len", "4096", "--gpu-memory-utilization",
             "1.0", "--cudagraph-capture-sizes", "none", "--activation-reserve", "0", "--json"]
    first = json.loads(CliRunner().invoke(app, [*fixed, "--kv-bytes-per-token", "1"]).stdout)
    per_unit = 4096 * first["kv_layers"]          # KV bytes one more byte a token a layer costs
    expert = first["terms_bytes"]["delta_tier"] // 4
    args = [*fixed[:-1], "--kv-bytes-per-token", str(1 + (first["margin_bytes"] + 2 * expert) // per_unit + 1)]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    by_change = {s["change"]: s for s in doc["suggestions"]}
    assert by_change["context"]["reference_kl"] is None
    tier = by_change["tier"]
    keep = int(tier["setting"].split("(")[1].split(" experts")[0])
    assert keep == 1 and tier["reference_kl"]["tier_fraction_after"] == keep / 16
    curve = packaged_curve()
    assert tier["reference_kl"]["kl_to_fp4_after"] == curve.kl_at(1 / 16, "nvfp4") == 0.0868162
    assert tier["reference_kl"]["tier_bytes_added"] == -3 * expert
    base = by_change["base-only"]["reference_kl"]
    assert base["kl_to_fp4_after"] == 0.0889559 and base["tier_fraction_after"] == 0.0   # "base only, fitted tables"
    assert base["kl_change_percent"] == pytest.approx((0.0889559 - 0.0742765) / 0.0742765 * 100)
    text = " ".join(CliRunner().invoke(app, args).stdout.split())
    assert ("tier 25.0% -> 6.2% of experts: KL to FP4 +16.9% on the NVFP4 reference model (0.0743 -> 0.0868 "
            "nats a byte; docs/QUALITY.md)") in text
    assert "tier 25.0% -> 0.0% of experts: KL to FP4 +19.8% on the NVFP4 reference model" in text


def test_the_curve_writer_refuses_results_that_are_not_the_ladders() -> None:
    """An FP4 row whose KL is not 0 (not the FP4 model's figures) and a default-series row that does not say
    its tier are refused; nothing is written from them."""
    results = json.loads(RESULTS.read_text())["result"]
    fp4_off = copy.deepcopy(results)
    next(r for r in fp4_off["models"]["nvfp4"]["rows"] if r["name"] == "FP4 (every delta plane)")["kl"] = 0.01
    with pytest.raises(SystemExit, match="not 0"):
        curve_from_results(fp4_off, "r.json", "0" * 40, "python benchmarks/quality.py")
    unnamed = copy.deepcopy(results)
    next(r for r in unnamed["models"]["mxfp4"]["rows"] if r["name"].startswith("tier 6/128"))["name"] = "six"
    with pytest.raises(SystemExit, match="does not say its tier"):
        curve_from_results(unnamed, "r.json", "0" * 40, "python benchmarks/quality.py")
    # a mid-tier row must say its tier and mid tier, over a tier the 4-bit curve has a point at
    for old, new, why in ((MIX_ROW, "mid fifteen", "does not say its tier and mid tier"),
                          (MIX_ROW, "tier 9/128 + mid 15/119: sq. weight error (--mid-budget)", "no point at")):
        changed = copy.deepcopy(results)
        next(r for r in changed["models"]["mxfp4"]["rows"] if r["name"] == old)["name"] = new
        with pytest.raises(SystemExit, match=why):
            curve_from_results(changed, "r.json", "0" * 40, "python benchmarks/quality.py")
    # the default build's base-table form comes from the results, one for both models
    for form in (None, "x4"):
        mixed = copy.deepcopy(results)
        mixed["models"]["nvfp4"]["default_table_form"] = form
        with pytest.raises(SystemExit, match="one base-table form"):
            curve_from_results(mixed, "r.json", "0" * 40, "python benchmarks/quality.py")


def test_plan_suggestions_for_a_cache_with_a_mid_tier_keep_it(nvfp4_mid_cache: Path) -> None:
    """A plan short by two to three experts' delta bytes: the smaller tier and base-only suggestions are quoted
    with the cache's mid tier kept (the mid curves), which the 4-bit curve's figures are not."""
    fixed = ["plan", str(nvfp4_mid_cache), "--gpu", "1GiB", "--max-model-len", "4096", "--gpu-memory-utilization",
             "1.0", "--cudagraph-capture-sizes", "none", "--activation-reserve", "0", "--json"]
    first = json.loads(CliRunner().invoke(app, [*fixed, "--kv-bytes-per-token", "1"]).stdout)
    per_unit = 4096 * first["kv_layers"]
    expert = first["terms_bytes"]["delta_tier"] // 4
    doc = json.loads(CliRunner().invoke(app, [*fixed, "--kv-bytes-per-token",
                                              str(1 + (first["margin_bytes"] + 2 * expert) // per_unit + 1)]).stdout)
    assert doc["fits"] is False and doc["buys"]["mid_experts"] == [4, 16]
    by_change = {s["change"]: s["reference_kl"] for s in doc["suggestions"]}
    advice = {s["change"]: s["advice"] for s in doc["suggestions"]}
    assert advice["tier"].startswith("build again with --delta-budget ") and advice["base-only"] == (
        "build again with --delta-budget 0 and the same --mid-budget (retier drops the mid tier)")
    curve = packaged_curve()
    tier, base = by_change["tier"], by_change["base-only"]
    assert tier["mid_fraction"] == tier["mid_fraction_after"] == 4 / 16
    assert tier["kl_to_fp4"] == curve.mix_kl_at(0.25, 4 / 12, "nvfp4") != curve.kl_at(0.25, "nvfp4")
    assert tier["kl_to_fp4_after"] == curve.mix_kl_at(1 / 16, 4 / 15, "nvfp4")
    assert base["kl_to_fp4_after"] == curve.mix_kl_at(0.0, 4 / 16, "nvfp4") != curve.kl_at(0.0, "nvfp4")
