"""The command line, through typer's CliRunner and through real processes of the console script."""

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moet_cache import make_checkpoint, small_spec
from moet_cache.cli.app import app, main
from moet_cache.fsutil import CacheLock
from moet_cache.verify import boot_check, full_verify

runner = CliRunner()
EXE = [sys.executable, "-m", "moet_cache.cli.app"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*EXE, *args], capture_output=True, text=True, timeout=timeout)


def test_console_script_is_installed() -> None:
    exe = Path(sys.executable).with_name("moet-cache")  # the venv's script, whether or not it is on PATH
    assert exe.is_file(), f"no console script at {exe}"
    r = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("moet-cache ")


def test_demo_json_through_a_process(tmp_path: Path) -> None:
    r = run("demo", "--json", "--workdir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["boot_check"] == doc["verify_full"] == doc["verify_against"] == "verified"
    assert doc["build"]["tier_experts"] > 0 and len(doc["inspect"]["layers"]) == 3
    plan = doc["plan"]  # planned from the cache's exact bytes on the default card
    assert plan["exact"] and plan["fits"] and plan["gpu"]["name"] == "rtx-pro-6000"
    # the planes' tensor bytes; inspect counts the base files, their safetensors headers too
    assert 0.99 * doc["inspect"]["base_bytes"] < plan["terms_bytes"]["base_planes"] <= doc["inspect"]["base_bytes"]
    assert (tmp_path / "cache/COMMIT.json").exists()


def test_build_verify_inspect_export_with_cli_runner(ckpt_ct: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    r = runner.invoke(app, ["build", str(ckpt_ct), str(cache), "--lossless", "--delta-budget", "1MiB", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["layers"] == [1, 2, 3] and doc["budget_bytes"] == 1 << 20
    r = runner.invoke(app, ["verify", str(cache), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["state"] == "verified"
    r = runner.invoke(app, ["verify", str(cache), "--full", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["bytes_hashed"] > 0
    r = runner.invoke(app, ["verify", str(cache), "--against", str(ckpt_ct)])
    assert r.exit_code == 0 and "complete and verified" in r.stdout
    r = runner.invoke(app, ["inspect", str(cache), "--json"])
    info = json.loads(r.stdout)
    assert r.exit_code == 0 and info["source_layout"] == "compressed-tensors" and info["total_experts"] == 48
    r = runner.invoke(app, ["inspect", str(cache)])
    assert r.exit_code == 0 and "rel. err" in r.stdout and "42/48 experts" in r.stdout
    r = runner.invoke(app, ["retier", str(cache), "--delta-budget", "0%", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["tier_experts"] == 0
    r = runner.invoke(app, ["export", str(cache), str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["tensors"] > 800


def test_corrupt_cache_exits_1_with_the_place(tmp_path: Path, ckpt_modelopt: Path) -> None:
    cache = tmp_path / "cache"
    assert run("build", str(ckpt_modelopt), str(cache), "-q").returncode == 0
    p = cache / "layers/layer-003.base.safetensors"
    data = bytearray(p.read_bytes())
    data[len(data) // 3] ^= 1
    p.write_bytes(bytes(data))
    r = run("verify", str(cache), "--full")
    assert r.returncode == 1
    assert "layers/layer-003.base.safetensors (layer 3, tensor w13_base)" in r.stdout
    r = run("verify", str(cache))  # the failed --full is remembered: corrupt, not merely changed
    assert r.returncode == 1 and "corrupt" in r.stdout and "verify --full" in r.stdout
    assert "layers/layer-003.base.safetensors" in r.stdout and "build" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["build", "/nonexistent/src", "{tmp}/c"], "/nonexistent/src is not a folder"),
    (["verify", "/nonexistent/cache"], "/nonexistent/cache: no such folder"),
    (["build", "{src}", "{tmp}/c", "--delta-budget", "lots"], "cannot read delta budget 'lots'"),
    (["build", "{src}", "{tmp}/c", "--layers", "x-y"], "cannot read the layer selection"),
    (["inspect", "{src}"], "is a checkpoint, not a cache"),
])
def test_bad_input_exits_2_with_one_line(tmp_path: Path, ckpt_modelopt: Path, args: list, needle: str) -> None:
    argv = [a.format(tmp=tmp_path, src=ckpt_modelopt) for a in args]
    r = run(*argv)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and needle in lines[0]
    assert "Traceback" not in r.stderr


def test_usage_error_exits_2(capsys: pytest.CaptureFixture) -> None:
    assert main(["build"]) == 2
    assert main(["verify", "x", "--workers", "0"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_debug_shows_the_traceback(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert main(["verify", str(tmp_path / "none"), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().endswith("no such folder (check the path; `moet-cache build SRC CACHE` creates a cache)")


def test_lock_held_exits_3(tmp_path: Path, ckpt_modelopt: Path) -> None:
    cache = tmp_path / "cache"
    with CacheLock(cache):
        r = run("build", str(ckpt_modelopt), str(cache))
    assert r.returncode == 3 and "another process is building" in r.stderr and "--wait" in r.stderr


def test_sigkill_during_build_then_resume(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", small_spec(n_routed_experts=32, num_hidden_layers=4, fast_codes=True))
    cache = tmp_path / "cache"
    rng = random.Random(1234)
    t0 = time.perf_counter()
    assert run("build", str(src), str(tmp_path / "timing"), "-q").returncode == 0
    duration = time.perf_counter() - t0
    kills = 0
    for _ in range(3):
        p = subprocess.Popen([*EXE, "build", str(src), str(cache), "-q"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.2, max(0.3, duration * 0.9)))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait()
        # a kill during the interpreter start comes before the cache folder exists
        if p.returncode != 0 and cache.is_dir() and boot_check(cache).complete:
            assert full_verify(cache).ok  # killed after the commit point: complete must mean complete
    assert kills >= 1
    assert run("build", str(src), str(cache), "-q").returncode == 0
    r = run("verify", str(cache), "--full", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "verified"
    assert not any(p.name.startswith(".") and ".tmp-" in p.name for p in cache.rglob("*"))
    assert run("verify", str(cache), "--against", str(src)).returncode == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_exits_3(tmp_path: Path, sig: signal.Signals) -> None:
    src = make_checkpoint(tmp_path / "src", small_spec(n_routed_experts=32, num_hidden_layers=8, hidden_size=512,
                                                       fast_codes=True))
    p = subprocess.Popen([*EXE, "build", str(src), str(tmp_path / "cache")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list((tmp_path / "cache").glob("dense/*.json")) and time.monotonic() < deadline:
        time.sleep(0.05)  # interrupt once the build is under way, not while Python starts
    assert p.poll() is None, "the build finished before the interrupt"
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 3 and "interrupted" in err and "Traceback" not in err
    if boot_check(tmp_path / "cache").complete:  # on a loaded machine the signal can land after the commit point
        assert full_verify(tmp_path / "cache").ok


@pytest.mark.parametrize("bad_path", ["../../etc/passwd", "/etc/passwd"])
def test_manifest_path_leaving_the_cache_is_refused(tmp_path: Path, ckpt_modelopt: Path, bad_path: str) -> None:
    import xxhash
    cache = tmp_path / "cache"
    assert main(["build", str(ckpt_modelopt), str(cache), "-q"]) == 0
    doc = json.loads((cache / "cache.json").read_text())
    doc["files"][0]["path"] = bad_path
    data = json.dumps(doc).encode()
    (cache / "cache.json").write_bytes(data)
    commit = json.loads((cache / "COMMIT.json").read_text())
    commit.update(manifest_size=len(data), manifest_xxh3=xxhash.xxh3_128_hexdigest(data))
    (cache / "COMMIT.json").write_text(json.dumps(commit))  # a consistent but hostile manifest
    r = run("verify", str(cache), "--full")
    assert r.returncode == 1 and "absolute or leaves the cache" in r.stdout and "Traceback" not in r.stderr
    r = run("inspect", str(cache))  # the boot check first: a hostile manifest is a corrupt cache
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "absolute or leaves the cache" in r.stderr


def test_interrupt_gate_holds_a_signal_until_the_next_progress_report() -> None:
    from moet_cache.cli._signals import InterruptGate, InterruptibleProgress
    from moet_cache.errors import Interrupted
    from moet_cache.progress import NullProgress
    gate = InterruptGate()
    progress = InterruptibleProgress(NullProgress(), gate)
    with pytest.raises(Interrupted):  # no long work under way: the handler raises at once
        gate._on_signal(signal.SIGTERM, None)
    progress.start(10, "build")
    gate._on_signal(signal.SIGINT, None)  # held: raising inside torch or a weakref callback loses it
    assert gate.pending == "SIGINT"
    with pytest.raises(Interrupted, match="SIGINT"):
        progress.advance(1)
    assert not gate.deferring


def test_a_held_signal_sets_the_librarys_cancel_token() -> None:
    # the library checks the token between units of work; the CLI's Ctrl-C sets it
    from moet_cache.cli._signals import InterruptGate, InterruptibleProgress
    from moet_cache.errors import Interrupted
    from moet_cache.progress import NullProgress
    gate = InterruptGate()
    progress = InterruptibleProgress(NullProgress(), gate)
    progress.start(10, "build")
    assert not gate.token.cancelled
    gate._on_signal(signal.SIGTERM, None)
    assert gate.token.cancelled
    with pytest.raises(Interrupted, match="interrupted by SIGTERM"):
        gate.token.check()


def test_the_split_device_comes_from_the_environment_in_the_cli_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from moet_cache.cli.build import split_device_from_env
    from moet_cache.errors import InputError
    for value, want in (("cpu", "cpu"), ("torch-cpu", "torch-cpu"), ("cuda", "cuda"), ("", "auto")):
        monkeypatch.setenv("MOET_CACHE_SPLIT_DEVICE", value)
        assert split_device_from_env() == want
    monkeypatch.setenv("MOET_CACHE_SPLIT_DEVICE", "gpu")  # a typo is refused, not run as auto
    with pytest.raises(InputError, match="MOET_CACHE_SPLIT_DEVICE='gpu' is not one of: auto, cpu, torch-cpu, cuda"):
        split_device_from_env()
    monkeypatch.delenv("MOET_CACHE_SPLIT_DEVICE")
    assert split_device_from_env() == "auto"
    import moet_cache.build as build_pkg
    for f in Path(build_pkg.__file__).parent.glob("*.py"):  # the library takes it as BuildTuning.split_device
        assert "environ" not in f.read_text(), f


def test_the_kernels_and_the_kill_hook_come_from_the_environment_in_the_cli_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from moet_cache.codec import planes
    from moet_cache.cli._common import kill_hook
    from moet_cache.cli.build import host_kernel_from_env
    from moet_cache.cache.commit import KillHook
    monkeypatch.setenv("MOET_CACHE_KERNELS", "numpy")
    assert host_kernel_from_env() == "numpy"
    monkeypatch.delenv("MOET_CACHE_KERNELS")
    assert host_kernel_from_env() == planes.KERNEL
    monkeypatch.setenv("MOET_CACHE_TEST_KILL_AT", "swept:TERM")
    assert kill_hook() == KillHook("swept", signal.SIGTERM)
    monkeypatch.setenv("MOET_CACHE_TEST_KILL_AT", "committed")
    assert kill_hook() == KillHook("committed", signal.SIGKILL)
    monkeypatch.delenv("MOET_CACHE_TEST_KILL_AT")
    assert kill_hook() is None
    # the library reads no environment variable: serve only hands its own to the vLLM it starts
    import moet_cache
    lib = Path(moet_cache.__file__).parent
    for f in lib.rglob("*.py"):  # runtime.kernel_cache reads the one variable vLLM's process hands the runtime
        if f.relative_to(lib).as_posix() not in ("serve/command.py", "serve/vllm_env.py", "runtime/kernel_cache.py"):
            assert "os.environ" not in f.read_text() and "getenv" not in f.read_text(), f
