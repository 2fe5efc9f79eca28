"""The nested 3-bit mid tier in the cache: its planes, tables, choice, manifests and verification, on real
built caches of the quality ladder's trained model (MXFP4 by QAT, and its NVFP4 export)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from safetensors import safe_open

from moet_cache import BuildOptions, boot_check, build_cache, full_verify, verify_against
from moet_cache.source.checkpoint import PROJECTIONS, open_checkpoint
from moet_cache.format.formats import scale_values
from moet_cache.errors import InputError
from moet_cache.format.fp4 import E2M1_VALUES, unpack_codes
from moet_cache.load import Shard, open_cache
from moet_cache.cache.manifest import DeltaIndex, ManifestError
from moet_cache.codec.planes import (fit_mid_table, mid_plane, mid_plane_reference, split_planes, three_bit_codes,
                                     unpack_base)

from test_manifest_schema_diff import KNOWN, RECORDS, SCHEMAS, _judge, _mutants
from test_verifier import flip_bit

MODELS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "quality_model"
FORMATS = ("mxfp4", "nvfp4")


@pytest.fixture(scope="module", params=FORMATS)
def mid_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(source, cache): a --lossless cache (every delta plane kept, to check the nesting against) with a
    5% delta tier and a 10% mid tier."""
    src = MODELS / request.param
    cache = tmp_path_factory.mktemp(f"mid-{request.param}") / "cache"
    build_cache(src, cache, BuildOptions(delta_budget="5%", mid_budget="10%", lossless=True))
    return src, cache


def _index(cache: Path) -> DeltaIndex:
    return DeltaIndex.parse(json.loads((cache / "delta/tier.json").read_text()))


def _tensor(cache: Path, rel: str, name: str) -> np.ndarray:
    with safe_open(cache / rel, "np") as f:
        return f.get_tensor(name)


# --- the planes --------------------------------------------------------------------------------------------
def test_mid_plane_is_the_delta_high_bit_bit_by_bit() -> None:
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, size=(5, 48), dtype=np.uint8)
    base, delta = split_planes(packed)
    mid = mid_plane(delta)
    assert mid.shape == (5, 12) and np.array_equal(mid, mid_plane_reference(packed))
    codes = unpack_codes(packed)
    assert np.array_equal(three_bit_codes(base, mid), codes >> 1)
    # base + mid + the delta's low bit is the FP4 code
    assert np.array_equal((three_bit_codes(base, mid) << 1) | (unpack_base(delta) & 1), codes)


def test_mid_table_is_the_count_weighted_mean_of_each_code_pair() -> None:
    hist = np.array([3, 1, 0, 0, 2, 2, 0, 5, 1, 0, 0, 0, 0, 0, 4, 4], dtype=np.int64)
    want = []
    for m in range(8):
        c, v = hist[2 * m: 2 * m + 2], E2M1_VALUES[2 * m: 2 * m + 2].astype(np.float64)
        want.append((c * v).sum() / c.sum() if c.sum() else v.mean())
    assert np.array_equal(fit_mid_table(hist), np.array(want, dtype=np.float32))


def test_the_one_pass_split_measures_the_mid_error_as_the_numpy_passes_do() -> None:
    from moet_cache.build.layers import mid_error
    from moet_cache.codec.planes import HostKernel, split_and_measure_e4m3, split_and_measure_mid_e4m3
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (64, 128), dtype=np.uint8)
    scales = rng.integers(0x20, 0x48, (64, 16), dtype=np.uint8)  # e4m3 bytes
    want = mid_error(codes, scales)
    for kernel in (HostKernel.C, HostKernel.NUMPY):
        got = split_and_measure_mid_e4m3(codes, scales, kernel=kernel)
        plain = split_and_measure_e4m3(codes, scales, kernel=kernel)
        assert all(np.array_equal(a, b) for a, b in zip(got[:3], plain[:3])) and got[3:5] == plain[3:5]
        assert got[5] == pytest.approx(want, rel=1e-9) and want > 0


