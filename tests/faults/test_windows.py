"""Kills aimed at every window between "uncommit" and "commit" of build, retier and export (the child SIGKILLs
itself there: MOET_CACHE_TEST_KILL_AT), real SIGTERM/SIGINT inside retier's window, export's resume, and
export's check of every byte it reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moet_cache import boot_check, full_verify
from moet_cache.cache.commit import KILL_ENV

from .campaign import exported_equals_source, leftover_temps, link_copy, private, run_main, \
    window_campaign


def test_kills_at_every_commit_window(work: Path) -> None:
    log: list[str] = []
    c = window_campaign(work, log.append)
    assert c["cases"] == 21, c
    assert c["killed_in_window"] == c["cases"], log  # every window was reached and killed
    assert c["wrongly_complete"] == 0, log
    assert c["clean_resumes"] == c["cases"] and c["failed_resumes"] == 0, log
    assert c["leftover_temps"] == 0 and c["export_inexact"] == 0, log


def _console(argv: list[object], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moet_cache.cli.app", *map(str, argv)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


# Two real console processes a case (seconds each): one case where the previous commit comes back, one
# where the cache is left uncommitted and resumed; the window campaign kills at every window.
@pytest.mark.parametrize("window,sig", [("uncommitted", "INT"), ("manifest-written", "TERM")])
def test_a_signal_inside_retiers_window_restores_or_resumes(lossless: tuple[Path, Path], work: Path,
                                                            window: str, sig: str) -> None:
    """Ctrl-C or SIGTERM (real signals, sent by the process to itself inside the window): exit 3; the
    previous commit is back where nothing changed yet, else the cache is incomplete; the same command
    then finishes, and --full passes."""
    _, ref = lossless
    cache = link_copy(ref, work / "cache")
    argv = ["retier", cache, "--delta-budget", "10%"]
    r = _console(argv, {KILL_ENV: f"{window}:{sig}"})
    assert r.returncode == 3 and "interrupted by SIG" + sig in r.stderr, r.stderr
    state = boot_check(cache).state
    assert state == ("verified" if window == "uncommitted" else "incomplete"), state
    r = _console(argv, {})
    assert r.returncode == 0, r.stderr
    assert full_verify(cache).ok and leftover_temps(cache) == []
    assert json.loads((cache / "delta/tier.json").read_text())["budget_bytes"] < \
        json.loads((ref / "delta/tier.json").read_text())["budget_bytes"]


def test_export_resumes_after_sigkill_and_leaves_no_temp_shard(lossless: tuple[Path, Path], work: Path) -> None:
    src, cache = lossless
    out = work / "out"
    r = _console(["export", cache, out], {KILL_ENV: "export-shard-temp"})
    assert r.returncode == -9
    assert any(".tmp-" in p.name for p in out.iterdir())  # the kill left its temp shard
    r = _console(["export", cache, out], {})
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    assert exported_equals_source(out, src)
    rc, _, err = run_main(["export", cache, out])  # a finished export is not resumed over
    assert rc == 2 and "not empty" in err


def test_export_of_a_flipped_plane_bit_is_exit_1_and_nothing_exported_as_good(lossless: tuple[Path, Path],
                                                                               work: Path) -> None:
    src, ref = lossless
    cache = link_copy(ref, work / "cache")
    plane = cache / "layers/layer-002.delta.safetensors"
    data = bytearray(private(plane))
    data[-7] ^= 0x10  # a bit of the last tensor's bytes (a source scale of the last expert)
    st = plane.stat()
    plane.write_bytes(bytes(data))
    os.utime(plane, ns=(st.st_atime_ns, st.st_mtime_ns))
    out = work / "out"
    rc, _, err = run_main(["export", cache, out])
    assert rc == 1 and "does not match its digest" in err, err
    shard = next(src.glob("*.safetensors")).name
    assert not (out / shard).exists()  # the shard that holds the damaged tensor was never renamed into place
    assert not exported_equals_source(out, src)
    shutil.rmtree(out)
