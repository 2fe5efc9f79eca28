"""docs/CLI.md is the commands' --help, regenerated here; it fails when an option changed and the file did not."""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path

from moet_cache.cli.reference import REGENERATE, main, render

REPO = Path(__file__).resolve().parents[1]
CLI_MD = REPO / "docs" / "CLI.md"


def test_docs_cli_md_is_the_current_help() -> None:
    want = render()
    have = CLI_MD.read_text(encoding="utf-8") if CLI_MD.is_file() else ""
    if have != want:
        diff = "\n".join(list(difflib.unified_diff(have.splitlines(), want.splitlines(), "docs/CLI.md (checked in)",
                                                   "docs/CLI.md (from --help)", lineterm=""))[:40])
        raise AssertionError(f"docs/CLI.md differs from the commands' --help; regenerate it with:\n\n"
                             f"    {REGENERATE}\n\n{diff}")


def test_the_reference_is_what_the_console_prints_at_80_columns() -> None:
    """Rendered in-process, the help must read exactly as a real `COLUMNS=80 moet-cache build --help`."""
    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb", "NO_COLOR": "1"}
    r = subprocess.run([sys.executable, "-m", "moet_cache.cli.app", "build", "--help"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    printed = "\n".join(line.rstrip() for line in r.stdout.strip("\n").splitlines())
    assert f"## moet-cache build\n\n```text\n{printed}\n```" in render()


def test_check_mode_says_how_to_regenerate(tmp_path: Path, capsys) -> None:
    stale = tmp_path / "CLI.md"
    stale.write_text("old\n")
    assert main([str(stale), "--check"]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert main([str(stale)]) == 0 and main([str(stale), "--check"]) == 0
    assert stale.read_text() == render()
