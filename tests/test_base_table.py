"""The base tables' two forms (--base-table fitted|x4): real builds on the small synthetic checkpoints, the
cache manifest's build.base_table (absent in older caches: fitted), verify, retier, a rerun with the other form."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from moet_cache import BuildOptions, build_cache, full_verify, inspect_cache, open_cache, retier_cache, verify_against
from moet_cache.build.tier import tier_candidates
from moet_cache.source.checkpoint import PROJECTIONS, open_checkpoint
from moet_cache.cli.app import app
from moet_cache.enums import BaseTable
from moet_cache.errors import InputError
from moet_cache.cache.manifest import CacheManifest
from moet_cache.codec.planes import (E4M3_VALUES, X4_PATTERN, code_histogram, error_and_energy, fit_base_table,
                               has_x4_form)
from moet_cache.verify import boot_check, load_cache_files

from faults.campaign import recommit, rewrite_json, run_main


def _tables(cache: Path) -> dict[int, list[np.ndarray]]:
    """Each layer's w13 and w2 tables, from its base file."""
    out = {}
    for p in sorted((cache / "layers").glob("layer-*.base.safetensors")):
        with safe_open(str(p), "np") as f:
            out[int(p.name[6:9])] = [f.get_tensor("w13_table"), f.get_tensor("w2_table")]
    return out


def _form(cache: Path) -> str:
    """build.base_table, written for x4 caches only (a fitted cache's manifest is what older versions read)."""
    return json.loads((cache / "cache.json").read_text())["build"].get("base_table", "fitted")


def _assert_x4(cache: Path) -> None:
    tables = _tables(cache)
    assert sorted(tables) == [1, 2, 3]
    for t in (t for ts in tables.values() for t in ts):
        flat = t.reshape(-1, 4)
        assert t.dtype == np.float32 and (flat[:, 0] > 0).all() and has_x4_form(t)
        assert np.array_equal(flat, flat[:, :1] * X4_PATTERN)  # bit for bit, as the runtime tests it


@pytest.fixture(scope="module")
def x4_lossless(tmp_path_factory: pytest.TempPathFactory, ckpt_modelopt: Path) -> Path:
    """A --lossless cache with x4 tables (30% tier), built once: read it, never change it."""
    out = tmp_path_factory.mktemp("x4") / "cache"
    build_cache(ckpt_modelopt, out, BuildOptions(lossless=True, delta_budget="30%", base_table="x4"))
    return out


def test_an_x4_build_has_the_form_everywhere_and_verifies(x4_lossless: Path, ckpt_modelopt: Path) -> None:
    _assert_x4(x4_lossless)
    assert _form(x4_lossless) == "x4" and load_cache_files(x4_lossless).manifest.build.base_table == BaseTable.X4
    assert boot_check(x4_lossless).ok and full_verify(x4_lossless).ok
    rep = verify_against(x4_lossless, ckpt_modelopt)
    assert rep.ok and rep.details["tables"] == 3 * 3 * 16
    assert inspect_cache(x4_lossless).build.base_table == "x4"
    assert open_cache(x4_lossless).base_table == BaseTable.X4


def test_the_errors_and_the_tier_are_the_x4_tables(x4_lossless: Path, ckpt_modelopt: Path) -> None:
    cf = load_cache_files(x4_lossless)
    ck = open_checkpoint(ckpt_modelopt)
    for layer, e in ((1, 0), (3, 11)):
        want = 0.0
        for proj in PROJECTIONS:
            x = ck.read_raw_expert(layer, e, proj)
            err, _ = error_and_energy(x.codes, E4M3_VALUES[x.scale_bytes], fit_base_table(code_histogram(x.codes), "x4"))
            want += err * x.scale_2 ** 2
        assert cf.layers[layer].sq_error[e] == pytest.approx(want, rel=1e-5)
    index = json.loads((x4_lossless / "delta/tier.json").read_text())
    chosen = {(x["layer"], e) for x in index["layers"] for e in x["experts"]}
    cands = tier_candidates(cf.layers, None)
    assert min(c.sq_error for c in cands if (c.layer, c.expert) in chosen) >= \
        max(c.sq_error for c in cands if (c.layer, c.expert) not in chosen)


