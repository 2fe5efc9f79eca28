"""The build's input safety: a source and a cache that overlap, a folder that is not a cache, files the
build did not write, and source model files that cannot be carried (docs/GUARANTEES.md, section 5.1)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from moet_cache import BuildOptions, CancelToken, build_cache
from moet_cache import fsutil
from moet_cache.cache import layout as L
from moet_cache.errors import Interrupted
from moet_cache.verify import VERIFIED, boot_check, full_verify

from faults.campaign import exported_equals_source, link_copy, run_console, run_main


def snapshot(folder: Path) -> dict[str, tuple[bytes | str, int]]:
    """Every entry under `folder`: a file's bytes (a link's target) and its mode."""
    out: dict[str, tuple[bytes | str, int]] = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        what: bytes | str = os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
        out[p.relative_to(folder).as_posix()] = (what, stat.S_IMODE(st.st_mode))
    return out


def user_files(folder: Path) -> dict[str, bytes]:
    """A user's own files in every folder a cache uses, and beside them."""
    files = {"README.md": b"my project\n", "model/notes.txt": b"mine\n", "layers/plan.txt": b"layers of my plan\n",
             "dense/data.bin": b"\x00\x01", "delta/changes.diff": b"-a\n+b\n", "staging/draft.txt": b"draft\n",
             "model/sub/keep.json": b"{}\n"}
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return files


# --- SRC and CACHE never overlap -----------------------------------------------------------------------

def test_source_inside_the_cache_is_refused_before_anything_is_written(ckpt_modelopt: Path, tmp_path: Path) -> None:
    # `moet-cache build x/model x`: the checkpoint inside the folder the cache is built into
    x = tmp_path / "x"
    shutil.copytree(ckpt_modelopt, x / "model")
    before = snapshot(x)
    rc, _, err = run_main(["build", x / "model", x])
    assert rc == 2 and "overlap" in err, err
    assert snapshot(x) == before  # not even the lock file


def test_source_under_a_caches_staging_folder_survives(ckpt_modelopt: Path, tmp_path: Path) -> None:
    # a real cache, the checkpoint put under its staging/ folder (the sweep once removed staging/ whole),
    # reached directly and through a link from outside
    cache = tmp_path / "cache"
    build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="25%"))
    src = cache / L.STAGING_DIR / "src"
    shutil.copytree(ckpt_modelopt, src)
    (tmp_path / "alias").symlink_to(src)
    before = snapshot(cache)
    for given in (src, tmp_path / "alias"):
        rc, _, err = run_main(["build", given, cache, "--delta-budget", "10%"])
        assert rc == 2 and "overlap" in err, err
        assert snapshot(cache) == before
    assert boot_check(cache).state == VERIFIED


def test_a_cache_holding_the_source_or_a_link_into_the_cache_is_refused(ckpt_modelopt: Path, tmp_path: Path) -> None:
    src = Path(shutil.copytree(ckpt_modelopt, tmp_path / "src"))
    rc, _, err = run_main(["build", src, tmp_path])  # the cache folder holds the checkpoint
    assert rc == 2 and "overlap" in err, err
    assert not (tmp_path / ".lock").exists() and not (tmp_path / "model").exists()
    # a checkpoint file that is a link into the cache folder: the build would replace or sweep what it reads
    cache = tmp_path / "cache"
    build_cache(src, cache, BuildOptions(delta_budget="25%"))
    (src / "tokenizer.json").symlink_to(cache / "model" / "config.json")
    before = snapshot(cache)
    rc, _, err = run_main(["build", src, cache])
    assert rc == 2 and "link into the cache folder" in err, err
    assert snapshot(cache) == before


# --- only a new, empty or cache folder; the sweep deletes only what a record proves the build wrote --------

def test_a_folder_of_other_files_is_refused_and_left_as_it_was(ckpt_modelopt: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    user_files(project)
    before = snapshot(project)
    rc, _, err = run_main(["build", ckpt_modelopt, project])
    assert rc == 2 and "holds no moet-cache cache" in err and "new or empty folder" in err, err
    assert snapshot(project) == before
    # an empty folder, or one where a killed build got no further than its lock, is built into
    (tmp_path / "empty").mkdir()
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / ".lock").write_bytes(b"123\n")
    for name in ("empty", "locked"):
        rc, _, err = run_main(["build", ckpt_modelopt, tmp_path / name, "--quiet"])
        assert rc == 0, err
        assert boot_check(tmp_path / name).state == VERIFIED


def test_files_the_build_did_not_write_survive_rebuilds(ckpt_modelopt: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    build_cache(ckpt_modelopt, cache, BuildOptions(lossless=True, delta_budget="25%"))
    mine = user_files(cache)
    # a rebuild that changes every layer and the tier (its sweep removes the old delta files) ...
    build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="10%", layers="1-2"))
    assert not list(cache.glob("layers/*.delta.safetensors")) and not (cache / L.layer_manifest(3)).exists()
    # ... and a rerun that only confirms the cache
    assert build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="10%", layers="1-2")).already_complete
    assert {rel: (cache / rel).read_bytes() for rel in mine} == mine
    assert full_verify(cache).ok


