"""verify --against compares global scales, input scales, tables and the lossless source scalars with the source,
refuses a cache without its model config or source map, notices a dense tensor missing from the dense files,
and exits like the boot check (1 for an incomplete or corrupt cache)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moet_cache.cache.manifest import CACHE_MANIFEST, COMMIT_RECORD

from .campaign import _reseal_file, link_copy, recommit, rewrite_json, run_main

BASE = "layers/layer-001.base.safetensors"
DELTA = "layers/layer-001.delta.safetensors"


def _edit(cache: Path, rel: str, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite one cache safetensors file with some tensors changed, re-sealed into the manifests (what a
    disk cannot do by accident but a bug in the builder could): the boot check passes, --against must not."""
    path = cache / rel
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    change(tensors)
    path.unlink()  # a new inode: the reference cache shares this one by a hard link
    save_file(tensors, str(path), metadata=meta)
    _reseal_file(cache, rel)


def _times_2_128(t: torch.Tensor) -> None:
    """Expert 0's first value times 2^128 (or 2^-128 where that would overflow float32)."""
    flat = t.view(-1)
    v = float(flat[0])
    new = v * 2.0 ** 128 if abs(v * 2.0 ** 128) < 3e38 else v * 2.0 ** -128
    assert new != v and new != 0 and math.isfinite(new)
    flat[0] = new


def _against(cache: Path, src: Path) -> tuple[int, dict]:
    rc, out, err = run_main(["verify", cache, "--against", src, "--json"])
    return rc, json.loads(out)


@pytest.mark.parametrize("tensor,rel", [("w13_weight_scale_2", BASE), ("w2_weight_scale_2", BASE),
                                        ("w13_input_scale", BASE), ("w13_table", BASE),
                                        ("source.gate_proj.global_scale", DELTA)])
def test_a_scalar_changed_by_2_128_is_a_mismatch(lossless: tuple[Path, Path], work: Path, tensor: str,
                                                 rel: str) -> None:
    src, ref = lossless
    cache = link_copy(ref, work / "cache")
    with safe_open(str(cache / rel), framework="pt") as f:
        name = next(k for k in f.keys() if k == tensor or k.endswith(tensor))
    _edit(cache, rel, lambda ts: _times_2_128(ts[name]))
    assert run_main(["verify", cache])[0] in (0, 1)  # complete (unverified: the file changed); not refused
    rc, doc = _against(cache, src)
    assert rc == 1 and doc["state"] == "corrupt", doc
    (p,) = doc["problems"]
    assert p["kind"] == "mismatch" and p["tensor"] == name and p["layer"] == 1, p


@pytest.mark.parametrize("role", ["source-map", "aux"])
def test_a_cache_without_source_map_or_model_config_is_not_verified(lossless: tuple[Path, Path], work: Path,
                                                                    role: str) -> None:
    src, ref = lossless
    cache = link_copy(ref, work / "cache")
    doc = json.loads((cache / CACHE_MANIFEST).read_bytes())
    doc["files"] = [f for f in doc["files"] if not (f["role"] == role and (role != "aux" or f["path"].endswith("/config.json")))]
    rewrite_json(cache / CACHE_MANIFEST, doc)
    recommit(cache)
    rc, rep = _against(cache, src)
    assert rc == 1 and rep["state"] == "corrupt", rep
    assert ("source map" if role == "source-map" else "config.json") in rep["problems"][0]["detail"]


def test_a_dense_tensor_missing_from_the_dense_file_is_noticed(lossless: tuple[Path, Path], work: Path) -> None:
    src, ref = lossless
    cache = link_copy(ref, work / "cache")
    rel = next(str(p.relative_to(cache)) for p in (cache / "dense").glob("*.safetensors"))
    with safe_open(str(cache / rel), framework="pt") as f:
        gone = sorted(f.keys())[0]
    _edit(cache, rel, lambda ts: ts.pop(gone))
    rc, rep = _against(cache, src)
    assert rc == 1 and rep["problems"][0]["tensor"] == gone and "in no dense file" in rep["problems"][0]["detail"], rep


def test_against_uses_the_boot_checks_exit_codes(lossless: tuple[Path, Path], work: Path) -> None:
    src, ref = lossless
    cache = link_copy(ref, work / "cache")
    assert _against(cache, src)[0] == 0
    (cache / COMMIT_RECORD).unlink()
    rc, rep = _against(cache, src)
    assert rc == 1 and rep["state"] == "incomplete", rep
    cache2 = link_copy(ref, work / "cache2")
    (cache2 / "layers/layer-002.json").unlink()
    rc, rep = _against(cache2, src)
    assert rc == 1 and rep["state"] == "corrupt", rep


def test_a_table_of_the_other_form_is_a_mismatch(lossless: tuple[Path, Path], work: Path) -> None:
    """An x4 cache holding one fitted table (a builder that forgot the form), and a fitted cache whose manifest
    says x4: --against refits each table in the form the manifest names, so both are caught."""
    from moet_cache import BuildOptions, build_cache
    from moet_cache.source.checkpoint import open_checkpoint
    from moet_cache.codec.planes import code_histogram, fit_table
    src, ref = lossless
    x4 = work / "x4"
    build_cache(src, x4, BuildOptions(delta_budget="30%", lossless=True, base_table="x4"))
    assert _against(x4, src)[0] == 0
    with open_checkpoint(src) as ck:
        fitted = fit_table(code_histogram(ck.read_raw_expert(1, 0, "up_proj").codes))

    def swap(ts: dict[str, torch.Tensor]) -> None:
        ts["w13_table"][0, 1] = torch.from_numpy(fitted)
    _edit(x4, BASE, swap)
    rc, doc = _against(x4, src)
    assert rc == 1 and doc["state"] == "corrupt", doc
    (p,) = doc["problems"]
    assert p["tensor"] == "w13_table" and "up_proj: x4 table" in p["detail"], p
    cache = work / "fitted"
    build_cache(src, cache, BuildOptions(delta_budget="30%", lossless=True, base_table="fitted"))
    doc = json.loads((cache / CACHE_MANIFEST).read_bytes())
    assert "base_table" not in doc["build"]  # written for x4 caches only
    doc["build"]["base_table"] = "x4"
    rewrite_json(cache / CACHE_MANIFEST, doc)
    recommit(cache)
    rc, rep = _against(cache, src)
    assert rc == 1 and rep["problems"][0]["tensor"] == "w13_table", rep
