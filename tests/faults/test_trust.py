"""Nothing is called verified that no check read, and a load never mixes two commits: retier refuses a
damaged or unproven cache and checks every plane it copies; a failed --full is remembered until a build
repairs it; the boot check hashes the model folder and the other small files; a load straddling a
retier refuses; --against reads through the pread seam (a file cut under it is exit 1, not SIGBUS)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moet_cache import BuildOptions, boot_check, build_cache, full_verify, open_cache, retier_cache
from moet_cache.cache import layout as L
from moet_cache.errors import VerificationError
from moet_cache.cache.manifest import COMMIT_RECORD

from .campaign import link_copy, private, run_main
from .test_io import _inject

BASE = L.base_file(1)
DELTA = L.delta_file(1)


def _tensor(cache: Path, layer: int, name: str) -> dict:
    lm = json.loads((cache / L.layer_manifest(layer)).read_text())
    return next(t for t in lm["tensors"] if t["name"] == name)


def _flip_keeping_stats(path: Path, offset: int) -> None:
    """Flip one bit in place and put the times back: same inode, size and mtime, so only a hash can see it
    (what a disk's silent corruption looks like to the boot check)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _verified_copy(ref: Path, dst: Path, *own: str) -> Path:
    """A hard-link copy of a cache with the named files given their own inodes, verified again by --full."""
    cache = link_copy(ref, dst)
    for rel in own:
        private(cache / rel)
    assert full_verify(cache).ok
    return cache


def _retier_refused(cache: Path, *words: str, boot_sees_it: bool = True) -> None:
    """retier exits 1 (library: VerificationError naming `words`), and leaves the commit and tier alone."""
    before = {p: (cache / p).read_bytes() for p in (COMMIT_RECORD, L.PACK, L.DELTA_INDEX) if (cache / p).exists()}
    with pytest.raises(VerificationError) as e:
        retier_cache(cache, "60%")
    for w in words:
        assert w in str(e.value)
    rc, out, _ = run_main(["retier", cache, "--delta-budget", "60%", "--json"])
    assert rc == 1 and json.loads(out)["exit_code"] == 1
    assert {p: (cache / p).read_bytes() for p in before} == before
    assert boot_check(cache).ok != boot_sees_it  # not called verified where the boot check saw the damage


# --- retier ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rel", [BASE, DELTA, "dense"])
def test_retier_refuses_a_cache_with_a_flipped_byte_the_boot_check_sees_changed(
        lossless: tuple[Path, Path], work: Path, rel: str) -> None:
    cache = link_copy(lossless[1], work / "cache")
    target = next((cache / "dense").glob("*.safetensors")) if rel == "dense" else cache / rel
    private(target)
    _flip_keeping_stats(target, target.stat().st_size - 3)
    os.utime(target)  # a flip the boot check can see as a change (not as damage): "unverified"
    assert boot_check(cache).state == "unverified"
    _retier_refused(cache, str(target.relative_to(cache)), "does not match")  # re-hashed: what changed is proven
    assert full_verify(cache).state == "corrupt"  # the damage is still where --full finds it


def test_retier_rehashes_what_changed_and_then_records_it(lossless: tuple[Path, Path], work: Path) -> None:
    """A copy (every file "copied", so unverified) is re-tiered after its kept files are re-hashed."""
    cache = link_copy(lossless[1], work / "cache")
    for p in (cache / "layers").iterdir():
        private(p)
    assert boot_check(cache).state == "unverified"
    assert retier_cache(cache, "60%").tier_experts > 0
    assert boot_check(cache).ok and full_verify(cache).ok


def test_retier_never_copies_a_delta_plane_that_does_not_match_its_digest(lossless: tuple[Path, Path],
                                                                          work: Path) -> None:
    """The flip keeps the stats, so the boot check says verified: the copy itself must be checked."""
    cache = _verified_copy(lossless[1], work / "cache", DELTA)
    t = _tensor(cache, 1, L.W13_DELTA)
    _flip_keeping_stats(cache / DELTA, (t["begin"] + t["end"]) // 2)
    assert boot_check(cache).ok
    _retier_refused(cache, DELTA, "digest", boot_sees_it=False)
    assert not list(cache.rglob("*.tmp-*"))
    rep = full_verify(cache)  # the damage stayed in the delta file, where --full still sees it
    assert rep.state == "corrupt" and [p.path for p in rep.problems] == [DELTA]


def test_retier_refuses_a_delta_file_it_cannot_read(lossless: tuple[Path, Path], work: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cache = link_copy(lossless[1], work / "cache")
    hits = _inject(monkeypatch, DELTA, errno.EIO, "read")
    with pytest.raises(VerificationError, match="cannot be read"):
        retier_cache(cache, "60%")
    assert hits
    rc, out, _ = run_main(["retier", cache, "--delta-budget", "60%", "--json"])
    assert rc == 1 and "cannot be read" in json.loads(out)["error"]
    monkeypatch.undo()
    assert boot_check(cache).ok  # the previous commit stands, untouched
    assert retier_cache(cache, "60%").tier_experts > 0 and full_verify(cache).ok


@pytest.mark.parametrize("how", ["missing", "cut", "fifo"])
def test_retier_runs_the_boot_check_first(lossless: tuple[Path, Path], work: Path, how: str) -> None:
    cache = link_copy(lossless[1], work / "cache")
    target = cache / BASE
    target.unlink()
    if how == "cut":
        target.write_bytes((lossless[1] / BASE).read_bytes()[:100])
    elif how == "fifo":
        os.mkfifo(target)
    _retier_refused(cache, BASE)


def test_a_resumed_retier_refuses_a_damaged_kept_file_as_damage(lossless: tuple[Path, Path], work: Path) -> None:
    """Uncommitted (a retier killed in its window): every kept file is re-hashed; a damaged one is exit 1."""
    cache = link_copy(lossless[1], work / "cache")
    (cache / COMMIT_RECORD).unlink()
    private(cache / BASE)
    _flip_keeping_stats(cache / BASE, (cache / BASE).stat().st_size - 3)
    with pytest.raises(VerificationError, match=f"not committed and {BASE} does not match"):
        retier_cache(cache, "60%")
    assert run_main(["retier", cache, "--delta-budget", "60%"])[0] == 1
    assert not (cache / COMMIT_RECORD).exists()


# --- a failed --full is remembered -----------------------------------------------------------------
def test_a_failed_full_verify_is_remembered_until_a_build_repairs_it(cache: Path, ckpt_modelopt: Path) -> None:
    t = _tensor(cache, 2, L.W2_BASE)
    _flip_keeping_stats(cache / L.base_file(2), (t["begin"] + t["end"]) // 2)
    assert boot_check(cache).ok  # only a hash can see this flip
    rc, _, _ = run_main(["verify", cache, "--full"])
    assert rc == 1
    boot = boot_check(cache)
    assert boot.state == "corrupt" and [p.path for p in boot.problems] == [L.base_file(2)]
    assert "verify --full" in boot.problems[0].detail
    assert run_main(["verify", cache])[0] == 1
    assert run_main(["serve", cache, "--dry-run", "--skip-flag-check"])[0] == 1
    with pytest.raises(VerificationError, match="corrupt"):
        open_cache(cache)
    r = build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="25%"))  # the hint's repair
    assert not r.already_complete and 2 in r.layers_built
    assert boot_check(cache).ok and full_verify(cache).ok


# --- the small files --------------------------------------------------------------------------------
def _small_files(cache: Path) -> list[str]:
    doc = json.loads((cache / "cache.json").read_text())
    return [f["path"] for f in doc["files"] if f["role"] in ("aux", "source-config", "part-manifest", "source-map")]


def test_the_boot_check_hashes_every_small_file(src_copy: Path, tmp_path: Path) -> None:
    """Each small file (the tokenizer and V4's encoding/ among them) changed in place, its stats kept: the
    boot check says corrupt; verify, verify --full and serve exit 1; the loader refuses."""
    (src_copy / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    (src_copy / "encoding").mkdir()
    (src_copy / "encoding" / "encoding_dsv4.py").write_text("def encode(messages):\n    return messages\n")
    ref = tmp_path / "ref"
    build_cache(src_copy, ref, BuildOptions(delta_budget="25%"))
    small = _small_files(ref)
    assert {"model/config.json", "model/config.source.json", "model/generation_config.json", "model/tokenizer.json",
            "model/encoding/encoding_dsv4.py", L.SOURCE_MAP, "delta/tier.part.json"} <= set(small)
    assert any(p.startswith("dense/") for p in small)
    for rel in small:
        cache = link_copy(ref, tmp_path / rel.replace("/", "_"))
        private(cache / rel)
        assert full_verify(cache).ok
        _flip_keeping_stats(cache / rel, (cache / rel).stat().st_size // 2)
        boot = boot_check(cache)
        assert boot.state == "corrupt" and [p.path for p in boot.problems] == [rel], rel
        for argv in (["verify", cache], ["serve", cache, "--dry-run", "--skip-flag-check"],
                     ["verify", cache, "--full"]):
            assert run_main(argv)[0] == 1, (rel, argv)
        with pytest.raises(VerificationError):
            open_cache(cache)


def test_a_damaged_cache_file_is_exit_1_in_inspect_and_plan(built_cache: Path, tmp_path: Path) -> None:
    cache = link_copy(built_cache, tmp_path / "cache")
    private(cache / "cache.json")
    _flip_keeping_stats(cache / "cache.json", 40)  # no longer what COMMIT.json names
    for argv in (["inspect", cache], ["plan", cache], ["verify", cache]):
        assert run_main(argv)[0] == 1, argv
    (cache / COMMIT_RECORD).unlink()  # a hard link to the shared cache's: replaced, not written through
    (cache / COMMIT_RECORD).write_bytes(b"\x00junk")
    for argv in (["inspect", cache], ["plan", cache], ["verify", cache]):
        assert run_main(argv)[0] == 1, argv


def test_against_checks_the_small_files(built_cache: Path, ckpt_modelopt: Path, tmp_path: Path) -> None:
    for rel in ("model/config.source.json", "model/generation_config.json"):
        cache = link_copy(built_cache, tmp_path / rel.replace("/", "_"))
        private(cache / rel)
        _flip_keeping_stats(cache / rel, (cache / rel).stat().st_size // 2)
        rc, out, _ = run_main(["verify", cache, "--against", ckpt_modelopt, "--json"])
        doc = json.loads(out)
        assert rc == 1 and doc["state"] == "corrupt" and rel in [p["path"] for p in doc["problems"]]


# --- a load straddling a retier -----------------------------------------------------------------------
def test_a_load_straddling_a_retier_refuses(lossless: tuple[Path, Path], work: Path) -> None:
    """Open, retier to another tier of the same size per layer, then load: the load must not hand out the
    old delta index with the new pack's planes."""
    cache = link_copy(lossless[1], work / "cache")
    old = {d["layer"]: tuple(d["experts"]) for d in json.loads((cache / L.DELTA_INDEX).read_text())["layers"]}
    n = json.loads((cache / L.layer_manifest(1)).read_text())["n_experts"]
    want = {layer: [e for e in range(n) if e not in ex][:len(ex)] for layer, ex in old.items()}
    assert any(want[layer] != list(old[layer]) for layer in old)
    profile = work / "profile.json"
    profile.write_text(json.dumps({"format": "moet-cache-routing-profile", "format_version": 1, "layers": [
        {"layer": layer, "counts": [1e6 if e in want[layer] else 0 for e in range(n)]} for layer in sorted(old)]}))
    budget = json.loads((cache / L.DELTA_INDEX).read_text())["used_bytes"]

    opened = open_cache(cache)
    retier_cache(cache, str(budget), profile=str(profile))
    new = {d["layer"]: tuple(d["experts"]) for d in json.loads((cache / L.DELTA_INDEX).read_text())["layers"]}
    assert {k: len(v) for k, v in new.items()} == {k: len(v) for k, v in old.items()} and new != old
    for verify in ("boot", "none"):
        with pytest.raises(VerificationError, match="changed since the cache was opened"):
            list(opened.load(verify=verify))
    fresh = {x.index: x.tensors["delta_experts"].tolist() for x in open_cache(cache).load()}
    assert fresh == {layer: list(ex) for layer, ex in new.items() if layer in fresh}


# --- --against reads through the seam ---------------------------------------------------------------
_CUT_UNDER_AGAINST = r"""
import os, sys
from moet_cache import verify_against
from moet_cache.cli._errors import exit_code_for
cache, src, target = sys.argv[1:4]
real = os.preadv
state = {"done": False}
def preadv(fd, bufs, offset):
    # the first read of the source's expert bytes: the cache's base file of that layer is open by now; cut it
    if not state["done"] and os.path.realpath(f"/proc/self/fd/{fd}").startswith(src):
        state["done"] = True
        os.truncate(target, 4096)
    return real(fd, bufs, offset)
os.preadv = preadv
try:
    rep = verify_against(cache, src)
except BaseException as e:
    print(type(e).__name__, e)
    sys.exit(exit_code_for(e) or 99)
print(rep.state, state)
sys.exit(0 if rep.ok else 1)
"""


def test_a_file_cut_during_against_is_exit_1_not_sigbus(lossless: tuple[Path, Path], work: Path) -> None:
    src, ref = lossless
    cache = link_copy(ref, work / "cache")
    target = cache / BASE
    private(target)
    os.utime(target, ns=((ref / BASE).stat().st_atime_ns, (ref / BASE).stat().st_mtime_ns))
    assert boot_check(cache).state in ("verified", "unverified")
    script = work / "cut.py"
    script.write_text(_CUT_UNDER_AGAINST)
    p = subprocess.run([sys.executable, str(script), str(cache), str(src.resolve()), str(target.resolve())],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr[-2000:])  # a map would die of SIGBUS (-7)
    assert "VerificationError" in p.stdout and target.stat().st_size == 4096  # cut under the check, reported
