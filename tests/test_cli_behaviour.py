"""What the command line says and which exit code it gives: damaged caches and wrong folders named as what they
are, environment variables checked, output that fits, errors that tell the truth. Real folders, files and
processes of the console script."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from moet_cache.codec import planes
from moet_cache.cli._errors import exit_code_for, hint_for, message_for
from moet_cache.cli.app import main
from moet_cache.cli.build import host_kernel_from_env
from moet_cache.errors import InputError
from moet_cache.units import fmt_bytes
from moet_cache.verify import boot_check

EXE = [sys.executable, "-m", "moet_cache.cli.app"]


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*EXE, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, **kw)


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in stderr, stderr
    return lines[0]


def damage(cache: Path, how: str) -> str:
    """Damage one base-plane file the way a failing disk or a careless copy does; its path in the cache."""
    rel = "layers/layer-002.base.safetensors"
    p = cache / rel
    if how == "missing":
        p.unlink()
    elif how == "cut":
        os.truncate(p, p.stat().st_size // 2)
    elif how == "fifo":
        p.unlink()
        os.mkfifo(p)
    return rel


@pytest.mark.parametrize("how,state", [("missing", "incomplete"), ("cut", "corrupt"), ("fifo", "corrupt")])
@pytest.mark.parametrize("command", ["inspect", "plan"])
def test_a_damaged_cache_is_exit_1_with_the_boot_checks_line(tmp_path: Path, built_cache: Path, how: str,
                                                             state: str, command: str,
                                                             capsys: pytest.CaptureFixture) -> None:
    cache = Path(shutil.copytree(built_cache, tmp_path / "cache"))
    rel = damage(cache, how)
    assert main([command, str(cache), "--json"]) == 1
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert f"the cache is {state}" in line and rel in line
    doc = json.loads(captured.out)  # the JSON document says the same
    assert doc["exit_code"] == 1 and doc["error_type"] == "VerificationError" and rel in doc["error"]


def test_inspect_and_plan_of_a_sound_cache_still_work(built_cache: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", str(built_cache), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total_experts"] == 48
    assert main(["plan", str(built_cache), "--gpu", "96GB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["exact"] is True


def test_a_damaged_listed_file_read_after_the_boot_check_is_exit_1(tmp_path: Path, built_cache: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    # delta/tier.json keeps its size and time (the boot check's stats pass) but not its bytes
    cache = Path(shutil.copytree(built_cache, tmp_path / "cache"))
    p = cache / "delta/tier.json"
    st = p.stat()
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x20
    p.write_bytes(bytes(data))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert main(["inspect", str(cache)]) == 1
    assert "delta/tier.json" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("command", ["inspect", "verify", "plan"])
def test_wrong_folders_are_named_as_what_they_are(tmp_path: Path, ckpt_modelopt: Path, command: str,
                                                  capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes.txt").write_text("mine")
    (tmp_path / "empty").mkdir()
    cases = [(tmp_path / "typo", 2, "no such folder" if command != "plan" else "is not a folder"),
             (tmp_path / "a-file", 2, "a file, not a cache folder" if command != "plan" else "is not a folder"),
             (tmp_path / "project", 2, "holds no cache" if command != "plan" else "has no config.json")]
    if command != "plan":  # plan takes a checkpoint too
        cases.append((ckpt_modelopt, 2, "is a checkpoint, not a cache"))
    cases.append((tmp_path / "empty", 1 if command != "plan" else 2,
                  "the folder is empty" if command != "plan" else "is an empty folder"))
    for path, code, needle in cases:
        got = main([command, str(path)])
        captured = capsys.readouterr()
        if command == "verify" and code == 1:  # verify's report, on stdout
            assert got == 1 and needle in captured.out, (path, captured)
            continue
        assert got == code, (path, captured)
        line = one_error_line(captured.err)
        assert needle in line, (path, line)
        assert "build did not finish" not in line and "incomplete" not in line or code == 1


def test_a_cache_whose_build_did_not_finish_is_still_called_so(tmp_path: Path, built_cache: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    cache = Path(shutil.copytree(built_cache, tmp_path / "cache"))
    (cache / "COMMIT.json").unlink()
    for command in ("inspect", "plan"):
        assert main([command, str(cache)]) == 1
        assert "the build did not finish" in one_error_line(capsys.readouterr().err)
    assert main(["verify", str(cache)]) == 1
    assert "the build did not finish" in capsys.readouterr().out


@pytest.mark.parametrize("name,value,allowed", [
    ("MOET_CACHE_SPLIT_DEVICE", "gpu", "auto, cpu, torch-cpu, cuda"),
    ("MOET_CACHE_KERNELS", "fast", "c, numpy"),
    ("MOET_CACHE_DEBUG", "yes", "0, 1"),
    ("MOET_CACHE_TEST_KILL_AT", "sweep", "swept"),
    ("MOET_CACHE_TEST_KILL_AT", "swept:HUP", "swept:KILL, swept:TERM, swept:INT"),
])
def test_a_bogus_environment_variable_is_refused_naming_it(tmp_path: Path, ckpt_modelopt: Path, name: str,
                                                           value: str, allowed: str,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv(name, value)
    cache = tmp_path / "cache"
    assert main(["build", str(ckpt_modelopt), str(cache), "--json"]) == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert f"{name}={value!r}" in line and allowed in line
    assert json.loads(captured.out)["error_type"] == "InputError"
    assert not cache.exists()  # refused before anything was written


def test_the_allowed_values_of_the_environment_variables_still_work(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture,
                                                                    tmp_path: Path) -> None:
    monkeypatch.setenv("MOET_CACHE_KERNELS", "numpy")
    assert host_kernel_from_env() == "numpy"
    monkeypatch.setenv("MOET_CACHE_DEBUG", "1")
    assert main(["verify", str(tmp_path / "none")]) == 2
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("MOET_CACHE_DEBUG", "0")
    assert main(["verify", str(tmp_path / "none")]) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("layers", ["²", "3-²", "٣", "9" * 5000, "1-" + "9" * 5000])
def test_a_layer_selection_in_other_digits_is_bad_input(tmp_path: Path, ckpt_modelopt: Path, layers: str,
                                                        capsys: pytest.CaptureFixture) -> None:
    assert main(["build", str(ckpt_modelopt), str(tmp_path / "c"), "--layers", layers]) == 2
    assert "cannot read the layer selection" in one_error_line(capsys.readouterr().err)



def test_an_os_error_is_reported_by_its_errno_with_its_path(tmp_path: Path) -> None:

    eio = OSError(errno.EIO, os.strerror(errno.EIO), str(tmp_path / "layers/layer-001.base.safetensors"))
    assert exit_code_for(eio) == 3
    assert message_for(eio, with_hint=False) == f"Input/output error: {eio.filename}"
    assert "No such file" not in message_for(eio) and "check the disk" in hint_for(eio)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "cache/layers/x.tmp"))
    assert exit_code_for(full) == 3
    assert message_for(full, with_hint=False).endswith("bytes free there)")  # the file system of the path
    free = int(message_for(full, with_hint=False).rsplit("(", 1)[1].split()[0])
    assert abs(free - shutil.disk_usage(tmp_path).free) < 1 << 30
    assert exit_code_for(NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), "a/b")) == 2
    assert exit_code_for(PermissionError(errno.EACCES, os.strerror(errno.EACCES), "a")) == 3


def test_demo_workdir_that_is_a_file_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "a-file").write_text("mine")
    assert main(["demo", "--workdir", str(tmp_path / "a-file")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "Not a directory" in line and "a-file" in line and "not a folder" in line
    assert (tmp_path / "a-file").read_text() == "mine"


def test_an_io_error_on_a_cache_file_is_not_called_missing(tmp_path: Path, built_cache: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    cache = Path(shutil.copytree(built_cache, tmp_path / "cache"))
    real_lstat = os.lstat

    def failing_lstat(path, *args, **kwargs):  # the disk fails on one plane file's inode
        if str(path).endswith("layer-002.base.safetensors"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real_lstat(path, *args, **kwargs)
    monkeypatch.setattr(os, "lstat", failing_lstat)
    assert main(["verify", str(cache), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["state"] == "corrupt"
    p = next(p for p in doc["problems"] if p["path"] == "layers/layer-002.base.safetensors")
    assert p["kind"] == "unreadable" and "Input/output error" in p["detail"] and "missing" not in p["detail"]
    assert main(["inspect", str(cache)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "Input/output error" in line and "missing" not in line


def test_disk_full_in_a_build_says_the_bytes_needed_and_free(tmp_path: Path, ckpt_modelopt: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    real_pwrite = os.pwrite

    def full_pwrite(fd: int, data, pos: int) -> int:  # the disk fills under the plane writer
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "pwrite", full_pwrite)
    assert main(["build", str(ckpt_modelopt), str(tmp_path / "a"), "-q"]) == 3
    line = one_error_line(capsys.readouterr().err)
    assert re.search(r"the disk is full while writing \S+ \(\d+ bytes needed for it, \d+ free\)", line), line
    monkeypatch.setattr(os, "pwrite", real_pwrite)

    def full_mkstemp(*args, **kwargs):  # no room for a new file's inode: no byte count of its own
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(kwargs.get("dir", "?")))
    monkeypatch.setattr(tempfile, "mkstemp", full_mkstemp)
    assert main(["build", str(ckpt_modelopt), str(tmp_path / "b"), "-q"]) == 3
    line = one_error_line(capsys.readouterr().err)
    assert re.search(r"No space left on device: \S+ \(\d+ bytes free there\) \(free space", line), line


@pytest.mark.parametrize("args", [["inspect", "{cache}", "--json"], ["inspect", "{cache}"], ["plan", "{cache}"],
                                  ["verify", "{cache}", "--json"]])
def test_a_full_stdout_is_one_line_and_exit_3(built_cache: Path, args: list[str]) -> None:
    with open("/dev/full", "w") as full:
        r = subprocess.run([*EXE, *[a.format(cache=built_cache) for a in args]], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    assert r.returncode == 3
    assert one_error_line(r.stderr) == ("Error: cannot write to standard output: No space left on device (check "
                                        "where the output goes: a full disk, or a pipe closed early)")


def test_a_pipe_closed_early_is_exit_3_not_1(built_cache: Path) -> None:
    p = subprocess.Popen([*EXE, "plan", str(built_cache)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # the reader went away (`| head -0`) before the plan was printed
    err = p.stderr.read()
    assert p.wait(timeout=120) == 3
    assert "cannot write to standard output: Broken pipe" in one_error_line(err)


def _gate_script(body: str) -> subprocess.CompletedProcess:
    """A process whose signal gate gets `body`'s signals (real os._exit, real fds 1 and 2)."""
    code = ("import signal\nfrom moet_cache.cli._signals import InterruptGate\n"
            "gate = InterruptGate()\ngate.command, gate.json_mode = 'build', True\n" + body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_second_ctrl_c_during_work_exits_3_with_the_json_document_saying_3() -> None:
    r = _gate_script("gate.deferring = True  # long work under way\n"
                     "gate._on_signal(signal.SIGINT, None)  # held until the next progress report\n"
                     "gate._on_signal(signal.SIGINT, None)  # stops at once\n"
                     "raise SystemExit(99)\n")
    assert r.returncode == 3, r.stderr
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == 3 and doc["ok"] is False and doc["command"] == "build"
    assert doc["error_type"] == "Interrupted" and "again; stopped at once" in doc["error"]
    assert one_error_line(r.stderr).startswith("Error: interrupted by SIGINT again; stopped at once")


def test_signals_after_the_outcome_is_printed_keep_its_exit_code() -> None:
    r = _gate_script("gate.settle(0)\n"
                     "gate._on_signal(signal.SIGINT, None)\n"
                     "gate._on_signal(signal.SIGTERM, None)  # ends the process with the printed code\n"
                     "raise SystemExit(99)\n")
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


def test_a_ctrl_c_in_the_interpreters_teardown_keeps_the_printed_exit_code(tmp_path: Path) -> None:
    # Python puts the default SIGINT handler back while it tears down: a Ctrl-C then ended the process as
    # killed by SIGINT (130 in a shell) after the JSON document had said 2
    script = tmp_path / "slow_exit.py"
    script.write_text("import os, sys, time\n"
                      "class SlowTeardown:\n"
                      "    def __del__(self, sleep=time.sleep, write=os.write):\n"
                      "        write(2, b'tearing down\\n')\n"
                      "        sleep(3)\n"
                      "slow = SlowTeardown()  # deleted when the modules are, after signal handling stops\n"
                      "sys.argv = ['moet-cache', *sys.argv[1:]]\n"
                      "from moet_cache.cli.app import run\n"
                      "run()\n")
    p = subprocess.Popen([sys.executable, str(script), "verify", str(tmp_path / "typo"), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = ""
    while "tearing down" not in err:
        line = p.stderr.readline()
        assert line, err
        err += line
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 2 and json.loads(out)["exit_code"] == 2


def _table_lines(text: str, first: str) -> list[str]:
    """The table whose header line starts with `first`: its lines up to the first line printed after it."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    after = ("every layer", "source:", "fits", "does not fit")
    end = next((i for i in range(start, len(lines)) if lines[i].startswith(after)), len(lines))
    return lines[start:end]


@pytest.mark.parametrize("columns", [None, "80", "40"])
def test_tables_on_a_pipe_fit_the_width_and_never_split_a_number(built_cache: Path, columns: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns:
        env["COLUMNS"] = columns
    info = json.loads(run("inspect", str(built_cache), "--json").stdout)
    r = subprocess.run([*EXE, "inspect", str(built_cache)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    table = _table_lines(r.stdout, "layer")
    assert max(len(line) for line in table) <= 80  # 80 unless COLUMNS says otherwise; never hundreds
    for layer in info["layers"]:  # each layer's row holds its figures whole, on one line
        row = next(line for line in table if line.split()[0] == str(layer["layer"]))
        for figure in (fmt_bytes(layer["base_bytes"]), f"{layer['rel_error_worst']:.4f} #{layer['worst_expert']}",
                       f"{layer['rel_error_served']:.4f}"):
            assert figure in row, (figure, row)
    r = subprocess.run([*EXE, "plan", str(built_cache), "--gpu", "96GB"], capture_output=True, text=True, env=env,
                       timeout=120)
    plan = json.loads(run("plan", str(built_cache), "--gpu", "96GB", "--json").stdout)
    table = _table_lines(r.stdout, "Term")
    assert max(len(line.rstrip()) for line in table) <= int(columns or 80)  # the descriptions wrap
    total = next(line for line in table if line.startswith("total"))
    assert f"{plan['need_gib']:.2f}" in total.split()  # the figure whole, in its own column


def test_plan_quiet_still_says_whether_it_fits(built_cache: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", str(built_cache), "--gpu", "96GB", "-q"]) == 0
    out = capsys.readouterr().out
    assert "fits, with" in out and "GiB to spare" in out
    assert "the free bytes would buy" not in out  # the notes stay quiet
    assert main(["plan", str(built_cache), "--gpu", "1GiB", "--max-num-seqs", "1000", "-q"]) == 1
    assert "does not fit: short by" in capsys.readouterr().out


def test_an_io_error_on_a_source_shard_is_not_called_gone(built_cache: Path, ckpt_modelopt: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    real_stat = pathlib.Path.stat

    def failing_stat(self, *args, **kwargs):  # the source's disk fails on its shards
        if self.name.endswith(".safetensors") and str(self).startswith(str(ckpt_modelopt)):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(self))
        return real_stat(self, *args, **kwargs)
    monkeypatch.setattr(pathlib.Path, "stat", failing_stat)
    stale = [p for p in boot_check(built_cache).problems if p.kind == "stale"]
    assert stale and all("Input/output error" in p.detail and "gone" not in p.detail for p in stale)


def test_asking_for_c_kernels_that_are_not_built_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOET_CACHE_KERNELS", "c")
    monkeypatch.setattr(planes, "KERNEL", planes.HostKernel.NUMPY)  # as where moet_cache.codec._kernels did not build
    with pytest.raises(InputError, match="MOET_CACHE_KERNELS=c, but the C kernels are not built"):
        host_kernel_from_env()


@pytest.mark.parametrize("name", ["q[/i]", "b[red]x"])
def test_a_path_with_brackets_is_printed_as_it_is(tmp_path: Path, built_cache: Path, name: str,
                                                  capsys: pytest.CaptureFixture) -> None:
    cache = Path(shutil.copytree(built_cache, tmp_path / name / "cache"))
    for command in (["verify", str(cache)], ["inspect", str(cache)], ["plan", str(cache), "--gpu", "96GB"]):
        assert main(command) in (0, 1), command  # verify: unverified after the copy (1), never 70
        captured = capsys.readouterr()
        assert str(cache) in captured.out and "internal error" not in captured.err, command


def test_export_of_a_checkpoint_or_a_typo_names_it(tmp_path: Path, ckpt_modelopt: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    assert main(["export", str(ckpt_modelopt), str(tmp_path / "out")]) == 2
    assert "is a checkpoint, not a cache" in one_error_line(capsys.readouterr().err)
    assert main(["export", str(tmp_path / "typo"), str(tmp_path / "out")]) == 2
    assert "no such folder" in one_error_line(capsys.readouterr().err)


def test_a_usage_error_with_json_is_one_envelope_with_the_message(capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", "--no-such-opt", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert (doc["exit_code"], doc["error_type"], doc["ok"]) == (2, "UsageError", False)
    assert doc["error"] == "No such option: --no-such-opt" and doc["hint"] == "see `moet-cache --help`"
