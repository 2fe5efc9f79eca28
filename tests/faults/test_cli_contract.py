"""The command line's contract: every exit's JSON document, --quiet, help at 80 columns,
--version, and integers too long for Python's int() in input files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


from .campaign import make_tiny, run_console, run_main

ENVELOPE = ("command", "ok", "exit_code", "error", "hint")
COMMANDS = ("build", "verify", "inspect", "export", "retier", "demo", "plan", "serve")


def _doc(out: str) -> dict:
    doc = json.loads(out)  # exactly one document: json.loads refuses trailing data
    assert all(k in doc for k in ENVELOPE), doc
    return doc


def test_json_on_every_exit(lossless: tuple[Path, Path], work: Path) -> None:
    src, cache = lossless
    (work / "notempty").mkdir()
    (work / "notempty" / "x").write_text("x")
    cases = [
        (["verify", cache, "--json"], 0, None),
        (["verify", work / "nothing-here", "--json"], 2, "no such folder"),
        (["inspect", work / "nothing-here", "--json"], 2, None),
        (["build", work / "no-src", work / "c2", "--json"], 2, None),
        (["export", cache, work / "notempty", "--json"], 2, "not empty"),
        (["retier", cache, "--delta-budget", "lots", "--json"], 2, None),
        (["verify", cache, "--json", "--no-such-option"], 2, None),
        (["plan", work / "nothing-here", "--json"], 2, None),
    ]
    for argv, code, words in cases:
        rc, out, err = run_main(argv)
        assert rc == code, (argv, rc, err)
        doc = _doc(out)
        assert doc["exit_code"] == rc and doc["ok"] is (rc == 0), doc
        assert doc["command"] == argv[0], doc
        if rc:
            assert isinstance(doc["error"], str) and doc["error"], doc
            assert "error_type" in doc
        if words:
            assert words in doc["error"], doc
    # a verification failure (exit 1) is a full report plus the envelope
    (cache / "COMMIT.json").rename(cache / "COMMIT.json.away")
    try:
        rc, out, _ = run_main(["verify", cache, "--json"])
    finally:
        (cache / "COMMIT.json.away").rename(cache / "COMMIT.json")
    doc = _doc(out)
    assert rc == 1 and doc["exit_code"] == 1 and doc["state"] == "incomplete" and doc["ok"] is False


def test_json_on_a_real_process_error(work: Path) -> None:
    rc, out, err = run_console(["verify", work / "missing", "--json"])
    assert rc == 2 and _doc(out)["exit_code"] == 2 and "Error:" in err


def test_quiet_prints_no_summaries(lossless: tuple[Path, Path], work: Path) -> None:
    src, cache = lossless
    for argv in (["build", src, work / "q", "--lossless", "--quiet"], ["build", src, work / "q", "--lossless", "-q"],
                 ["verify", cache, "--quiet"], ["verify", cache, "--full", "--quiet"],
                 ["retier", work / "q", "--delta-budget", "10%", "--quiet"]):
        rc, out, err = run_main(argv)
        assert (rc, out, err) == (0, "", ""), argv


def _help(*args: str) -> str:
    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    r = subprocess.run([sys.executable, "-m", "moet_cache.cli.app", *args, "--help"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_help_is_readable_at_80_columns() -> None:
    from moet_cache.cli.app import app
    import typer.main
    root = typer.main.get_command(app)
    top = _help()
    for word in ("MOET_CACHE_DEBUG", "--debug", "--json", "--quiet", "-V, --version", "exit_code"):
        assert word in top, word
    for name in COMMANDS:
        text = _help(name)
        assert max(len(line) for line in text.splitlines()) <= 80, (name, text)
        assert "…" not in text and "{" not in text.split("\n", 1)[0], (name, text)
        for p in root.commands[name].params:
            for opt in p.opts:
                if opt.startswith("-"):
                    assert opt in text, (name, opt)
    assert "Usage: moet-cache build [OPTIONS] SRC CACHE" in _help("build")
    assert "--against SRC" in _help("verify")
    assert "--lossless " in _help("build") and "--no-lossless" not in _help("build")


def test_version_names_torch_vllm_and_the_kernels() -> None:
    for flag in ("-V", "--version"):
        r = subprocess.run([sys.executable, "-m", "moet_cache.cli.app", flag], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0
        lines = r.stdout.splitlines()
        assert lines[0].startswith("moet-cache ")
        assert any(line.startswith("torch ") for line in lines)
        assert any(line.startswith("vllm ") for line in lines)
        assert any(line.startswith("C kernels: ") for line in lines)
    # the version text never imports vLLM or torch (both take seconds)
    code = ("import sys; from moet_cache.cli._common import version_text; version_text(); "
            "print('torch' in sys.modules, 'vllm' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["False", "False"], r.stdout + r.stderr


@pytest.mark.parametrize("where", ["config", "profile"])
def test_integer_of_more_than_4300_digits_is_bad_input(work: Path, where: str) -> None:
    src = make_tiny(work / "src")
    huge = "9" * 5000
    argv: list[object] = ["build", src, work / "cache"]
    if where == "config":
        text = (src / "config.json").read_text()
        (src / "config.json").write_text(text.replace('"hidden_size": 128', f'"hidden_size": {huge}'))
        assert huge in (src / "config.json").read_text()
    else:
        prof = work / "profile.json"
        prof.write_text('{"format": "moet-cache-routing-profile", "format_version": 1, '
                        f'"layers": [{{"layer": 1, "counts": [{huge}, 1, 1, 1]}}]}}')
        argv += ["--profile", prof]
    rc, out, err = run_main(argv)
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "not valid JSON" in err and "internal error" not in err
