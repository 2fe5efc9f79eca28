"""serve on more than one GPU and more than one node: the flags reach vLLM's command, the split is checked
as plan checks it, plan and serve read the same presets, and a dry run prints each node's command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import vllm_cpu_env

from moet_cache import BuildOptions, build_cache
from moet_cache.plan.kv_v4 import V4_ATTENTION_MAJORS
from moet_cache.plan.parallel import Parallel
from moet_cache.serve import (PRESETS, VllmProbe, preset_plan_settings, settings_from_argv, split_flags,
                              vllm_python)
from moet_cache.source.synthetic import make_v4_checkpoint, small_v4_spec
from moet_cache.plan import GPU_PRESETS, attention_from_config

BIN = Path(sys.executable).parent
MOET = shutil.which("moet-cache", path=str(BIN)) or str(BIN / "moet-cache")


@pytest.fixture(scope="module")
def v4_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("serve-par")
    # experts 1,024 wide: at tensor parallel 2 a rank's 512 columns are what the plane kernels take
    src = make_v4_checkpoint(d / "DeepSeek-V4-Tiny", small_v4_spec("hybrid", mtp_blocks=0, num_nextn_predict_layers=0,
                                                                   moe_intermediate_size=1024))
    build_cache(src, d / "cache", BuildOptions(delta_budget="25%"))
    return d / "cache"


def _serve(cache: Path, *args: str, json_out: bool = True) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.pathsep.join([str(vllm_cpu_env.bin_without_vllm(BIN)), "/usr/bin", "/bin"]),
           "HOME": os.environ.get("HOME", "/tmp")}
    extra = ["--json"] if json_out else []
    return subprocess.run([MOET, "serve", str(cache), "--dry-run", *extra, *args], capture_output=True, text=True,
                          timeout=300, env=env)


def _opt(argv: list[str], flag: str) -> list[str] | None:
    found = [f.values for f in split_flags(argv) if f.option == flag]
    return list(found[-1]) if found else None


def test_serve_passes_tensor_and_expert_parallelism_to_vllm(v4_cache: Path) -> None:
    r = _serve(v4_cache, "--", "--tensor-parallel-size", "2", "--enable-expert-parallel")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    flags = doc["argv"][3:]
    assert _opt(flags, "--tensor-parallel-size") == ["2"] and _opt(flags, "--enable-expert-parallel") == []
    assert settings_from_argv(doc["argv"], GPU_PRESETS["rtx-pro-6000"]).parallel == Parallel(2, True)
    assert doc["nodes"] == [] and doc["verify_each_node"] is None


def test_serve_refuses_a_split_the_planes_do_not_allow_in_one_line(v4_cache: Path) -> None:
    r = _serve(v4_cache, "--", "--tensor-parallel-size", "4")    # the tiny model has 2 output groups
    assert r.returncode == 2
    assert json.loads(r.stdout)["error"] == "--tensor-parallel-size 4 does not divide DeepSeek-V4's 2 output groups (o_groups)"
    r = _serve(v4_cache, "--", "-tp", "3")
    assert r.returncode == 2 and json.loads(r.stdout)["error"].startswith("--tensor-parallel-size 3: the moet method takes")


def test_plan_and_serve_read_the_same_multi_gpu_presets(v4_cache: Path) -> None:
    """The two-card and four-card presets: serve's command carries their split, plan plans that split on their
    card, and their card runs V4's attention in vLLM 0.34."""
    cfg = json.loads((v4_cache / "model" / "config.json").read_text())
    for name, size in (("v4-flash-2x96g", 2), ("v4-flash-4x32g", 4)):
        preset = PRESETS[name]
        assert GPU_PRESETS[preset.gpu].capability[0] in V4_ATTENTION_MAJORS
        _, planned = preset_plan_settings(cfg, GPU_PRESETS[preset.gpu], name)
        assert planned.parallel == Parallel(size)
        if size == 2:   # the tiny model allows 1 and 2
            r = _serve(v4_cache, "--settings", name)
            assert r.returncode == 0, r.stderr
            served = settings_from_argv(json.loads(r.stdout)["argv"], GPU_PRESETS[preset.gpu])
            assert served == planned
    assert attention_from_config(cfg).kind == "deepseek_v4"


