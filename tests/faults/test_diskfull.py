"""Disk full: exit 3 with the bytes needed, and the previous verified cache still served.

The rule (docs/GUARANTEES.md): a rebuild that fails before it has replaced any file of the committed
cache puts the old commit record back (the boot check proves nothing changed); once it has replaced
one, the cache stays uncommitted (incomplete) until a build finishes. Never "complete" in between.
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from moet_cache import BuildOptions, boot_check, build_cache, full_verify
from moet_cache.verify import read_committed_manifest

from .campaign import make_tiny, run_main


class _Enospc:
    """Fails writes with ENOSPC once `limit` bytes have gone through the writer's seam (pwrite/fallocate)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
        self.left = limit
        real_pwrite, real_falloc = os.pwrite, os.posix_fallocate

        def pwrite(fd: int, data: bytes, pos: int) -> int:
            self._take(len(memoryview(data).cast("B")))
            return real_pwrite(fd, data, pos)

        def falloc(fd: int, offset: int, length: int) -> None:
            self._take(length)
            real_falloc(fd, offset, length)

        monkeypatch.setattr(os, "pwrite", pwrite)
        monkeypatch.setattr(os, "posix_fallocate", falloc)

    def _take(self, n: int) -> None:
        if n > self.left:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.left -= n


def _budget_of(cache: Path) -> int:
    m = read_committed_manifest(cache)
    assert m is not None
    return m.build.delta_budget_bytes


@pytest.mark.parametrize("seed", range(6))
def test_enospc_rebuild_keeps_previous_cache(work: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    src = make_tiny(work / "src", seed=seed)
    cache = work / "cache"
    build_cache(src, cache, BuildOptions(delta_budget="20%"))
    old = _budget_of(cache)
    rng = random.Random(seed)
    # A lossless rebuild rewrites every layer: fail it at a random byte of its writes.
    fault = _Enospc(monkeypatch, rng.choice([0, rng.randrange(1, 400_000)]))
    rc, out, err = run_main(["build", src, cache, "--lossless", "--delta-budget", "50%", "--quiet"])
    monkeypatch.undo()
    assert rc == 3, err
    assert re.search(r"\d+ (more )?bytes", err), err
    rep = boot_check(cache)
    assert rep.state in ("verified", "incomplete"), rep
    if fault.left == 0 or rep.state == "verified":
        pass
    if rep.state == "verified":  # the previous cache, intact and served
        assert _budget_of(cache) == old and full_verify(cache).ok
    build_cache(src, cache, BuildOptions(delta_budget="50%", lossless=True))
    assert full_verify(cache).ok


def test_enospc_before_any_write_keeps_previous_cache(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_tiny(work / "src")
    cache = work / "cache"
    build_cache(src, cache, BuildOptions(delta_budget="20%"))
    old = _budget_of(cache)
    _Enospc(monkeypatch, 0)
    rc, out, err = run_main(["build", src, cache, "--delta-budget", "60%", "--quiet"])
    monkeypatch.undo()
    assert rc == 3 and "bytes" in err, err
    rep = boot_check(cache)
    assert rep.state == "verified" and _budget_of(cache) == old
    assert full_verify(cache).ok


def test_enospc_fresh_build_is_incomplete_then_resumes(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_tiny(work / "src")
    cache = work / "cache"
    _Enospc(monkeypatch, 200_000)
    rc, out, err = run_main(["build", src, cache, "--quiet"])
    monkeypatch.undo()
    assert rc == 3 and "bytes" in err, err
    assert boot_check(cache).state == "incomplete"
    build_cache(src, cache)
    assert full_verify(cache).ok


def _mount_tmpfs(path: Path, size: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def test_real_small_filesystem(tmp_path: Path) -> None:
    """A real tmpfs just big enough for a tiered cache: a --lossless rebuild hits ENOSPC for real."""
    src = make_tiny(tmp_path / "src")
    probe = tmp_path / "probe"
    build_cache(src, probe, BuildOptions(delta_budget="20%"))
    need = sum(p.stat().st_size for p in probe.rglob("*") if p.is_file())
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, need + need // 3 + (64 << 10)):
        pytest.skip("cannot mount a tmpfs here (not root, or no mount permission)")
    try:
        cache = mnt / "cache"
        build_cache(src, cache, BuildOptions(delta_budget="20%"))
        assert full_verify(cache).ok
        old = _budget_of(cache)
        rc, out, err = run_main(["build", src, cache, "--lossless", "--quiet"])
        assert rc == 3, (rc, err)
        assert re.search(r"\d+ (more )?bytes", err), err
        rep = boot_check(cache)
        assert rep.state in ("verified", "incomplete")
        if rep.state == "verified":
            assert _budget_of(cache) == old and full_verify(cache).ok
        # Room again (the folder moves to a big disk): the build resumes and finishes.
        big = tmp_path / "big"
        shutil.copytree(cache, big, symlinks=True)
        build_cache(src, big, BuildOptions(lossless=True))
        assert full_verify(big).ok
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=20)
