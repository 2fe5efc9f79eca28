"""A benchmark's figures as a results file: benchmarks/results/<name>.json, with what measured them.

    python benchmarks/record.py benchmarks/results/run-cpu.json -- python benchmarks/run.py --size 512MiB --json

runs the command, takes the JSON object its stdout ends with, and writes it under "result" beside the
command, the commit (with "+dirty" where the tree had changes), the date, the host and its cores.
bench_moe.py writes the same envelope itself (`--json PATH`). benchmarks/summarize.py turns every
results file into benchmarks/results/SUMMARY.md.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checked-out commit, "+dirty" where tracked files other than documents (*.md) and results files
    differ from it (what could change a figure); "unknown" outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!*.md",
                                ":!benchmarks/results"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def envelope(command: list[str], result: Any, device: str | None = None) -> dict[str, Any]:
    """A results file's content: the figures and what measured them."""
    return {"format": "moet-cache-benchmark-result", "command": command, "commit": commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host": platform.node(), "cores": os.cpu_count(), "device": device or "cpu", "result": result}


def write(path: Path, content: dict[str, Any]) -> None:
    """Write the file whole or not at all (a temp file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(content, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out, command = Path(argv[0]), argv[2:]
    proc = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode:
        print(f"{' '.join(command)} exited {proc.returncode}: nothing written", file=sys.stderr)
        return proc.returncode
    text = proc.stdout
    start = text.rfind("\n{") + 1 if not text.lstrip().startswith("{") else text.index("{")
    try:
        result = json.loads(text[start:])
    except ValueError:
        print(f"{' '.join(command)} printed no JSON object at its end: nothing written", file=sys.stderr)
        return 1
    write(out, envelope(command, result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
