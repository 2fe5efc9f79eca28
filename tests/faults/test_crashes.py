"""Real SIGKILLs of build and verify --full processes; a torn commit-record write; the cache must never lie."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from moet_cache import BuildOptions, boot_check, build_cache, full_verify
from moet_cache.cache.manifest import COMMIT_RECORD

from .campaign import crash_campaign, leftover_temps, make_tiny, run_console, run_main

CI_KILLS = 20  # the long form (benchmarks/fault_campaign.py) runs 200 and more


@pytest.mark.slow  # ~11 s: 20 SIGKILLed builds
def test_sigkill_build_campaign(work: Path) -> None:
    log: list[str] = []
    c = crash_campaign(work, CI_KILLS, seed=7, verify_kills=6, log=log.append)
    assert c["kills"] + c["finished"] == CI_KILLS
    assert c["kills"] >= CI_KILLS // 2, c  # most kills must land while the process runs
    assert c["killed_mid_build"] >= CI_KILLS // 4, c  # and many leave an unfinished cache behind
    assert c["wrongly_complete"] == 0, log
    assert c["clean_resumes"] == CI_KILLS and c["failed_resumes"] == 0, log
    assert c["unexpected_exit"] == 0, c
    assert c["leftover_temps"] == 0, log
    assert c["verify_kills"] + c["verify_finished"] == 6
    assert c["verify_kill_broke_cache"] == 0, log


@pytest.mark.slow  # ~13 s: real console scripts
def test_sigkill_real_console_script(work: Path) -> None:
    """The installed `moet-cache build`, killed once it holds the lock, then resumed by the console script."""
    src = make_tiny(work / "src", seed=3)
    cache = work / "cache"
    p = subprocess.Popen([*_console(), "build", str(src), str(cache), "--quiet"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (cache / ".lock").exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(random.Random(3).uniform(0.0, 0.15))
    p.send_signal(signal.SIGKILL)
    rc = p.wait()
    rep = boot_check(cache)
    if rc == -signal.SIGKILL:
        assert not rep.complete or full_verify(cache).ok
    rc, out, err = run_console(["build", src, cache, "--quiet"])
    assert rc == 0, err
    assert full_verify(cache).ok


def _console() -> list[str]:
    import shutil
    import sys
    exe = shutil.which("moet-cache") or str(Path(sys.executable).with_name("moet-cache"))
    return [exe]


def test_torn_commit_write_is_incomplete_then_resumes(work: Path) -> None:
    """A kill inside atomic_write of COMMIT.json leaves a temp file and no commit record: never complete."""
    src = make_tiny(work / "src")
    cache = work / "cache"
    build_cache(src, cache, BuildOptions(delta_budget="30%"))
    data = (cache / COMMIT_RECORD).read_bytes()
    (cache / COMMIT_RECORD).unlink()
    torn = cache / f".{COMMIT_RECORD}.tmp-99999"
    torn.write_bytes(data[: len(data) // 2])
    rep = boot_check(cache)
    assert rep.state == "incomplete" and not rep.complete
    assert not full_verify(cache).ok
    assert run_main(["verify", cache])[0] == 1
    build_cache(src, cache, BuildOptions(delta_budget="30%"))
    assert full_verify(cache).ok
    assert leftover_temps(cache) == []


def test_torn_commit_record_itself_is_never_complete(work: Path) -> None:
    """Had a filesystem kept a half-written COMMIT.json (no fsync before rename), it must read as corrupt."""
    src = make_tiny(work / "src")
    cache = work / "cache"
    build_cache(src, cache, BuildOptions(delta_budget="30%"))
    data = (cache / COMMIT_RECORD).read_bytes()
    for cut in range(0, len(data), max(1, len(data) // 25)):
        (cache / COMMIT_RECORD).write_bytes(data[:cut])
        rep = boot_check(cache)
        assert not rep.complete, cut
    (cache / COMMIT_RECORD).write_bytes(data)
    os.utime(cache / COMMIT_RECORD)
    assert boot_check(cache).complete