# --- real built caches -------------------------------------------------------------------------------------
def test_mid_tier_nests_base_mid_and_the_delta_low_bit_into_the_fp4_code(mid_cache: tuple[Path, Path]) -> None:
    src, cache = mid_cache
    index = _index(cache)
    assert index.mid_layers is not None and sum(len(ex) for _, ex in index.mid_layers) > 0
    pack = "delta/tier.safetensors"
    seen = 0
    with open_checkpoint(src) as ck:
        for layer, experts in index.mid_layers:
            if not experts:
                continue
            assert not set(experts) & set(index.experts_of(layer) or ())  # never in both tiers
            base_rel = f"layers/layer-{layer:03d}.base.safetensors"
            delta_rel = f"layers/layer-{layer:03d}.delta.safetensors"
            planes = {w: (_tensor(cache, base_rel, f"{w}_base"), _tensor(cache, delta_rel, f"{w}_delta"),
                          _tensor(cache, pack, f"layers.{layer}.{w}_mid"),
                          _tensor(cache, pack, f"layers.{layer}.{w}_mid_table")) for w in ("w13", "w2")}
            for k, e in enumerate(experts):
                for j, proj in enumerate(PROJECTIONS):
                    x = ck.read_raw_expert(layer, e, proj)
                    codes = unpack_codes(x.codes)
                    w = "w2" if proj == "down_proj" else "w13"
                    base, delta, mid, tables = planes[w]
                    n = codes.shape[0]
                    rows = slice(None) if w == "w2" else slice(j * n, (j + 1) * n)
                    three = three_bit_codes(base[e][rows], mid[k][rows])
                    assert np.array_equal(three, codes >> 1), (layer, e, proj)
                    assert np.array_equal((three << 1) | (unpack_base(delta[e][rows]) & 1), codes)
                    table = tables[k] if w == "w2" else tables[k][j]
                    counts = np.bincount(codes.reshape(-1), minlength=16).reshape(8, 2)
                    pairs = E2M1_VALUES.reshape(8, 2).astype(np.float64)
                    want = np.where(counts.sum(1) > 0, (counts * pairs).sum(1) / np.maximum(counts.sum(1), 1),
                                    pairs.mean(1)).astype(np.float32)
                    assert np.array_equal(table, want)
                    ck.release(x.codes)
                    seen += 1
    assert seen == 3 * sum(len(ex) for _, ex in index.mid_layers)


