"""The test helpers' temporary folders (tests/vllm_cpu_env.py: vLLM's cache and IPC folder that `early()` makes
for each pytest process, the PATH folder of links `bin_without_vllm` makes at a test module's import) are removed
when the process that made them exits: a real pytest run, its xdist workers included, in a temporary directory
of its own leaves nothing of ours behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import vllm_cpu_env

TESTS = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def test_a_folder_of_ours_is_removed_when_the_process_exits_and_only_it(tmp_path: Path) -> None:
    """The removal takes the folder made and what it holds, links removed and never followed."""
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "file").write_text("not ours")
    code = ("import sys, tempfile; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
            "import vllm_cpu_env; d = vllm_cpu_env.temporary_folder('moet-x-'); "
            "(d / 'link').symlink_to(sys.argv[2]); (d / 'sub').mkdir(); (d / 'sub' / 'f').write_text('ours'); "
            "print(d)")
    out = subprocess.run([sys.executable, "-c", code, str(TESTS), str(keep)], capture_output=True, text=True,
                         env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=60, check=True).stdout
    made = Path(out.strip())
    assert made.parent == tmp_path and made.name.startswith("moet-x-")
    assert not made.exists()
    assert (keep / "file").read_text() == "not ours"  # the link's target is untouched


@pytest.mark.slow  # a pytest run with two workers: tens of seconds on two busy cores
@pytest.mark.skipif(vllm_cpu_env.vllm_cpu_version() is None,
                    reason="early() and bin_without_vllm make no folder without vllm-cpu installed")
def test_a_pytest_run_leaves_no_folder_of_ours_in_its_temporary_directory(tmp_path: Path) -> None:
    """pytest with two xdist workers on a test module that takes a PATH without vLLM at import: the controller
    and each worker make their vLLM folder (conftest's early()), each worker its PATH folder; none is left."""
    assert (BIN / "vllm").exists()  # vllm-cpu's script: bin_without_vllm makes its folder of links
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # the run's own vLLM folders: this process's would be inherited and none made
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_CACHE_ROOT", "VLLM_RPC_BASE_PATH", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS")}
    env["TMPDIR"] = str(tmp)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                          f"--basetemp={tmp_path / 'basetemp'}", str(TESTS / "test_serve.py"),
                          "-k", "test_every_profile_flag_is_documented"],
                         capture_output=True, text=True, env=env, cwd=TESTS.parent, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
    assert sorted(p.name for p in tmp.iterdir()) == []
    assert (BIN / "vllm").exists() and (BIN / "moet-cache").exists()  # the links' targets are untouched
