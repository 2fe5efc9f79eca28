"""The library's cancel token (moet_cache.cancel): a caller stops a build, retier, verify, export or load
from another thread; the cache never reads complete when it was stopped, and the same call then resumes.
Also the one bounded window of futures (moet_cache.window) the build, tier and verify run through."""

from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from moet_cache import BuildOptions, CancelToken, boot_check, build_cache, export_checkpoint, full_verify, \
    open_cache, retier_cache
from moet_cache.cancel import RESUME_HINT
from moet_cache.errors import Interrupted
from moet_cache.cache.manifest import COMMIT_RECORD, VERIFIED_STATE
from moet_cache.window import bounded_window


class _PauseAtFirstLayer:
    """Progress that, at the first finished layer, tells the test and waits until it has cancelled."""

    def __init__(self, token: CancelToken) -> None:
        self.token, self.at_layer, self.layers = token, threading.Event(), 0

    def start(self, total_bytes: int, what: str) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def layer_done(self, layer: int) -> None:
        self.layers += 1
        self.at_layer.set()
        deadline = time.monotonic() + 30
        while not self.token.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)

    def finish(self) -> None:
        pass


def test_a_library_caller_cancels_a_build_from_another_thread_and_a_rerun_completes(
        ckpt_modelopt: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    token = CancelToken()
    progress = _PauseAtFirstLayer(token)
    errors: list[BaseException] = []

    def build() -> None:
        try:
            build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="30%"), progress, token)
        except BaseException as e:  # noqa: BLE001 - the test inspects what the build thread raised
            errors.append(e)
    t = threading.Thread(target=build)
    t.start()
    assert progress.at_layer.wait(60)
    token.cancel()  # from this thread, while the build is between its first and second layer
    t.join(60)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], Interrupted), errors
    assert errors[0].message == "cancelled" and errors[0].hint == RESUME_HINT
    assert progress.layers == 1  # it stopped at the next unit of work, not at the end
    assert not (cache / COMMIT_RECORD).exists()  # never taken for complete
    assert boot_check(cache).state == "incomplete"
    assert not list(cache.rglob("*.tmp-*"))  # the stopped layer's temp files went with it
    r = build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="30%"))  # a new call: no token
    assert not r.already_complete and r.layers_reused == (1,) and r.layers_built == (2, 3)
    assert full_verify(cache).ok


def test_a_cancelled_retier_restores_the_previous_commit(lossless: tuple[Path, Path], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure inside the window (here a cancel from another thread, half-way through the pack): the
    pack's temp file goes, the previous commit comes back (the boot check proves nothing changed)."""
    from moet_cache.build import retier as R
    cache = Path(shutil.copytree(lossless[1], tmp_path / "cache"))
    assert full_verify(cache).ok
    tier = (cache / "delta/tier.json").read_bytes()
    token = CancelToken()
    real = R.file_deltas

    def deltas_then_cancel(root: Path, layers: dict) -> object:
        read = real(root, layers)

        def gen(layer: int, which: str, experts: tuple[int, ...]):  # type: ignore[no-untyped-def]
            for i, chunk in enumerate(read(layer, which, experts)):
                if i == 1:
                    t = threading.Thread(target=token.cancel)
                    t.start()
                    t.join()
                yield chunk
        return gen
    monkeypatch.setattr(R, "file_deltas", deltas_then_cancel)
    with pytest.raises(Interrupted, match="cancelled"):
        retier_cache(cache, "10%", cancel=token)
    assert (cache / COMMIT_RECORD).exists() and boot_check(cache).state == "verified"
    assert (cache / "delta/tier.json").read_bytes() == tier and not list(cache.rglob("*.tmp-*"))
    monkeypatch.undo()
    r = retier_cache(cache, "10%")
    assert r.tier_bytes < json.loads(tier)["budget_bytes"] and full_verify(cache).ok


def test_verify_export_and_load_stop_at_a_cancelled_token(lossless: tuple[Path, Path], tmp_path: Path) -> None:
    cache = Path(shutil.copytree(lossless[1], tmp_path / "cache"))
    assert full_verify(cache).ok  # a copy: verified again, so the boot gate of load passes
    token = CancelToken()
    token.cancel("stop", "hint")
    state = (cache / VERIFIED_STATE).read_bytes()
    with pytest.raises(Interrupted, match="stop"):
        full_verify(cache, cancel=token)
    assert (cache / VERIFIED_STATE).read_bytes() == state  # nothing recorded
    with pytest.raises(Interrupted):
        export_checkpoint(cache, tmp_path / "out", cancel=token)
    assert not list((tmp_path / "out").glob("*.safetensors"))
    c = open_cache(cache, check_source=False)
    with pytest.raises(Interrupted):
        next(iter(c.load(cancel=token)))
    with pytest.raises(Interrupted):
        next(iter(c.load_dense(cancel=token)))
    with pytest.raises(Interrupted):
        build_cache(lossless[0], tmp_path / "new", cancel=token)
    assert not (tmp_path / "new" / COMMIT_RECORD).exists()


def test_the_first_reason_wins() -> None:
    token = CancelToken()
    assert not token.cancelled
    token.check()
    token.cancel("interrupted by SIGINT", "h")
    token.cancel("interrupted by SIGTERM")
    with pytest.raises(Interrupted, match="SIGINT") as e:
        token.check()
    assert e.value.hint == "h"


def test_bounded_window_keeps_order_and_bound() -> None:
    live, most = [0], [0]
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        time.sleep(0.001 * (i % 3))
        return i * i

    with ThreadPoolExecutor(max_workers=8) as pool:
        def submit(i: int):  # type: ignore[no-untyped-def]
            return pool.submit(work, i)
        got = []
        for r in bounded_window(submit, range(40), 3):
            got.append(r)
            with lock:
                live[0] -= 1
    assert got == [i * i for i in range(40)] and most[0] <= 3
    token = CancelToken()
    out = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        with pytest.raises(Interrupted):
            for r in bounded_window(lambda i: pool.submit(int, i), range(100), 4, token):
                out.append(r)
                if r == 5:
                    token.cancel()
    assert out == list(range(6))
    with pytest.raises(ValueError):
        list(bounded_window(lambda i: pool.submit(int, i), range(3), 0))
