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


def test_runtime_reference_is_short() -> None:
    assert len(RUNTIME.read_text().splitlines()) < 400


@pytest.mark.parametrize("path", PRESENT, ids=lambda p: p.name)
def test_no_history_words(path: Path) -> None:
    hits = [f"{path.name}:{n}: {line.strip()[:80]}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if HISTORY.search(line)]
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