def _three_bit_error(src: Path, layer: int, e: int) -> float:
    """An expert's squared error at 3 bits against its FP4 weights, all scales applied, in plain numpy."""
    total = 0.0
    with open_checkpoint(src) as ck:
        for proj in PROJECTIONS:
            x = ck.read_raw_expert(layer, e, proj)
            codes = unpack_codes(x.codes)
            scale = scale_values(x.scale_bytes, x.fmt.scale_form).astype(np.float64) * float(x.scale_2)
            w = np.repeat(scale, codes.shape[1] // scale.shape[1], axis=1)
            counts = np.bincount(codes.reshape(-1), minlength=16).reshape(8, 2)
            pairs = E2M1_VALUES.reshape(8, 2).astype(np.float64)
            table = np.where(counts.sum(1) > 0, (counts * pairs).sum(1) / np.maximum(counts.sum(1), 1), pairs.mean(1))
            total += float((((E2M1_VALUES[codes] - table[codes >> 1]) * w) ** 2).sum())
            ck.release(x.codes)
    return total


def test_mid_tier_is_chosen_by_the_error_its_plane_removes(mid_cache: tuple[Path, Path]) -> None:
    src, cache = mid_cache
    index = _index(cache)
    lms = {layer: json.loads((cache / f"layers/layer-{layer:03d}.json").read_text()) for layer, _ in index.layers}
    for layer in (0, 3):  # the recorded 3-bit errors, against a plain computation from the source
        for e in (0, 7):
            assert lms[layer]["mid_sq_error"][e] == pytest.approx(_three_bit_error(src, layer, e), rel=1e-5)
    # the mid tier: the experts outside the delta tier with the largest sq_error - mid_sq_error
    gain = sorted(((lm["sq_error"][e] - lm["mid_sq_error"][e], layer, e) for layer, lm in lms.items()
                   for e in range(lm["n_experts"]) if e not in (index.experts_of(layer) or ())), reverse=True)
    chosen = {(layer, e) for layer, ex in index.mid_layers for e in ex}
    assert chosen == {(layer, e) for _, layer, e in gain[:len(chosen)]}
    per_expert = 3 * 256 * 128 // 8 + 3 * 8 * 4  # planes of 256 x 128 weights each projection, three tables
    assert index.mid_used_bytes == len(chosen) * per_expert <= index.mid_budget_bytes
    assert (index.mid_budget_bytes - index.mid_used_bytes) < per_expert  # nothing more fits
    cm = json.loads((cache / "cache.json").read_text())
    assert cm["build"]["mid_budget_bytes"] == index.mid_budget_bytes


def test_a_cache_without_a_mid_tier_writes_none_of_its_keys(tmp_path: Path) -> None:
    build_cache(MODELS / "mxfp4", tmp_path / "c", BuildOptions(delta_budget="5%"))
    assert "mid_budget_bytes" not in json.loads((tmp_path / "c/cache.json").read_text())["build"]
    assert not {"mid_budget_bytes", "mid_used_bytes", "mid_layers"} & set(json.loads(
        (tmp_path / "c/delta/tier.json").read_text()))
    with safe_open(tmp_path / "c/delta/tier.safetensors", "np") as f:
        assert not [k for k in f.keys() if "_mid" in k]


def test_mid_tier_records_agree_with_their_schemas(mid_cache: tuple[Path, Path]) -> None:
    """The schema-diff test's mutations, on the records of a cache with a mid tier."""
    _, cache = mid_cache
    found = set()
    for record, (rel, parse) in RECORDS.items():
        doc = json.loads((cache / rel).read_text())
        validator = jsonschema.Draft202012Validator(json.loads((SCHEMAS / f"{record}.v1.schema.json").read_text()))
        assert _judge(doc, parse, validator) == (True, True), record
        for pattern, mutation, mutant in _mutants(doc):
            schema_ok, parse_ok = _judge(mutant, parse, validator)
            if schema_ok != parse_ok:
                found.add((record, pattern, mutation, "parser" if schema_ok else "schema"))
    # the rules across fields only the parser states: sorted distinct experts; a layer listed once (this
    # model's layers start at 0, so setting one to 0 lists layer 0 twice)
    mid_known = {("delta-index", "mid_layers.*.experts.*", "set 0", "parser"),
                 ("cache-manifest", "layers.*.layer", "set 0", "parser")}
    assert found - KNOWN - mid_known == set()


def test_a_mid_tier_index_needs_its_three_keys_together(mid_cache: tuple[Path, Path]) -> None:
    _, cache = mid_cache
    doc = json.loads((cache / "delta/tier.json").read_text())
    for key in ("mid_budget_bytes", "mid_used_bytes", "mid_layers"):
        cut = {k: v for k, v in doc.items() if k != key}
        with pytest.raises(ManifestError, match="mid tier"):
            DeltaIndex.parse(cut)


# --- verification ------------------------------------------------------------------------------------------
def test_verify_covers_the_mid_tier(mid_cache: tuple[Path, Path]) -> None:
    src, cache = mid_cache
    assert boot_check(cache).ok and full_verify(cache).ok
    r = verify_against(cache, src)
    n_mid = sum(len(ex) for _, ex in _index(cache).mid_layers)
    assert r.ok and r.details["mid_planes"] == 3 * n_mid


def _mid_byte(cache: Path) -> int:
    """The offset in the pack of a byte in the middle of the first mid plane."""
    raw = (cache / "delta/tier.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = next(k for k in sorted(header) if k.endswith(".w13_mid"))
    begin, end = header[name]["data_offsets"]
    return 8 + n + (begin + end) // 2


@pytest.mark.parametrize("check", ["full", "against"])
def test_a_flipped_byte_in_a_mid_plane_is_caught(mid_cache: tuple[Path, Path], tmp_path: Path, check: str) -> None:
    src, built = mid_cache
    cache = tmp_path / "cache"
    shutil.copytree(built, cache)
    flip_bit(cache / "delta/tier.safetensors", _mid_byte(cache), 3)
    if check == "full":
        r = full_verify(cache)
        assert r.state == "corrupt" and [(p.kind, p.path) for p in r.problems] == [("digest", "delta/tier.safetensors")]
    else:
        r = verify_against(cache, src)
        assert r.state == "corrupt"
        (p,) = r.problems
        assert p.kind == "mismatch" and p.path == "delta/tier.safetensors" and p.tensor.endswith(".w13_mid") \
            and "mid plane" in p.detail


# --- the build's command line, its reruns and retier ------------------------------------------------------
def test_moet_cache_build_takes_mid_budget_and_says_what_it_built(tmp_path: Path) -> None:
    from test_cli import run
    r = run("build", str(MODELS / "mxfp4"), str(tmp_path / "c"), "--delta-budget", "0", "--mid-budget", "5%", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    index = _index(tmp_path / "c")
    assert out["mid_experts"] == sum(len(ex) for _, ex in index.mid_layers) > 0
    assert out["mid_bytes"] == index.mid_used_bytes and out["tier_experts"] == 0
    r = run("build", str(MODELS / "mxfp4"), str(tmp_path / "d"), "--mid-budget", "lots")
    assert r.returncode == 2 and "mid budget" in r.stderr


def test_a_rerun_with_another_mid_budget_rewrites_the_tier_and_keeps_the_layers(tmp_path: Path) -> None:
    src, cache = MODELS / "nvfp4", tmp_path / "c"
    build_cache(src, cache, BuildOptions(delta_budget="5%", mid_budget="5%"))
    small = sum(len(ex) for _, ex in _index(cache).mid_layers)
    r = build_cache(src, cache, BuildOptions(delta_budget="5%", mid_budget="10%"))
    assert not r.already_complete and len(r.layers_reused) == 4
    assert r.mid_experts == sum(len(ex) for _, ex in _index(cache).mid_layers) > small
    assert build_cache(src, cache, BuildOptions(delta_budget="5%", mid_budget="10%")).already_complete
    r = build_cache(src, cache, BuildOptions(delta_budget="5%"))
    assert r.mid_experts == 0 and _index(cache).mid_layers is None and boot_check(cache).ok
    assert verify_against(cache, src).ok


def test_retier_writes_a_tier_without_the_mid_tier_and_the_cache_stays_whole(mid_cache: tuple[Path, Path],
                                                                               tmp_path: Path) -> None:
    from moet_cache import retier_cache
    _, built = mid_cache
    cache = tmp_path / "cache"
    shutil.copytree(built, cache)
    retier_cache(cache, "10%")
    assert _index(cache).mid_layers is None
    assert "mid_budget_bytes" not in json.loads((cache / "cache.json").read_text())["build"]
    assert boot_check(cache).ok and full_verify(cache).ok


def _tampered_index(built: Path, tmp_path: Path, change) -> Path:
    """A copy of the cache whose delta index `change` rewrote, re-sealed (cache.json's entry, COMMIT.json) as a
    writer who can rewrite the manifests would: the boot check's coverage rules are what refuses it."""
    from faults.campaign import recommit, rewrite_json
    from moet_cache.hashing import xxh3_hex
    cache = tmp_path / "cache"
    shutil.copytree(built, cache)
    doc = json.loads((cache / "delta/tier.json").read_text())
    change(doc)
    data = rewrite_json(cache / "delta/tier.json", doc)
    manifest = json.loads((cache / "cache.json").read_text())
    for f in manifest["files"]:
        if f["path"] == "delta/tier.json":
            f["size"], f["xxh3"] = len(data), xxh3_hex(data)
    rewrite_json(cache / "cache.json", manifest)
    recommit(cache)
    return cache


def _drop_mid(doc: dict) -> None:
    for k in ("mid_budget_bytes", "mid_used_bytes", "mid_layers"):
        del doc[k]


def _both_tiers(doc: dict) -> None:
    layer = next(x for x in doc["layers"] if x["experts"])
    mid = next(x for x in doc["mid_layers"] if x["layer"] == layer["layer"])
    mid["experts"] = sorted(set(mid["experts"]) | {layer["experts"][0]})


def _no_such_expert(doc: dict) -> None:
    doc["mid_layers"][0]["experts"] = doc["mid_layers"][0]["experts"] + [999]


def _layer_left_out(doc: dict) -> None:
    doc["mid_layers"] = doc["mid_layers"][1:]


@pytest.mark.parametrize("change,says", [(_drop_mid, "asked for a mid tier"), (_both_tiers, "in both"),
                                         (_no_such_expert, "expert >= 32"), (_layer_left_out, "no mid-tier entry")])
def test_the_boot_check_refuses_a_mid_tier_index_that_does_not_cover_the_cache(mid_cache: tuple[Path, Path],
                                                                                tmp_path: Path, change, says: str) -> None:
    _, built = mid_cache
    r = boot_check(_tampered_index(built, tmp_path, change))
    assert not r.ok and any(p.kind == "coverage" and says in p.detail for p in r.problems), r.problems


def test_plan_counts_the_mid_tier_as_resident_weights(mid_cache: tuple[Path, Path], tmp_path: Path) -> None:
    from moet_cache.cache.cacheview import open_view
    from moet_cache.plan import footprint_of_view
    src, cache = mid_cache
    plain = tmp_path / "plain"
    build_cache(src, plain, BuildOptions(delta_budget="5%", lossless=True))
    with_mid, without = footprint_of_view(open_view(cache)), footprint_of_view(open_view(plain))
    assert with_mid.base_bytes - without.base_bytes == _index(cache).mid_used_bytes > 0
    assert with_mid.delta_tier_bytes == without.delta_tier_bytes


@pytest.mark.slow  # ~40 s: real build processes SIGKILLed
def test_a_build_with_a_mid_tier_killed_anywhere_resumes_to_the_same_cache(tmp_path: Path) -> None:
    """`moet-cache build --mid-budget` in a real process, SIGKILLed at random moments after it took the lock:
    never complete before it is, and the rerun gives the delta pack and index a build never killed gives."""
    import random
    import signal
    import subprocess
    import sys
    import time
    src, args = MODELS / "nvfp4", ["--delta-budget", "3%", "--mid-budget", "10%", "--quiet"]
    fresh = tmp_path / "fresh"
    build_cache(src, fresh, BuildOptions(delta_budget="3%", mid_budget="10%"))
    rng = random.Random(5)
    unfinished = 0
    for k in range(6):
        cache = tmp_path / f"c{k}"
        p = subprocess.Popen([sys.executable, "-m", "moet_cache.cli.app", "build", str(src), str(cache), *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not (cache / ".lock").exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.3))
        p.send_signal(signal.SIGKILL)
        if p.wait() == -signal.SIGKILL and boot_check(cache).complete:
            assert full_verify(cache).ok  # complete only when it is
        unfinished += not boot_check(cache).complete
        build_cache(src, cache, BuildOptions(delta_budget="3%", mid_budget="10%"))
        assert full_verify(cache).ok
        for rel in ("delta/tier.safetensors", "delta/tier.json"):
            assert (cache / rel).read_bytes() == (fresh / rel).read_bytes(), (k, rel)
    assert unfinished >= 2  # the kills landed inside builds, not only after them


def test_inspect_says_what_the_mid_tier_holds(mid_cache: tuple[Path, Path]) -> None:
    from moet_cache.cache.inspection import inspect_cache
    from test_cli import run
    _, cache = mid_cache
    index = _index(cache)
    info = inspect_cache(cache)
    n_mid = sum(len(ex) for _, ex in index.mid_layers)
    assert info.mid_experts == n_mid and info.mid_tier_bytes == index.mid_used_bytes
    lms = {layer: json.loads((cache / f"layers/layer-{layer:03d}.json").read_text()) for layer, _ in index.layers}
    for li in info.layers:  # the served error counts the mid tier's experts at their 3-bit error
        lm, mid, tier = lms[li.layer], set(index.mid_experts_of(li.layer)), set(index.experts_of(li.layer))
        want = [0.0 if e in tier else (lm["mid_sq_error"][e] if e in mid else lm["sq_error"][e]) / lm["energy"][e]
                for e in range(lm["n_experts"])]
        assert li.rel_error_served == pytest.approx(sum(w ** 0.5 for w in want) / len(want))
    r = run("inspect", str(cache))
    assert r.returncode == 0 and f"mid tier: {n_mid}/128 experts at 3 bits" in r.stdout


def test_a_ranks_share_of_a_mid_tier_layer_is_refused_in_one_line(mid_cache: tuple[Path, Path]) -> None:
    """The mid planes are not cut into a rank's share: a tensor- or expert-parallel load of a layer with a
    mid tier is refused before any read, rather than handing out a whole mid plane beside a sliced base."""
    _, cache = mid_cache
    for shard in (Shard(None, 0, 2), Shard(tuple(range(16)))):
        with pytest.raises(InputError, match="mid tier, which a rank's share"):
            next(open_cache(cache).load(verify="none", delta="tier", shard=shard))
    assert next(open_cache(cache).load(verify="none", delta="none", shard=Shard(None, 0, 2))).tensors
