"""Fuzzed inputs (hypothesis): configs, indexes, safetensors headers, routing profiles, manifests, links.

Counts: tracebacks and exit codes other than 0/1/2 (must be 0), files created or changed outside the
cache (must be 0). Most cases call the library and map errors with the CLI's table; one in four runs
moet_cache.cli.app.main; a sample runs the real console script.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from .campaign import FUZZ_CASES, FUZZ_CI_EXAMPLES, FuzzEnv, fuzz_counted, recommit, rewrite_json, run_console, \
    tree_snapshot


@pytest.fixture(scope="module")
def env(module_work: Path) -> FuzzEnv:
    return FuzzEnv(module_work)


@pytest.mark.slow  # 17-30 s per kind on 2 busy cores
@pytest.mark.parametrize("kind", sorted(FUZZ_CASES))
def test_fuzz(env: FuzzEnv, kind: str) -> None:
    got = fuzz_counted(kind, env, FUZZ_CI_EXAMPLES[kind])
    assert env.failures == []
    assert got == {"cases": FUZZ_CI_EXAMPLES[kind], "crashes": 0, "bad_exit_codes": 0, "written_outside": 0}


def test_ci_share_is_at_least_2000_cases() -> None:
    assert sum(FUZZ_CI_EXAMPLES.values()) >= 2000


@pytest.mark.slow  # ~13 s: real processes
def test_real_processes_refuse_bad_input(env: FuzzEnv) -> None:
    """The console script itself: a manifest path that climbs out (re-sealed), a linked folder, a broken config."""
    case = env.case(with_cache=True)
    cache = case / "cache"
    lm = json.loads((cache / "layers/layer-001.json").read_bytes())
    lm["files"][0]["path"] = "../outside/sentinel.bin"
    rewrite_json(cache / "layers/layer-001.json", lm)
    recommit(cache, "layers/layer-001.json")
    os.symlink(case / "outside", cache / "staging")
    (case / "src" / "config.json").write_text('{"num_hidden_layers": "many"}')
    before = tree_snapshot(case, (cache,))
    for argv in (["verify", cache, "--full"], ["build", case / "src", cache], ["export", cache, case / "export"]):
        rc, out, err = run_console(argv)
        assert rc in (1, 2), (argv, rc, err)
        assert "Traceback" not in err and "internal error" not in err, err
    assert tree_snapshot(case, (cache, case / "export")) == {k: v for k, v in before.items() if not k.startswith("export")}


def test_unknown_dtype_in_a_dense_tensor_is_refused(env: FuzzEnv) -> None:
    """Found by the long campaign: a valid safetensors dtype we cannot carry (F8_E8M0) crashed the dense copy."""
    from .campaign import run_library
    case = env.case()
    shard = sorted((case / "src").glob("*.safetensors"))[0]
    blob = shard.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and "shared_experts" in k and v["dtype"] == "U8")
    header[name]["dtype"] = "F8_E8M0"
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    shard.write_bytes(len(raw).to_bytes(8, "little") + raw + blob[8 + n:])
    rc, _, err = run_library(["build", case / "src", case / "cache"])
    assert rc == 2 and "F8_E8M0" in err, err


@pytest.mark.parametrize("name", ["a" * 5000, "x\x00y.safetensors"])
def test_index_shard_name_too_long_or_nul_is_bad_input(env: FuzzEnv, name: str) -> None:
    """Found by the long campaign: a 5000-character shard name made is_file() raise ENAMETOOLONG (exit 3)."""
    from .campaign import run_library
    case = env.case()
    idx_path = case / "src" / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    first = next(iter(idx["weight_map"]))
    idx["weight_map"][first] = name
    idx_path.write_text(json.dumps(idx))
    rc, _, err = run_library(["build", case / "src", case / "cache"])
    assert rc == 2 and "invalid shard file" in err, err


def test_tampered_records_found_by_the_long_run(env: FuzzEnv) -> None:
    """Found by the long campaign: a dense part record with no files crashed a rebuild (IndexError), and
    an export of a cache whose aux entry names a missing file exited 3 (FileNotFoundError) instead of 1."""
    from .campaign import _reseal_file, run_library
    case = env.case(with_cache=True)
    cache = case / "cache"
    rel = next(str(p.relative_to(cache)) for p in (cache / "dense").glob("*.json"))
    part = json.loads((cache / rel).read_bytes())
    part["files"] = []
    rewrite_json(cache / rel, part)
    _reseal_file(cache, rel)
    rc, _, err = run_library(["build", case / "src", cache, "--lossless", "--delta-budget", "40%"])
    assert rc == 0, err  # the empty record is not reused: the shard is copied again
    case = env.case(with_cache=True)
    cache = case / "cache"
    doc = json.loads((cache / "cache.json").read_bytes())
    aux = next(f for f in doc["files"] if f["role"] == "aux")
    aux["path"] = "model/missing.json"
    rewrite_json(cache / "cache.json", doc)
    recommit(cache)
    rc, _, err = run_library(["export", cache, case / "export"])
    assert rc == 1 and "missing" in err, err