def test_a_default_build_is_fitted(built_cache: Path) -> None:
    """fitted is the default: the lower KL to FP4 on the quality ladder's reference models (docs/QUALITY.md)."""
    assert BuildOptions().base_table == BaseTable.FITTED
    assert _form(built_cache) == "fitted" and open_cache(built_cache).base_table == BaseTable.FITTED
    assert not any(has_x4_form(t) for ts in _tables(built_cache).values() for t in ts)


def test_retier_keeps_the_caches_form(x4_lossless: Path, tmp_path: Path, ckpt_modelopt: Path) -> None:
    cache = Path(shutil.copytree(x4_lossless, tmp_path / "cache"))
    before = [lm.sq_error for _, lm in sorted(load_cache_files(cache).layers.items())]
    r = retier_cache(cache, "60%")
    assert r.tier_experts > 0 and _form(cache) == "x4" and full_verify(cache).ok
    assert [lm.sq_error for _, lm in sorted(load_cache_files(cache).layers.items())] == before
    _assert_x4(cache)
    assert verify_against(cache, ckpt_modelopt).ok


def test_a_rerun_with_the_other_form_rebuilds_every_layer(ckpt_modelopt: Path, cache: Path) -> None:
    """As a changed --lossless: the form is in each layer's key and in the build parameters, so no layer
    of the other form is reused and the cache never mixes forms."""
    assert _form(cache) == "fitted"  # the default
    r = build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="25%", base_table="x4"))
    assert not r.already_complete and r.layers_built == (1, 2, 3) and r.layers_reused == ()
    _assert_x4(cache)
    assert _form(cache) == "x4" and verify_against(cache, ckpt_modelopt).ok
    assert build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="25%", base_table="x4")).already_complete
    # a killed x4 rerun (no commit record) finished with the default: again every layer
    (cache / "COMMIT.json").unlink()
    r = build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="25%"))
    assert r.layers_built == (1, 2, 3) and r.layers_reused == ()
    assert _form(cache) == "fitted" and not any(has_x4_form(t) for ts in _tables(cache).values() for t in ts)
    assert verify_against(cache, ckpt_modelopt).ok


def test_an_older_cache_without_the_field_reads_as_fitted(ckpt_modelopt: Path, tmp_path: Path) -> None:
    cache = tmp_path / "fitted"
    build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="25%", base_table="fitted"))
    doc = json.loads((cache / "cache.json").read_text())
    assert "base_table" not in doc["build"]  # a fitted cache is written as every older cache was
    assert CacheManifest.parse(doc).build.base_table == BaseTable.FITTED
    doc["build"]["base_table"] = "fitted"  # and a manifest that names it reads the same
    assert CacheManifest.parse(doc).build.base_table == BaseTable.FITTED
    del doc["build"]["base_table"]
    rewrite_json(cache / "cache.json", doc)
    recommit(cache)
    assert load_cache_files(cache).manifest.build.base_table == "fitted" and full_verify(cache).ok
    assert verify_against(cache, ckpt_modelopt).ok
    # the same build confirms it (same parameters), and writes nothing; so does a default build
    fitted = BuildOptions(delta_budget="25%", base_table="fitted")
    assert build_cache(ckpt_modelopt, cache, fitted).already_complete
    assert build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="25%")).already_complete
    assert "base_table" not in json.loads((cache / "cache.json").read_text())["build"]


def test_other_forms_are_refused() -> None:
    with pytest.raises(InputError, match="base table must be one of fitted, x4, got 'x8'"):
        BuildOptions(base_table="x8")  # the manifest's refusal: tests/test_manifest.py


