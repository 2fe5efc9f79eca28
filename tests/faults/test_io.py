"""Read errors injected at the library's one read seam (fsutil._os_open / fsutil._os_preadv), a file
truncated under a hash in a real process, real FIFOs in place of state files, the lock, cache and source
files, SIGTERM, temp files that never follow links, and a tensor duplicated across source shards."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from moet_cache import boot_check, full_verify
from moet_cache import fsutil
from moet_cache.load import open_cache
from moet_cache.cache.manifest import VERIFIED_STATE

from .campaign import link_copy, make_tiny, private, run_main

BASE = "layers/layer-001.base.safetensors"


def _inject(monkeypatch: pytest.MonkeyPatch, name: str, err: int, at: str) -> list[str]:
    """Make the seam fail with `err` for files whose path ends with `name`: at "open" or at "read"."""
    bad: set[int] = set()
    hits: list[str] = []
    real_open, real_preadv = fsutil._os_open, fsutil._os_preadv

    def fake_open(path: Any, flags: int, mode: int = 0o777) -> int:
        if str(path).endswith(name) and at == "open":
            hits.append(str(path))
            raise PermissionError(err, os.strerror(err), str(path))
        fd = real_open(path, flags, mode)
        (bad.add if str(path).endswith(name) else bad.discard)(fd)
        return fd

    def fake_preadv(fd: int, bufs: list, offset: int) -> int:
        if fd in bad:
            hits.append(name)
            raise OSError(err, os.strerror(err))
        return real_preadv(fd, bufs, offset)
    monkeypatch.setattr(fsutil, "_os_open", fake_open)
    monkeypatch.setattr(fsutil, "_os_preadv", fake_preadv)
    return hits


@pytest.mark.parametrize("err,at", [(errno.EIO, "read"), (errno.EACCES, "open")])
def test_a_read_error_is_never_verified(lossless: tuple[Path, Path], work: Path, monkeypatch: pytest.MonkeyPatch,
                                        err: int, at: str) -> None:
    _, ref = lossless
    cache = link_copy(ref, work / "cache")
    private(cache / BASE)  # its own inode (a hard link shares its times with the reference cache)
    os.utime(cache / BASE)  # touched: the boot check wants a --full before it trusts the file again
    assert boot_check(cache).state == "unverified"
    hits = _inject(monkeypatch, BASE, err, at)
    rep = full_verify(cache)
    assert hits, "the injection was not reached: the hash does not go through the seam"
    assert rep.state == "corrupt" and not rep.ok
    assert [p.kind for p in rep.problems] == ["unreadable"] and rep.problems[0].path == BASE
    assert os.strerror(err) in rep.problems[0].detail
    rc, out, _ = run_main(["verify", cache, "--full", "--json"])
    assert rc == 1 and json.loads(out)["problems"][0]["kind"] == "unreadable"
    monkeypatch.undo()
    state = json.loads((cache / VERIFIED_STATE).read_bytes())
    assert BASE not in state["files"] and BASE in state["damaged"]  # never recorded as verified; remembered
    boot = boot_check(cache)
    assert boot.state == "corrupt" and [p.path for p in boot.problems if p.kind == "digest"] == [BASE]
    assert full_verify(cache).ok  # the disk "recovered": now it verifies, and the boot check agrees
    assert boot_check(cache).ok


_TRUNCATE_UNDER_HASH = r"""
import os, sys
from moet_cache import fsutil, full_verify
target = sys.argv[2]
real = fsutil._os_preadv
state = {"done": False}
def preadv(fd, bufs, offset):
    if not state["done"] and os.path.realpath(f"/proc/self/fd/{fd}") == target:
        state["done"] = True
        os.truncate(target, 4096)  # opened and sized, then cut: a map of it would die of SIGBUS here
    return real(fd, bufs, offset)
fsutil._os_preadv = preadv
rep = full_verify(sys.argv[1], workers=1)
print(rep.state, [p.kind for p in rep.problems])
sys.exit(0 if rep.ok else 1)
"""


def test_a_file_truncated_while_hashed_is_corrupt_not_a_dead_process(lossless: tuple[Path, Path], work: Path) -> None:
    _, ref = lossless
    cache = link_copy(ref, work / "cache")
    target = cache / "dense" / next(p.name for p in (ref / "dense").glob("*.safetensors"))
    data = target.read_bytes()
    target.unlink()
    target.write_bytes(data)  # its own inode: the truncation must not reach the reference cache
    r = subprocess.run([sys.executable, "-c", _TRUNCATE_UNDER_HASH, str(cache), str(target.resolve())],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)  # not -SIGBUS
    assert r.stdout.startswith("corrupt"), r.stdout


def _console(*args: Any) -> list[str]:
    return [sys.executable, "-m", "moet_cache.cli.app", *map(str, args)]


def _run_bounded(argv: list[str], seconds: float = 60) -> subprocess.CompletedProcess:
    """A real process that must end by itself; on a hang it gets SIGTERM, then SIGKILL, and the test fails."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        try:
            p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
        pytest.fail(f"{argv[3:]} hung (a blocking open?)")
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


