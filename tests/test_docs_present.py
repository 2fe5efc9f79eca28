"""The docs describe the present: the runtime reference stays short, no history words, and its figures
trace to a results file or to a commit that exists."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "docs" / "RUNTIME.md"
PRESENT = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "NOTES.md",
           *(ROOT / "docs" / name for name in ("ARCHITECTURE.md", "BUILD.md", "FORMAT.md", "LOADER.md",
                                               "PARSERS.md", "RUNTIME.md", "SERVING.md"))]
HISTORY = re.compile(r"\bsessions? \d+|\b(this|last|next|same) session\b|\bissue \d+|field\sreport|before\sthe\sfix"
                     r"|\bthe\sfix\sbelow\b", re.IGNORECASE)
TEXT_SUFFIXES = {".py", ".md", ".cu", ".c", ".json", ".toml", ".txt", ".cfg", ".sh", ".yaml", ".yml"}


def test_runtime_reference_is_short() -> None:
    assert len(RUNTIME.read_text().splitlines()) < 400


def _tracked_text_files() -> list[Path]:
    """Every file of the project git tracks that is text: docs, code, kernels, tests, configs, results."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if listed.returncode:
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    names = [n for n in listed.stdout.decode().split("\0") if n]
    return [ROOT / n for n in names if Path(n).suffix in TEXT_SUFFIXES and (ROOT / n).is_file()]


@pytest.mark.parametrize("path", PRESENT, ids=lambda p: p.name)
def test_no_history_words(path: Path) -> None:
    hits = [f"{path.name}:{n}: {line.strip()[:80]}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if HISTORY.search(line)]
    assert not hits, hits


def test_no_history_words_anywhere_in_the_project() -> None:
    """Code comments, docstrings, tests, program output and results speak of the present too."""
    files = _tracked_text_files()
    assert any(f.suffix == ".py" for f in files) and any(f.suffix == ".md" for f in files)
    hits = [f"{f.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for f in files
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1) if HISTORY.search(line)]
    assert not hits, hits


def test_runtime_fidelity_table_is_the_results_files() -> None:
    """Each figure of RUNTIME.md's fidelity table is in the results file its command writes."""
    text = RUNTIME.read_text()
    for name in ("moe-fidelity.json", "moe-fidelity-skew0.5.json"):
        assert f"benchmarks/results/{name}" in text
        for row in json.loads((ROOT / "benchmarks" / "results" / name).read_text())["result"]:
            assert f"{row['rel_error_vs_fp4']:.3f}" in text, (name, row)
            if row["pairs_in_tier"]:
                assert f"{100 * row['pairs_in_tier']:.1f}%" in text, (name, row)


def test_commits_named_by_the_runtime_figures_exist() -> None:
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                             text=True, check=False)
    if shallow.returncode or shallow.stdout.strip() != "false":
        pytest.skip("not a full git clone: the history is not here to check")
    named = set(re.findall(r"\bcommit ([0-9a-f]{7,40})\b", RUNTIME.read_text()))
    assert named
    for sha in sorted(named):
        found = subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=ROOT, check=False)
        assert found.returncode == 0, f"RUNTIME.md names commit {sha}, which the history does not have"