def test_the_cli_builds_x4_and_inspect_shows_the_form(ckpt_ct: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    cache = tmp_path / "cache"
    r = runner.invoke(app, ["build", str(ckpt_ct), str(cache), "--base-table", "x4", "--delta-budget", "20%", "-q"])
    assert r.exit_code == 0, r.output
    _assert_x4(cache)
    assert _form(cache) == "x4"
    r = runner.invoke(app, ["verify", str(cache), "--full", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["state"] == "verified"
    r = runner.invoke(app, ["verify", str(cache), "--against", str(ckpt_ct), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["state"] == "verified"
    r = runner.invoke(app, ["inspect", str(cache), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["build"]["base_table"] == "x4"
    r = runner.invoke(app, ["inspect", str(cache)])
    assert r.exit_code == 0 and "base tables x4" in r.stdout
    rc, out, _ = run_main(["build", ckpt_ct, tmp_path / "other", "--base-table", "x8", "--json"])
    assert rc == 2 and "--base-table" in json.loads(out)["error"] and not (tmp_path / "other").exists()


@pytest.mark.parametrize("tuning", [{"split_device": "torch-cpu"}, {"split_device": "cpu", "host_kernel": "numpy"}])
def test_every_split_path_fits_the_same_x4_tables(ckpt_modelopt: Path, tmp_path: Path, tuning: dict) -> None:
    """The torch path (the GPU split's maths) and the numpy kernels fit in the form too: the same plane files
    as the default path, the same errors to float rounding (as tests/test_bench_build.py holds for fitted)."""
    from moet_cache import BuildTuning
    build_cache(ckpt_modelopt, tmp_path / "ref", BuildOptions(delta_budget="30%", base_table="x4"))
    build_cache(ckpt_modelopt, tmp_path / "c", BuildOptions(delta_budget="30%", base_table="x4",
                                                           tuning=BuildTuning(**tuning)))
    files = sorted(p.relative_to(tmp_path / "ref") for p in (tmp_path / "ref").rglob("*.safetensors"))
    assert files
    for rel in files:
        assert (tmp_path / "ref" / rel).read_bytes() == (tmp_path / "c" / rel).read_bytes(), rel
    ref, got = (load_cache_files(tmp_path / d).layers for d in ("ref", "c"))
    for layer in ref:
        assert got[layer].sq_error == pytest.approx(ref[layer].sq_error, rel=1e-6)
    _assert_x4(tmp_path / "c")


def test_an_x4_cache_takes_the_x4_decode_and_computes_the_same(tmp_path: Path) -> None:
    """What the runtime makes of an x4 build: every loaded layer is taken for the x4 decode (x4_table.is_x4),
    and its planes repacked the way the GPU kernels read them give the same layer on the reference. The
    experts are 256 wide, so that their planes split into the x4 layout's tiles (K in chunks of 256)."""
    import torch

    from moet_cache.runtime import fused_moe
    from moet_cache.runtime.layout import prepare
    from moet_cache.runtime.plane_layout import X4
    from moet_cache.runtime.x4_table import is_x4
    from moet_cache.source.synthetic import make_checkpoint, small_spec

    src = make_checkpoint(tmp_path / "src", small_spec(moe_intermediate_size=256, num_hidden_layers=2))
    build_cache(src, tmp_path / "cache", BuildOptions(lossless=True, delta_budget="30%", base_table="x4"))
    c = open_cache(tmp_path / "cache")
    assert c.base_table == BaseTable.X4
    for lt in c.load(device="cpu", delta="tier", workers=1):
        t = lt.tensors
        assert is_x4(t)
        prepared = prepare(t)
        assert set(X4.names.values()) <= set(prepared)
        H, E = t["w13_base"].shape[2] * 4, t["w13_base"].shape[0]
        g = torch.Generator().manual_seed(lt.index)
        x = torch.randn((5, H), generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(5)])
        w = torch.rand((5, 2), generator=g)
        assert torch.equal(fused_moe(x, prepared, w, ids), fused_moe(x, t, w, ids))
