"""Optional: vLLM's own argument parser checks the command that `serve` builds (needs vLLM installed).

vLLM may live in another environment: put its `vllm` on PATH, or name its bin folder in
MOET_CACHE_VLLM_BIN (e.g. /tmp/vllmvenv/bin). vLLM's parser imports on a CPU machine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import vllm_cpu_env

from moet_cache import BuildOptions, build_cache, make_checkpoint, small_spec
from moet_cache.cli.app import main
from moet_cache.serve import VLLM_PIN

pytestmark = pytest.mark.vllm


def _vllm_bin() -> str:
    return str(Path(vllm_cpu_env.vllm034_exe()).parent)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("vllm")
    src = make_checkpoint(d / "src", small_spec(n_routed_experts=8, num_hidden_layers=3))
    build_cache(src, d / "cache", BuildOptions(delta_budget="25%"))
    return d / "cache"


def test_vllms_own_parser_accepts_the_command_and_names_what_it_refuses(
        cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _vllm_bin()
    monkeypatch.setenv("PATH", os.pathsep.join([folder, os.environ.get("PATH", "")]))
    assert main(["serve", "--dry-run", "--json", str(cache), "--", "--cuda-graph-sizes", "1", "2",
                 "-tp", "1", "--max-model-len", "32k"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["flags_checked"] is True and doc["vllm_version"] == VLLM_PIN
    argv = doc["argv"]
    assert argv[0] == str(Path(folder) / "vllm")
    assert argv[argv.index("--cudagraph-capture-sizes") + 1:][:2] == ["1", "2"]
    assert "--cuda-graph-sizes" not in argv and "--tensor-parallel-size" not in argv  # -tp replaced it
    # An unknown flag is named; a bad value gets vLLM's own message.
    assert main(["serve", "--dry-run", str(cache), "--", "--no-such-flag", "3"]) == 2
    assert "has no flag --no-such-flag" in capsys.readouterr().err
    assert main(["serve", "--dry-run", str(cache), "--", "--tensor-parallel-size", "two"]) == 2
    err = capsys.readouterr().err
    assert "refuses the command" in err and "invalid int value: 'two'" in err
