"""The GPU tests as a job of their own: `pytest -m gpu` on a CUDA machine, its outcome recorded.

    python benchmarks/gpu_tests.py                 # every test marked gpu, from the repository root
    python benchmarks/gpu_tests.py -- -x -k prefill   # arguments after -- go to pytest
    python benchmarks/gpu_tests.py --deadline 540 -- -q   # pytest stopped (SIGINT) after 540 s
    OMP_NUM_THREADS=4 python benchmarks/gpu_tests.py -- -n 4 --dist load   # 4 workers on one GPU

The last spreads the tests over 4 pytest-xdist workers sharing the one GPU, test by test (`--dist load`;
`--dist loadfile` would leave tests/test_runtime_gpu.py's 315 tests on one worker), each with 4 CPU threads
for the small-T reference on a 16-core host. Each worker builds its own layer fixtures: at DeepSeek-V4-Flash
dims a layer's tensors are 2.2 GB, and the test holding the most holds about 10 GB (two layers, one with every
expert in its tier, and its laid-out copy; counted from the tensors' sizes, not measured), so 4 workers fit
an 80 GB card where 8 may not. Each worker keeps its own CPU copies of its layers (tests/gpu_reference.py),
2 GB a layer in host memory.

writes benchmarks/results/gpu_tests.xml (pytest's JUnit XML) and benchmarks/results/gpu_tests.json
(benchmarks/record.py's envelope: the command, the commit with "+dirty" where the code differed from it,
the date, the host, the device; its result the passed, failed, skipped and error counts, the torch and
CUDA versions and the device count), sets README.md's "GPU tests last passed:" line from it and
regenerates benchmarks/results/SUMMARY.md. Every run is recorded, a failing one too; the exit code is
pytest's. On a machine without a CUDA device nothing runs and nothing is written (exit 2).

With --deadline, pytest is interrupted at that many seconds as Ctrl-C would (pytest-xdist too): it still writes
its report of the tests that ran, and the run is recorded as interrupted, never as passed, so a GPU lease
that ends mid-run still leaves which tests ran and which failed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

import record
import summarize

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
JUNIT, RESULT = "gpu_tests.xml", "gpu_tests.json"
#: README's line, whole, starts with this
README_PREFIX = "GPU tests last passed:"
COMMAND = "benchmarks/gpu_tests.py"


def junit_counts(path: Path) -> dict[str, int]:
    """passed, failed, skipped and errors summed over the JUnit XML's test suites (pytest writes one)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"], "skipped": total["skipped"], "errors": total["errors"]}


def passed(doc: dict[str, Any]) -> bool:
    """Whether a recorded run passed: tests ran and none failed or errored."""
    r = doc["result"]
    return r["passed"] > 0 and not r["failed"] and not r["errors"] and not r.get("interrupted")


def readme_status(doc: dict[str, Any] | None) -> str:
    """README.md's line for the recorded run (None: no results file)."""
    if doc is None:
        return (f"{README_PREFIX} never recorded on this tree (no benchmarks/results/{RESULT}); run "
                f"`python {COMMAND}` on a CUDA machine.")
    r = doc["result"]
    # a run given pytest arguments (a selection of tests) says which, so a subset never reads as the whole job
    args = doc["command"][2:]
    counts = (f"{r['passed']} passed, {r['failed']} failed, {r['errors']} errors, {r['skipped']} skipped"
              + (f"; pytest arguments: {' '.join(args)}" if args else "")
              + (f"; stopped at its deadline, {r['deadline_s']} s" if r.get("interrupted") else ""))
    if passed(doc):
        return f"{README_PREFIX} {doc['date']} at commit {doc['commit']} on {doc['device']} ({counts})."
    return (f"{README_PREFIX} not on the last recorded run, {doc['date']} at commit {doc['commit']} on "
            f"{doc['device']} ({counts}).")


def set_readme_line(readme: Path, line: str) -> None:
    """Replace README's line that starts with README_PREFIX by `line` (written whole or not at all)."""
    lines = readme.read_text().split("\n")
    at = [i for i, text in enumerate(lines) if text.startswith(README_PREFIX)]
    if len(at) != 1:
        raise SystemExit(f"{readme} must hold one line starting {README_PREFIX!r}, it holds {len(at)}")
    lines[at[0]] = line
    tmp = readme.with_name(f".{readme.name}.tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(readme)


#: seconds pytest is given to write its report after the deadline's SIGINT before it is killed
GRACE_S = 120


def run_pytest(args: list[str], cwd: Path, deadline_s: float | None) -> tuple[int, bool]:
    """pytest's exit code, and whether it was interrupted at `deadline_s` (SIGINT, as Ctrl-C: pytest and its
    xdist workers stop and pytest writes its report; killed only if it has not ended GRACE_S later)."""
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=cwd)
    try:
        return proc.wait(timeout=deadline_s), False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=GRACE_S), True
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(), True


def run(pytest_args: list[str], device: str, results: Path = RESULTS, readme: Path = README,
        cwd: Path = ROOT, deadline_s: float | None = None) -> int:
    """Run `pytest -m gpu` with `pytest_args` in `cwd` (interrupted at `deadline_s` seconds, if given), record
    it under `results` as on `device`, and set `readme`'s line from it. Returns pytest's exit code; where pytest
    wrote no JUnit XML (a usage error, or killed before its report) nothing is recorded."""
    results.mkdir(parents=True, exist_ok=True)
    junit = results / JUNIT
    partial = results / f".{JUNIT}.tmp"
    partial.unlink(missing_ok=True)
    code, interrupted = run_pytest(["-m", "gpu", f"--junitxml={partial}", *pytest_args], cwd, deadline_s)
    if not partial.exists():
        print(f"pytest exited {code} without a JUnit report: nothing recorded", file=sys.stderr)
        return code or 1
    counts = junit_counts(partial)
    partial.replace(junit)
    commit = record.commit()  # the results files and README do not make it dirty
    doc = record.envelope(["python", COMMAND, *pytest_args],
                          {**counts, "pytest_exit": code, "interrupted": interrupted, "deadline_s": deadline_s,
                           "dirty": commit.endswith("+dirty"), "torch": torch.__version__,
                           "cuda": torch.version.cuda or "none", "devices": torch.cuda.device_count(),
                           "junit": JUNIT}, device)
    record.write(results / RESULT, doc)
    set_readme_line(readme, readme_status(doc))
    print(readme_status(doc))
    return code


def main(argv: list[str]) -> int:
    deadline_s = None
    if argv[:1] == ["--deadline"] and len(argv) >= 2 and argv[1].isdigit() and int(argv[1]) > 0:
        deadline_s, argv = int(argv[1]), argv[2:]
    if argv and argv[0] != "--":
        print("usage: " + "\n       ".join(line.strip() for line in __doc__.strip().splitlines()[2:6]), file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_tests.py: no CUDA device here (torch.cuda.is_available() is False): run it on a GPU machine; "
              "nothing recorded", file=sys.stderr)
        return 2
    code = run(argv[1:], torch.cuda.get_device_name(0), deadline_s=deadline_s)
    summarize.main([])
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