def test_a_build_stopped_before_its_first_record_resumes_and_proves_what_it_left(
        ckpt_modelopt: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    token = CancelToken()
    token.cancel()
    with pytest.raises(Interrupted):  # stopped at its first unit: no layer manifest, part record or cache.json
        build_cache(ckpt_modelopt, cache, BuildOptions(lossless=True), cancel=token)
    assert not (cache / "cache.json").exists() and (cache / L.WRITTEN_RECORD).is_file()
    # the folder is the build's (its record says so): the rerun resumes it
    build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="25%"))
    assert boot_check(cache).state == VERIFIED
    # a build killed before .written.json existed left layer manifests and part records: its folder too
    for name in (L.WRITTEN_RECORD, "cache.json", "COMMIT.json"):
        (cache / name).unlink()
    (cache / "delta" / "tier.safetensors").unlink()
    build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="25%"))
    assert boot_check(cache).state == VERIFIED


def test_a_cache_without_the_written_record_still_sweeps_what_its_records_list(
        ckpt_modelopt: Path, tmp_path: Path) -> None:
    # a cache made before .written.json existed: its manifests and part records are the proof
    cache = tmp_path / "cache"
    build_cache(ckpt_modelopt, cache, BuildOptions(lossless=True, delta_budget="25%"))
    (cache / L.WRITTEN_RECORD).unlink()
    build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="25%"))
    assert not list(cache.glob("layers/*.delta.safetensors"))
    assert full_verify(cache).ok


# --- the model folder: every file carried, or the build refused ----------------------------------------

@pytest.mark.parametrize("kind", ["dangling", "loop", "fifo", "unreadable"])
def test_a_model_file_that_cannot_be_carried_is_refused(src_copy: Path, tmp_path: Path, kind: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    bad = src_copy / "tokenizer.json"
    bad.unlink(missing_ok=True)
    if kind == "dangling":
        bad.symlink_to(src_copy / "nowhere.json")
    elif kind == "loop":
        bad.symlink_to(bad)
    elif kind == "fifo":
        os.mkfifo(bad)
    else:
        bad.write_text("{}")
        real_open = fsutil._os_open

        def deny(path, *a, **k):  # EACCES at the open (the tests run as root, where chmod 000 still reads)
            if Path(path).name == "tokenizer.json":
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_open(path, *a, **k)
        monkeypatch.setattr(fsutil, "_os_open", deny)
    cache = tmp_path / "cache"
    rc, _, err = run_main(["build", src_copy, cache])
    assert rc == 2 and "tokenizer.json" in err, err
    assert not (cache / "cache.json").exists() and not (cache / "COMMIT.json").exists()


def hub_snapshot(src: Path, repo: Path) -> Path:
    """A Hugging Face hub cache of `src`: snapshots/<rev>/ holds links into ../../blobs."""
    snap = repo / "snapshots" / "abc123"
    for p in sorted(src.rglob("*")):
        if p.is_file():
            blob = repo / "blobs" / p.name
            blob.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, blob)
            link = snap / p.relative_to(src)
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(blob, link.parent), link)
    return snap


def test_a_snapshot_link_out_of_its_repo_is_refused_and_permissions_are_kept(ckpt_modelopt: Path,
                                                                             tmp_path: Path) -> None:
    snap = hub_snapshot(ckpt_modelopt, tmp_path / "hub" / "models--org--name")
    private = tmp_path / "hub" / "models--org--name" / "blobs" / "secret.json"
    private.write_text('{"mine": true}')
    private.chmod(0o600)
    (snap / "tokenizer_config.json").symlink_to(os.path.relpath(private, snap))  # inside the repo: carried
    outside = tmp_path / "home-secret"
    outside.write_text("key")
    (snap / "tokenizer.json").symlink_to(outside)
    cache = tmp_path / "cache"
    rc, _, err = run_main(["build", snap, cache])
    assert rc == 2 and "tokenizer.json" in err and "link out of" in err, err
    assert not (cache / "model" / "tokenizer.json").exists()
    (snap / "tokenizer.json").unlink()
    rc, _, err = run_main(["build", snap, cache, "--quiet"])
    assert rc == 0, err
    carried = cache / "model" / "tokenizer_config.json"
    assert carried.read_bytes() == private.read_bytes() and stat.S_IMODE(carried.stat().st_mode) == 0o600
    assert stat.S_IMODE((cache / "model" / "config.source.json").stat().st_mode) == \
        stat.S_IMODE((ckpt_modelopt / "config.json").stat().st_mode)
    assert boot_check(cache).state == VERIFIED


