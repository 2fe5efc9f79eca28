"""benchmarks/gpu_tests.py, the GPU tests' own job: a real pytest run of a small marked test file recorded as
a results file and README's line, nothing recorded without a JUnit report or without a GPU, and README's line
the one the recorded run (or its absence) gives."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
ENVELOPE = {"format", "command", "commit", "date", "host", "cores", "device", "result"}

TINY = textwrap.dedent("""
    import pytest

    @pytest.mark.gpu
    def test_passes():
        assert 1 + 1 == 2

    @pytest.mark.gpu
    def test_fails():
        assert 1 + 1 == 3

    @pytest.mark.gpu
    def test_skips():
        pytest.skip("needs what is not here")

    def test_not_marked():
        assert False, "deselected by -m gpu"
""")


@pytest.fixture
def gpu_tests(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports record and summarize beside it
    import gpu_tests
    return gpu_tests


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "test_tiny.py").write_text(TINY)
    (tmp_path / "proj" / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    (tmp_path / "README.md").write_text("# x\n\nGPU tests last passed: never.\n\nmore\n")
    return tmp_path


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def test_a_run_is_recorded_with_its_counts_commit_and_device(gpu_tests: ModuleType, project: Path) -> None:
    results, readme = project / "results", project / "README.md"
    code = gpu_tests.run(["-q"], "NVIDIA Test GPU", results=results, readme=readme, cwd=project / "proj")
    assert code == 1  # pytest's: a test failed
    doc = json.loads((results / "gpu_tests.json").read_text())
    assert set(doc) == ENVELOPE and doc["device"] == "NVIDIA Test GPU"
    assert doc["command"] == ["python", "benchmarks/gpu_tests.py", "-q"]
    result = doc["result"]
    assert {k: result[k] for k in ("passed", "failed", "skipped", "errors")} == {
        "passed": 1, "failed": 1, "skipped": 1, "errors": 0}  # the unmarked test deselected
    assert result["pytest_exit"] == 1 and result["torch"] == torch.__version__
    assert result["devices"] == torch.cuda.device_count()
    assert doc["commit"].removesuffix("+dirty") == _git("rev-parse", "HEAD")
    assert result["dirty"] == doc["commit"].endswith("+dirty")
    cases = ET.parse(results / "gpu_tests.xml").getroot().iter("testcase")
    assert sorted(c.get("name") for c in cases) == ["test_fails", "test_passes", "test_skips"]
    assert not list(results.glob(".*"))  # no partial file left
    lines = readme.read_text().split("\n")
    assert lines[2] == gpu_tests.readme_status(doc) and "not on the last recorded run" in lines[2]
    assert "1 failed" in lines[2] and lines[4] == "more"
    # the same tests without the failing one: a pass, and README's line says when and on which commit
    assert gpu_tests.run(["-q", "-k", "not fails"], "NVIDIA Test GPU", results=results, readme=readme,
                         cwd=project / "proj") == 0
    doc = json.loads((results / "gpu_tests.json").read_text())
    assert gpu_tests.passed(doc) and doc["result"]["failed"] == 0
    line = readme.read_text().split("\n")[2]
    assert line == f"GPU tests last passed: {doc['date']} at commit {doc['commit']} on NVIDIA Test GPU " \
                   "(1 passed, 0 failed, 0 errors, 1 skipped; pytest arguments: -q -k not fails)."


def test_a_run_stopped_at_its_deadline_records_what_ran_and_never_reads_as_passed(
        gpu_tests: ModuleType, project: Path) -> None:
    """--deadline: pytest interrupted as Ctrl-C would, its report of the tests that ran recorded as interrupted."""
    (project / "proj" / "test_tiny.py").write_text(textwrap.dedent("""
        import time

        import pytest

        @pytest.mark.gpu
        def test_passes():
            assert True

        @pytest.mark.gpu
        def test_outlasts_the_deadline():
            time.sleep(300)
    """))
    results, readme = project / "results", project / "README.md"
    code = gpu_tests.run(["-q"], "NVIDIA Test GPU", results=results, readme=readme, cwd=project / "proj",
                         deadline_s=8)
    assert code == 2  # pytest's: interrupted
    doc = json.loads((results / "gpu_tests.json").read_text())
    result = doc["result"]
    assert result["interrupted"] and result["deadline_s"] == 8 and result["passed"] == 1
    assert not gpu_tests.passed(doc)
    line = readme.read_text().split("\n")[2]
    assert line == gpu_tests.readme_status(doc) and "not on the last recorded run" in line
    assert line.endswith("; stopped at its deadline, 8 s).")
def test_a_run_spread_over_workers_records_the_same_counts(gpu_tests: ModuleType, project: Path) -> None:
    """The documented parallel form (pytest-xdist's `-n N --dist load`): the workers' JUnit cases gathered in
    one report, counted as a single process counts them."""
    results, readme = project / "results", project / "README.md"
    code = gpu_tests.run(["-q", "-n", "2", "--dist", "load"], "NVIDIA Test GPU", results=results, readme=readme,
                         cwd=project / "proj")
    assert code == 1
    result = json.loads((results / "gpu_tests.json").read_text())["result"]
    assert {k: result[k] for k in ("passed", "failed", "skipped", "errors")} == {
        "passed": 1, "failed": 1, "skipped": 1, "errors": 0}
    cases = ET.parse(results / "gpu_tests.xml").getroot().iter("testcase")
    assert sorted(c.get("name") for c in cases) == ["test_fails", "test_passes", "test_skips"]
    assert "pytest arguments: -q -n 2 --dist load" in readme.read_text().split("\n")[2]


def test_no_report_records_nothing(gpu_tests: ModuleType, project: Path, capsys: pytest.CaptureFixture) -> None:
    results, readme = project / "results", project / "README.md"
    code = gpu_tests.run(["--no-such-option"], "NVIDIA Test GPU", results=results, readme=readme,
                         cwd=project / "proj")
    assert code != 0 and not (results / "gpu_tests.json").exists() and not (results / "gpu_tests.xml").exists()
    assert readme.read_text().split("\n")[2] == "GPU tests last passed: never."
    assert "nothing recorded" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refused_without_a_gpu() -> None:
    before = {p.name: p.stat().st_mtime_ns for p in (BENCH / "results").iterdir()}
    readme = (ROOT / "README.md").read_text()
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_tests.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "no CUDA device" in proc.stderr and "nothing recorded" in proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in (BENCH / "results").iterdir()} == before
    assert (ROOT / "README.md").read_text() == readme


def test_readme_says_when_the_gpu_tests_last_passed(gpu_tests: ModuleType) -> None:
    """README's line is the one benchmarks/results/gpu_tests.json gives, or says no run is recorded."""
    path = BENCH / "results" / "gpu_tests.json"
    doc = json.loads(path.read_text()) if path.exists() else None
    lines = [line for line in (ROOT / "README.md").read_text().split("\n") if line.startswith(gpu_tests.README_PREFIX)]
    assert lines == [gpu_tests.readme_status(doc)]
    if doc is None:
        assert "never recorded" in lines[0]


def test_the_recorded_run_is_no_older_than_the_runtime() -> None:
    """Where a GPU run is recorded, its commit holds the last change to moet_cache/runtime/: the record speaks
    for the kernels as they are."""
    path = BENCH / "results" / "gpu_tests.json"
    if not path.exists():
        pytest.skip("no GPU run recorded on this tree (README says so: the test above)")
    recorded = json.loads(path.read_text())["commit"].removesuffix("+dirty")
    runtime = _git("log", "-1", "--format=%H", "--", "moet_cache/runtime")
    proc = subprocess.run(["git", "merge-base", "--is-ancestor", runtime, recorded], cwd=ROOT, check=False)
    assert proc.returncode == 0, f"gpu_tests.json's commit {recorded} predates {runtime}, the runtime's last change"