@pytest.mark.parametrize("what", ["state", "lock", "cache-file", "manifest"])
def test_a_fifo_in_the_cache_never_blocks(lossless: tuple[Path, Path], work: Path, what: str) -> None:
    _, ref = lossless
    cache = link_copy(ref, work / "cache")
    rel = {"state": VERIFIED_STATE, "lock": ".lock", "cache-file": BASE, "manifest": "layers/layer-001.json"}[what]
    (cache / rel).unlink()
    os.mkfifo(cache / rel)
    # a FIFO state file: unverified, and --full re-hashes and replaces it; a FIFO lock: no build holds it
    want = {"state": (1, 0), "lock": (0, 0), "cache-file": (1, 1), "manifest": (1, 1)}[what]
    for args, code in ((["verify", cache], want[0]), (["verify", cache, "--full"], want[1])):
        r = _run_bounded(_console(*args))
        assert r.returncode == code, (args, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr
    if what == "lock":
        r = _run_bounded(_console("retier", cache, "--delta-budget", "10%"))
        assert r.returncode == 2 and "not a plain file" in r.stderr, r.stderr
    if what in ("cache-file", "manifest"):
        with pytest.raises(Exception) as e:
            open_cache(cache)
        assert "FIFO" not in type(e.value).__name__


@pytest.mark.parametrize("what", ["config.json", "shard"])
def test_a_fifo_in_the_source_never_blocks_verify_against(lossless: tuple[Path, Path], work: Path, what: str) -> None:
    src, ref = lossless
    import shutil
    copy = work / "src"
    shutil.copytree(src, copy)
    name = "config.json" if what == "config.json" else next(p.name for p in copy.glob("*.safetensors"))
    (copy / name).unlink()
    os.mkfifo(copy / name)
    r = _run_bounded(_console("verify", ref, "--against", copy))
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr


def test_sigterm_stops_verify_against(lossless: tuple[Path, Path], work: Path) -> None:
    """SIGTERM a second after the process starts: it ends (exit 3, or 0 if it finished first), never hangs."""
    src, ref = lossless
    p = subprocess.Popen(_console("verify", ref, "--against", src), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("verify --against ignored SIGTERM")
    # 3: stopped by the gate; 0: it finished first; -SIGTERM: the signal came while Python was still
    # importing, before the console script installed its handler (a loaded machine): it ended all the same
    assert p.returncode in (0, 3, -signal.SIGTERM), err


def test_temp_files_are_exclusive_unpredictable_and_never_follow_links(work: Path) -> None:
    outside = work / "outside.bin"
    outside.write_bytes(b"keep me")
    target = work / "cache.json"
    old_style = work / f".cache.json.tmp-{os.getpid()}"  # the name every earlier version used
    os.symlink(outside, old_style)
    names = set()
    for i in range(5):
        fd, tmp = fsutil.create_temp_for(target)
        os.close(fd)
        names.add(tmp.name)
        assert tmp.name.startswith(".cache.json.tmp-") and str(os.getpid()) not in tmp.name[len(".cache.json.tmp-"):]
        tmp.unlink()
    assert len(names) == 5
    fsutil.atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new" and outside.read_bytes() == b"keep me" and old_style.is_symlink()
    from moet_cache.stwriter import SafetensorsWriter, TensorSpec
    import numpy as np
    with SafetensorsWriter(work / "x.safetensors", [TensorSpec("t", "U8", (4,))]) as w:
        assert not w._tmp.name.endswith(str(os.getpid()))
        w.write("t", np.arange(4, dtype=np.uint8))
        w.commit()
    assert outside.read_bytes() == b"keep me"


def test_a_tensor_in_two_shards_is_reported_as_duplicated(work: Path) -> None:
    src = make_tiny(work / "src", seed=4)
    shard = next(src.glob("*.safetensors"))
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    import shutil
    shutil.copy(shard, src / "model-00002-of-00002.safetensors")
    some = next(iter(idx["weight_map"]))
    idx["weight_map"][some] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    rc, _, err = run_main(["build", src, work / "cache"])
    assert rc == 2 and "two shards" in err and "does not hold" not in err, err