# --- config.json and the tensors describe the same layers ----------------------------------------------

@pytest.mark.parametrize("family", ["v4", "v3"])
def test_a_config_one_layer_short_of_the_tensors_is_refused(tmp_path: Path, family: str) -> None:
    from moet_cache import make_checkpoint, small_spec
    from moet_cache.source.checkpoint import MODELOPT
    from moet_cache.source.synthetic import make_v4_checkpoint, small_v4_spec
    src = tmp_path / "src"
    if family == "v4":  # layers.0-2 and the drafter mtp.0: with 2 main layers, layers.2 and mtp.0 are one layer
        make_v4_checkpoint(src, small_v4_spec("hybrid", num_hidden_layers=3))
    else:  # model.layers.0-4, the last the MTP layer: with 3 + 1 layers, model.layers.4 is no layer
        make_checkpoint(src, small_spec(MODELOPT))
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] -= 1
    (src / "config.json").write_text(json.dumps(config))
    for extra in ([], ["--include-mtp"]):
        rc, _, err = run_main(["build", src, tmp_path / "cache", *extra])
        assert rc == 2 and f"num_hidden_layers={config['num_hidden_layers']}" in err and "tensors of layer" in err, err
    assert not (tmp_path / "cache" / "COMMIT.json").exists()


# --- export: OUT apart from the cache, and every interrupt resumable -----------------------------------

def test_export_into_or_around_the_cache_is_refused(lossless: tuple[Path, Path], tmp_path: Path) -> None:
    cache = link_copy(lossless[1], tmp_path / "work" / "cache")
    before = snapshot(tmp_path)
    for out in (cache / "model" / "export", cache, tmp_path / "work"):
        rc, _, err = run_main(["export", cache, out])
        assert rc == 2 and "overlap" in err, err
        assert snapshot(tmp_path) == before


_KILLING_EXPORT = """
import os, signal, sys
from moet_cache.source import exporter
calls, real = [0], exporter.atomic_write_json
def killing(path, obj):  # SIGKILL just before the k-th write of the progress record
    calls[0] += 1
    if calls[0] == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, obj)
exporter.atomic_write_json = killing
exporter.export_checkpoint(sys.argv[1], sys.argv[2])
"""


@pytest.mark.parametrize("kth", [1, 2])
def test_export_killed_before_a_progress_record_resumes(lossless: tuple[Path, Path], tmp_path: Path, kth: int) -> None:
    import subprocess
    import sys

    src, cache = lossless
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-c", _KILLING_EXPORT, str(cache), str(out), str(kth)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == -9, p.stderr
    rc, _, err = run_main(["export", cache, out, "--quiet"])
    assert rc == 0, err
    assert exported_equals_source(out, src) and not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_sigterm_after_the_export_index_stops_and_the_rerun_finishes(lossless: tuple[Path, Path], tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from moet_cache.cache.commit import KILL_ENV
    src, cache = lossless
    out = tmp_path / "out"
    monkeypatch.setenv(KILL_ENV, "export-index-written:TERM")  # the console script signals itself there
    rc, _, err = run_console(["export", cache, out])
    monkeypatch.delenv(KILL_ENV)
    assert rc == 3 and "interrupted by SIGTERM" in err, err
    rc, _, err = run_main(["export", cache, out, "--quiet"])
    assert rc == 0, err
    assert exported_equals_source(out, src) and not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_demo_never_writes_over_a_workdir_of_other_files(tmp_path: Path) -> None:
    for sub in ("checkpoint", "cache"):
        work = tmp_path / sub
        (work / sub).mkdir(parents=True)
        (work / sub / "config.json").write_text('{"mine": true}')
        before = snapshot(work)
        rc, _, err = run_main(["demo", "--workdir", work])
        assert rc == 2 and "not empty" in err and "--workdir" in err, err
        assert snapshot(work) == before


def test_export_gives_model_files_their_permissions_back(src_copy: Path, tmp_path: Path) -> None:
    (src_copy / "tokenizer.json").write_text('{"private": true}')
    (src_copy / "tokenizer.json").chmod(0o600)
    (src_copy / "config.json").chmod(0o640)
    cache, out = tmp_path / "cache", tmp_path / "out"
    build_cache(src_copy, cache, BuildOptions(lossless=True))
    for rel, mode in (("tokenizer.json", 0o600), ("config.source.json", 0o640), ("config.json", 0o640)):
        assert stat.S_IMODE((cache / "model" / rel).stat().st_mode) == mode, rel
    rc, _, err = run_main(["export", cache, out, "--quiet"])
    assert rc == 0, err
    for rel, mode in (("tokenizer.json", 0o600), ("config.json", 0o640)):
        assert stat.S_IMODE((out / rel).stat().st_mode) == mode, rel
        assert (out / rel).read_bytes() == (src_copy / rel).read_bytes()