def test_a_dry_run_prints_each_nodes_command(v4_cache: Path) -> None:
    """--nnodes 2: vLLM's own multi-node launch, the same command on both nodes with its --node-rank, the
    second --headless; each node verifies its copy of the cache first."""
    r = _serve(v4_cache, "--", "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "10.0.0.1")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    nodes = doc["nodes"]
    assert [n["node_rank"] for n in nodes] == [0, 1]
    head, worker = (n["argv"][3:] for n in nodes)
    assert _opt(head, "--node-rank") == ["0"] and _opt(head, "--headless") is None
    assert _opt(worker, "--node-rank") == ["1"] and _opt(worker, "--headless") == []
    for argv in (head, worker):
        assert _opt(argv, "--nnodes") == ["2"] and _opt(argv, "--master-addr") == ["10.0.0.1"]
        assert _opt(argv, "--tensor-parallel-size") == ["2"]
    assert [n["argv"][:3] for n in nodes] == [doc["argv"][:3]] * 2
    assert doc["verify_each_node"] == f"moet-cache verify {doc['cache']}"
    human = _serve(v4_cache, "--", "-tp", "2", "--nnodes", "2", "--master-addr", "10.0.0.1", json_out=False)
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    assert any(x.startswith("node 0 (head: the API server): ") and "--node-rank 0" in x for x in lines)
    assert any(x.startswith("node 1: ") and x.endswith("--node-rank 1 --headless") for x in lines)
    assert f"moet-cache verify {doc['cache']}" in human.stdout


@pytest.mark.parametrize(("args", "line"), [
    (["--nnodes", "2", "-tp", "2"], "--nnodes 2 needs --master-addr: the address of node 0, which every node reaches"),
    (["--nnodes", "2", "-tp", "2", "--master-addr", "h", "--distributed-executor-backend", "ray"],
     "--nnodes 2 with --distributed-executor-backend ray: vLLM 0.34 starts nodes itself only with its "
     "multiprocessing backend"),
    (["--nnodes", "4", "-tp", "2", "--master-addr", "h"],
     "--nnodes 4 does not divide the 2 GPUs of tensor parallel 2 x pipeline parallel 1"),
])
def test_a_multi_node_command_vllm_would_refuse_is_refused_in_one_line(v4_cache: Path, args: list[str],
                                                                       line: str) -> None:
    r = _serve(v4_cache, "--", *args)
    assert r.returncode == 2 and json.loads(r.stdout)["error"] == line


@pytest.mark.vllm
def test_vllms_own_parser_accepts_each_nodes_command(v4_cache: Path) -> None:
    """Each node's command, parsed by the installed vLLM's own `vllm serve` parser (vLLM 0.34 under
    MOET_CACHE_VLLM_BIN, else the vllm-cpu CI installs beside the tests): the flags and their values exist."""
    folder = os.environ.get("MOET_CACHE_VLLM_BIN")
    exe = shutil.which("vllm", path=folder) if folder else shutil.which("vllm", path=str(BIN))
    if exe is None:
        pytest.skip("vLLM is not installed (set MOET_CACHE_VLLM_BIN to its bin folder)")
    r = _serve(v4_cache, "--", "-tp", "2", "--enable-expert-parallel", "--nnodes", "2", "--master-addr", "10.0.0.1")
    assert r.returncode == 0, r.stderr
    for node in json.loads(r.stdout)["nodes"]:
        probe = VllmProbe(vllm_python(exe))
        try:
            probe.table()
            assert probe.parse(node["argv"][2:]) is None, node["shell"]   # after `vllm serve`
        finally:
            probe.close()


def test_plan_and_serve_read_the_cards_compute_capability_from_nvidia_smi(v4_cache: Path, tmp_path: Path) -> None:
    """A fake nvidia-smi answers as an L40S does (name and memory, then `--query-gpu=compute_cap`): plan says
    vLLM refuses V4's attention there, and serve's plan repeats it; a card reporting 12.0 is planned by memory."""
    for cc, refused in (("8.9", True), ("12.0", False)):
        d = tmp_path / cc
        d.mkdir()
        smi = d / "nvidia-smi"
        smi.write_text("#!/bin/sh\ncase \"$1\" in --query-gpu=compute_cap) echo '%s' ;; "
                       "*) echo 'NVIDIA L40S, 46068' ;; esac\n" % cc)
        smi.chmod(0o755)
        path = os.pathsep.join([str(d), str(vllm_cpu_env.bin_without_vllm(BIN)), "/usr/bin", "/bin"])
        r = subprocess.run([MOET, "plan", str(v4_cache), "--json", "-tp", "2"], capture_output=True, text=True,
                           timeout=300, env={"PATH": path})
        doc = json.loads(r.stdout)
        assert doc["gpu"]["name"] == "NVIDIA L40S" and doc["parallel"]["tensor_parallel_size"] == 2
        line = "the NVIDIA L40S is 8.9, where vLLM refuses it"
        assert (r.returncode == 1 and line in doc["deciding"]) if refused else (r.returncode == 0 and doc["fits"])
        s = subprocess.run([MOET, "serve", str(v4_cache), "--dry-run", "--", "-tp", "2"], capture_output=True,
                           text=True, timeout=300, env={"PATH": path, "HOME": str(tmp_path)})
        assert s.returncode == 0, s.stderr
        assert (line in s.stderr) is refused
