"""Two builds on one cache, a boot check during a build, two loaders at once."""

from __future__ import annotations

import fcntl
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from moet_cache import BuildOptions, boot_check, build_cache, full_verify
from moet_cache.fsutil import CacheLock

from .campaign import ForkServer, _commit_digest, make_tiny, run_console, run_main


def test_second_build_refuses_with_exit_3(work: Path) -> None:
    src = make_tiny(work / "src")
    cache = work / "cache"
    cache.mkdir()
    with CacheLock(cache):  # a real flock, held as a running build holds it
        rc, out, err = run_console(["build", src, cache])
        assert rc == 3 and "another process" in err, err
        assert boot_check(cache).state == "incomplete"
        assert "a build is running" in boot_check(cache).problems[0].detail


def test_second_build_waits_with_wait(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build meets the held lock, blocks in flock itself, and goes on only once the lock is released."""
    src = make_tiny(work / "src")
    cache = work / "cache"
    cache.mkdir()
    result: list[int] = []
    real_flock = fcntl.flock
    entered = threading.Event()
    events: list[tuple[str, float]] = []

    def flock(fd: int, op: int) -> None:  # records the build thread's blocking lock calls
        mine = threading.current_thread() is t and op & fcntl.LOCK_EX and not op & fcntl.LOCK_NB
        if mine:
            events.append(("enter", time.monotonic()))
            entered.set()
        real_flock(fd, op)
        if mine:
            events.append(("return", time.monotonic()))
    lock = CacheLock(cache).__enter__()
    monkeypatch.setattr(fcntl, "flock", flock)
    t = threading.Thread(target=lambda: result.append(run_main(["build", src, cache, "--wait", "--quiet"])[0]))
    t.start()
    assert entered.wait(60), "the build never asked for the lock"
    time.sleep(0.5)
    assert t.is_alive() and not result  # blocked on the lock
    assert [e for e, _ in events] == ["enter"], events  # still inside flock
    released = time.monotonic()
    lock.__exit__(None, None, None)
    t.join(60)
    assert result == [0]
    assert [e for e, _ in events] == ["enter", "return"], events
    assert events[0][1] < released <= events[1][1]  # it waited on our lock, not merely ran slowly
    assert full_verify(cache).ok


def test_boot_check_during_build_never_says_complete(work: Path) -> None:
    """Poll the boot check as fast as it runs while a real process builds; only the final commit may read complete."""
    src = make_tiny(work / "src", num_hidden_layers=5)
    total = 0
    with ForkServer(warm=["build", src, work / "warm", "--quiet"]) as fs:
        for i in range(2):
            observed: list[tuple[str, str | None]] = []
            cache = work / f"cache{i}"
            fs.start(["build", src, cache, "--quiet"])
            done = threading.Event()
            res: list[dict] = []

            def wait() -> None:
                res.append(fs.finish())
                done.set()
            threading.Thread(target=wait).start()
            while not done.is_set():
                if cache.is_dir():
                    rep = boot_check(cache)
                    observed.append((rep.state, _commit_digest(cache) if rep.complete else None))
            assert res[0]["rc"] == 0
            final = _commit_digest(cache)
            assert all(d == final for s, d in observed if s in ("verified", "unverified")), observed
            total += len(observed)
    assert total > 10  # the check really ran during the builds


def test_two_loaders_at_once(built: Path) -> None:
    loader = pytest.importorskip("moet_cache.load")
    out: list[dict[int, dict[str, np.ndarray]]] = [{}, {}]
    errors: list[BaseException] = []

    def load(k: int) -> None:
        try:
            cache = loader.open_cache(built)
            for layer in cache.load(device="cpu", workers=2):
                out[k][layer.index] = {n: t.contiguous().view(-1).view(torch.uint8).numpy().copy()
                                       for n, t in layer.tensors.items()}
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=load, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert out[0].keys() == out[1].keys() and out[0]
    for layer in out[0]:
        assert out[0][layer].keys() == out[1][layer].keys()
        for name in out[0][layer]:
            assert np.array_equal(out[0][layer][name], out[1][layer][name])
    assert full_verify(built).ok


@pytest.fixture
def built(work: Path) -> Path:
    src = make_tiny(work / "src")
    cache = work / "cache"
    build_cache(src, cache, BuildOptions(delta_budget="30%"))
    return cache
