"""benchmarks/results/: every results file says what measured it, SUMMARY.md is what the files give, and
benchmarks/record.py writes a run's JSON as a results file (or nothing, where the run failed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ENVELOPE = {"format", "command", "commit", "date", "host", "cores", "device", "result"}


def _record(out: Path, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "record.py"), str(out), "--", *command],
                          check=False, capture_output=True, text=True, timeout=120)


def test_every_results_file_says_what_measured_it() -> None:
    files = sorted(RESULTS.glob("*.json"))
    assert files, "benchmarks/results/ holds no results file"
    for path in files:
        doc = json.loads(path.read_text())
        assert set(doc) == ENVELOPE, path.name
        assert doc["format"] == "moet-cache-benchmark-result"
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", doc["commit"]), (path.name, doc["commit"])
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["date"])
        assert any(part.startswith("benchmarks/") for part in doc["command"]), doc["command"]
        assert doc["result"], path.name


def test_summary_is_what_the_results_files_give() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "summarize.py"), "--check"],
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_record_writes_the_runs_json_with_its_command_and_commit(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    code = "print('warming up'); print('{\"figure\": 1.5, \"goals_met\": {\"figure\": true}}')"
    proc = _record(out, sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["result"] == {"figure": 1.5, "goals_met": {"figure": True}}
    assert doc["command"] == [sys.executable, "-c", code]
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", doc["commit"])
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temp file left


def test_record_writes_nothing_for_a_failed_or_silent_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    failed = _record(out, sys.executable, "-c", "import sys; print('{}'); sys.exit(3)")
    assert failed.returncode == 3 and "nothing written" in failed.stderr
    silent = _record(out, sys.executable, "-c", "print('no figures')")
    assert silent.returncode == 1 and "no JSON" in silent.stderr
    assert not out.exists() and not list(tmp_path.iterdir())
