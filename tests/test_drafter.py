"""The speculative-decoding drafter in the cache: DSpark (DeepSeek-V4-Flash-0731: blocks mtp.0-2 under one head
stack) and MTP (one block mtp.0) built with --include-drafter, verified like any layer, listed by inspect.
Real files and real processes of the console script; the names are vLLM 0.34's (vllm/models/deepseek_v4/nvidia/
dspark.py and mtp.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from moet_cache.cache import layout as L
from moet_cache.source.checkpoint import open_checkpoint
from moet_cache.format.families import DRAFTER_DSPARK, DRAFTER_MTP
from moet_cache.stheader import read_header
from moet_cache.source.synthetic import dspark_v4_spec, make_v4_checkpoint, small_v4_spec, v4_config_for

EXE = [sys.executable, "-m", "moet_cache.cli.app"]
HEAD_STACK = ("mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.norm.weight", "mtp.2.hc_head_fn",
              "mtp.2.hc_head_base", "mtp.2.hc_head_scale", "mtp.2.markov_head.markov_w1.weight",
              "mtp.2.markov_head.markov_w2.weight", "mtp.2.confidence_head.proj.weight")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*EXE, *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafter-src")
    return {DRAFTER_DSPARK: make_v4_checkpoint(root / "dspark", dspark_v4_spec(n_routed_experts=8, seed=3)),
            DRAFTER_MTP: make_v4_checkpoint(root / "mtp", small_v4_spec(n_routed_experts=8, seed=4))}


@pytest.fixture(scope="module")
def dspark_cache(tmp_path_factory: pytest.TempPathFactory, sources: dict[str, Path]) -> Path:
    cache = tmp_path_factory.mktemp("drafter-cache") / "c"
    r = run("build", sources[DRAFTER_DSPARK], cache, "--include-drafter", "--delta-budget", "40%", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layers"] == [0, 1, 2, 3, 4, 5, 6]
    return cache


def _drafter_tensors(src: Path) -> dict[str, tuple[str, int]]:
    """Every non-expert mtp.* tensor of a source: name -> (shard, bytes)."""
    with open_checkpoint(src) as ck:
        return {n: (t.shard, t.nbytes) for n, t in ck.tensors.items()
                if n.startswith("mtp.") and ".ffn.experts." not in n}


def test_the_dspark_checkpoint_has_the_head_stack_vllm_loads(sources: dict[str, Path]) -> None:
    names = set(_drafter_tensors(sources[DRAFTER_DSPARK]))
    assert set(HEAD_STACK) <= names
    assert not any(".e_proj." in n or ".h_proj." in n or ".enorm." in n for n in names)  # MTP's, not DSpark's
    assert {f"mtp.{k}.attn.wkv.weight" for k in range(3)} <= names  # vLLM stacks these into context_wkv_proj
    cfg = json.loads((sources[DRAFTER_DSPARK] / "config.json").read_text())
    spec = dspark_v4_spec()
    assert cfg["n_mtp_layers"] == 3 and cfg["dspark_target_layer_ids"] == list(spec.dspark_target_layer_ids)
    assert cfg == v4_config_for(dspark_v4_spec(n_routed_experts=8, seed=3))
    with open_checkpoint(sources[DRAFTER_DSPARK]) as ck:
        assert ck.family.mtp_layers == (4, 5, 6)
        assert ck.tensors["mtp.0.main_proj.weight"].shape == (256, 256 * len(spec.dspark_target_layer_ids))
        assert ck.tensors["mtp.2.confidence_head.proj.weight"].shape == (1, 256 + spec.dspark_markov_rank)
    mtp = set(_drafter_tensors(sources[DRAFTER_MTP]))
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.norm.weight"} <= mtp
    assert not any("markov_head" in n or "main_proj" in n for n in mtp)


def test_build_keeps_every_drafter_tensor_and_inspect_lists_the_drafter(dspark_cache: Path,
                                                                         sources: dict[str, Path]) -> None:
    src = sources[DRAFTER_DSPARK]
    want = _drafter_tensors(src)
    parts = [json.loads(p.read_text()) for p in sorted((dspark_cache / L.DENSE_DIR).glob("*.json"))]
    held = {t["name"]: t for part in parts for t in part["tensors"]}
    assert set(want) <= set(held)
    for name in HEAD_STACK:  # the bytes themselves, read from both files
        t = held[name]
        with safe_open(src / want[name][0], "pt") as f:
            raw = f.get_slice(name)
            n0 = read_header(src / want[name][0]).tensors[name]
        blob = (src / want[name][0]).read_bytes()
        assert (dspark_cache / t["file"]).read_bytes()[t["begin"]:t["end"]] == blob[n0.begin:n0.end], name
        assert list(raw.get_shape()) == t["shape"]
    for r in (run("verify", dspark_cache, "--full"), run("verify", dspark_cache, "--against", src)):
        assert r.returncode == 0, r.stdout + r.stderr
    r = run("inspect", dspark_cache, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    d = doc["drafter"]
    assert d["layout"] == DRAFTER_DSPARK and d["blocks"] == ["mtp.0", "mtp.1", "mtp.2"] and d["layers"] == [4, 5, 6]
    assert d["dense_bytes"] == sum(b for _, b in want.values())
    assert d["base_bytes"] == sum((dspark_cache / L.LAYERS_DIR / f"layer-{i:03d}.base.safetensors").stat().st_size
                                  for i in (4, 5, 6))
    per_layer = {x["layer"]: x for x in doc["layers"]}
    assert d["tier_bytes"] == sum(per_layer[i]["delta_bytes"] for i in (4, 5, 6))
    assert d["tier_experts"] == sum(per_layer[i]["delta_experts"] for i in (4, 5, 6))
    text = run("inspect", dspark_cache)
    assert text.returncode == 0 and "drafter: dspark, blocks mtp.0, mtp.1, mtp.2 (cache layers 4, 5, 6)" in text.stdout


@pytest.mark.parametrize("where", ["head", "plane"])
def test_a_flipped_byte_in_a_drafter_file_is_caught(dspark_cache: Path, tmp_path: Path, where: str) -> None:
    cache = tmp_path / "c"
    shutil.copytree(dspark_cache, cache)
    if where == "head":  # inside the Markov head's bytes in its dense shard
        t = next(t for p in sorted((cache / L.DENSE_DIR).glob("*.json")) for t in json.loads(p.read_text())["tensors"]
                 if t["name"] == "mtp.2.markov_head.markov_w1.weight")
        path, offset = cache / t["file"], (t["begin"] + t["end"]) // 2
    else:  # inside mtp.1's base planes
        path = cache / L.LAYERS_DIR / "layer-005.base.safetensors"
        offset = path.stat().st_size - 100
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))
    r = run("verify", cache, "--full", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and not doc["complete"], r.stdout
    assert any(path.name in json.dumps(p) for p in doc["problems"]), doc["problems"]


def test_include_mtp_is_the_same_option_and_an_mtp_drafter_is_listed(sources: dict[str, Path], tmp_path: Path) -> None:
    r = run("build", sources[DRAFTER_MTP], tmp_path / "m", "--include-mtp", "-q")
    assert r.returncode == 0, r.stderr
    d = json.loads(run("inspect", tmp_path / "m", "--json").stdout)["drafter"]
    assert d["layout"] == DRAFTER_MTP and d["blocks"] == ["mtp.0"] and d["layers"] == [4]
    assert d["dense_bytes"] == sum(b for _, b in _drafter_tensors(sources[DRAFTER_MTP]).values())
    r = run("build", sources[DRAFTER_DSPARK], tmp_path / "n", "-q")  # without the option: no drafter
    assert r.returncode == 0, r.stderr
    doc = json.loads(run("inspect", tmp_path / "n", "--json").stdout)
    assert doc["drafter"] is None and "add --include-drafter" in doc["served_blocks"]
