"""plan and serve agree, plan's advice is possible, serve checks vLLM's interpreter.

Each test failed on the main of 2026-12-03. Real caches, real console-script processes
where the environment matters (PATH, a fake nvidia-smi, a second interpreter with a stub vLLM).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import venv
from dataclasses import replace
from pathlib import Path

import pytest
import vllm_cpu_env

from moet_cache import BuildOptions, build_cache, make_checkpoint, small_spec
from moet_cache.errors import InputError
from moet_cache.serve import (PRESETS, TORCH_PIN, VLLM_PIN, Flag, OptionTable, check_plugin_env,
                              check_reasoning_effort, get_preset, settings_from_argv)
from moet_cache.plan import (CACHE, GPU_PRESETS, GpuPreset, PlanSettings, footprint_from_cache, make_plan,
                             thin_margin)

ROOT = Path(__file__).parents[1]
BIN = Path(sys.executable).parent
MOET = shutil.which("moet-cache", path=str(BIN)) or str(BIN / "moet-cache")
PATH_BIN = vllm_cpu_env.bin_without_vllm(BIN)
MIB = 1 << 20


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("agree")
    src = make_checkpoint(d / "DeepSeek-Tiny-NVFP4", small_spec(n_routed_experts=8, num_hidden_layers=3))
    build_cache(src, d / "cache", BuildOptions(delta_budget="25%"))
    return d / "cache"


def _env(*extra: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM", "MOET_CACHE"))}
    env["PATH"] = os.pathsep.join([*map(str, extra), str(PATH_BIN), "/usr/bin", "/bin"])
    return env


def _run(args: list[str], *extra: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MOET, *args], capture_output=True, text=True, env=_env(*extra), timeout=300)


def _smi(tmp_path: Path, mib: int = 97887) -> Path:
    d = tmp_path / "smi"
    d.mkdir(exist_ok=True)
    (d / "nvidia-smi").write_text(f"#!/bin/sh\necho 'NVIDIA RTX PRO 6000 Blackwell Workstation Edition, {mib}'\n")
    (d / "nvidia-smi").chmod(0o755)
    return d


# --- item 11: the same syntax and the same GPU in plan and serve ------------------------------------------

def test_plan_reads_contexts_and_capture_sizes_as_vllm_does(cache: Path) -> None:
    r = _run(["plan", str(cache), "--json", "--max-model-len", "128k", "--cudagraph-capture-sizes", "1", "2", "4", "8"])
    assert r.returncode in (0, 1), r.stderr
    doc = json.loads(r.stdout)
    assert doc["settings"]["max_model_len"] == 128_000
    assert doc["settings"]["cudagraph_capture_sizes"] == [1, 2, 4, 8]
    binary = json.loads(_run(["plan", str(cache), "--json", "--max-model-len", "128K"]).stdout)
    assert binary["settings"]["max_model_len"] == 131_072                  # vLLM: K is 1024, k is 1000
    # serve reads the same flag the same way
    s = settings_from_argv(["vllm", "serve", "m", "--max-model-len", "128K"], GPU_PRESETS["h200"])
    assert s.max_model_len == 131_072


def test_plan_uses_the_gpu_nvidia_smi_sees_like_serve(cache: Path, tmp_path: Path) -> None:
    doc = json.loads(_run(["plan", str(cache), "--json", "--max-model-len", "4096"], _smi(tmp_path, 81559)).stdout)
    assert doc["gpu"]["name"] == "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"
    assert doc["gpu"]["total_bytes"] == 81559 * MIB
    none = json.loads(_run(["plan", str(cache), "--json", "--max-model-len", "4096"]).stdout)
    assert none["gpu"]["name"] == "rtx-pro-6000" and "no GPU seen" in none["gpu"]["note"]


# --- item 11: the deciding term, possible suggestions, thin margins -----------------------------------------

def test_the_deciding_term_is_the_cuda_graph_reserve_when_it_decides(cache: Path) -> None:
    fp = footprint_from_cache(cache)
    # 200 MiB usable: the synthetic weights are a few MiB, 4 capture sizes reserve 256 MiB.
    p = make_plan(fp, PlanSettings(gpu=GpuPreset("small", 200 * MIB, ""), utilization=1.0, max_model_len=4096,
                                   activation_reserve=0))
    assert not p.fits and p.static > p.budget
    assert "CUDA-graph reserve" in p.deciding and "dense" not in p.deciding


def test_suggestions_stay_inside_the_model_and_the_attention(cache: Path) -> None:
    fp = footprint_from_cache(cache)
    mpe = fp.model["max_position_embeddings"]
    # Room for ~1M tokens of KV, asked for 10M: the context suggestion must not pass max_position_embeddings.
    s = PlanSettings(gpu=GpuPreset("g", 2 * 1024 * MIB, ""), utilization=1.0, max_model_len=10_000_000,
                     kv_cache_dtype="auto", activation_reserve=0, cudagraph_sizes=())
    p = make_plan(fp, s)
    assert not p.fits
    ctx = [x for x in p.suggestions if x.change == "context"]
    assert ctx and int(ctx[0].setting.split()[-1]) <= mpe
    # A dense-MLA model (no sparse indexer) is never offered fp8_ds_mla or nvfp4_ds_mla.
    for x in p.suggestions:
        if x.change == "kv-cache-dtype":
            assert x.setting.split()[-1] in fp.attention.kv_dtypes and "ds_mla" not in x.setting
    # A tier change is a change to the cache, said as such; never a serve flag.
    full = fp.with_tier(fp.total_experts * fp.expert_delta_bytes)
    need = make_plan(full, replace(s, max_model_len=mpe)).need
    tier = make_plan(full, replace(s, max_model_len=mpe, gpu=GpuPreset("g", need - full.delta_tier_bytes // 2, "")))
    changes = [x for x in tier.suggestions if "--delta-budget" in x.setting]
    assert changes and all(x.where == CACHE and x.advice().startswith("moet-cache retier") for x in changes)


def test_a_margin_of_half_a_mib_is_not_called_fits_without_a_warning(cache: Path) -> None:
    fp = footprint_from_cache(cache)
    s = PlanSettings(gpu=GpuPreset("g", GIB_ := 1 << 30, ""), utilization=1.0, max_model_len=4096)
    need = make_plan(fp, s).need
    p = make_plan(fp, replace(s, gpu=GpuPreset("exact", need + MIB // 2, "")))
    assert p.fits and p.margin == MIB // 2 and p.thin
    assert any("0.5 MiB" in w for w in p.warnings) and thin_margin(p.budget) >= 256 * MIB
    assert not make_plan(fp, replace(s, gpu=GpuPreset("big", need + GIB_, ""))).thin


# --- item 11: serve carries plan's warnings -------------------------------------------------------------------

def test_serve_repeats_the_plans_warnings_even_without_a_gpu(cache: Path, tmp_path: Path) -> None:
    r = _run(["serve", str(cache), "--dry-run", "--", "--max-model-len", "8192"])
    assert r.returncode == 0, r.stderr
    assert "exceeds the model's max_position_embeddings 4096" in r.stderr
    # With a GPU and a thin margin, the thin-margin warning too; a cache change is said as a command.
    r = _run(["serve", str(cache), "--dry-run", "--", "--gpu-memory-utilization", "0.05",
              "--max-model-len", "10000000"], _smi(tmp_path))
    assert "do not fit" in r.stderr and "nearest:" in r.stderr
    assert "nearest: --delta-budget" not in r.stderr and "; --delta-budget" not in r.stderr


# --- item 12: serve's checks of vLLM's interpreter --------------------------------------------------------------

STUB_ARGS = '''
import argparse
def make_arg_parser(p):
    for name in ("--tensor-parallel-size", "--gpu-memory-utilization", "--max-model-len", "--kv-cache-dtype",
                 "--block-size", "--load-format", "--model-loader-extra-config", "--served-model-name",
                 "--reasoning-parser", "--reasoning-parser-plugin", "--tool-call-parser", "--tool-parser-plugin",
                 "--default-chat-template-kwargs", "--tokenizer-mode", "--max-num-batched-tokens"):
        p.add_argument(name)
    p.add_argument("--cudagraph-capture-sizes", nargs="+")
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("model_tag", nargs="?")
    return p
'''


def _stub_vllm_env(tmp_path: Path, with_moet: bool) -> Path:
    """A second interpreter (a venv without moet-cache) whose `vllm` is a stub with vLLM's parser entry points."""
    env = tmp_path / ("vllm-env-moet" if with_moet else "vllm-env")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env)
    site = next((env / "lib").glob("python3*/site-packages"))
    pkg = site / "vllm"
    for sub in ("utils", "entrypoints/common"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('__version__ = "0.34.0"\n')
    (pkg / "utils" / "__init__.py").write_text("")
    (pkg / "utils" / "argparse_utils.py").write_text("from argparse import ArgumentParser as FlexibleArgumentParser\n")
    (pkg / "entrypoints" / "__init__.py").write_text("")
    (pkg / "entrypoints" / "common" / "__init__.py").write_text("")
    (pkg / "entrypoints" / "common" / "cli_args.py").write_text(STUB_ARGS)
    if with_moet:  # importable through a path entry, but not installed: no entry point
        (site / "moet.pth").write_text(str(ROOT) + "\n")
    exe = env / "bin" / "vllm"
    exe.write_text(f"#!{env / 'bin' / 'python'}\nimport sys\nsys.exit(7)\n")
    exe.chmod(0o755)
    return env / "bin"


def test_serve_checks_that_moet_imports_where_vllm_runs(cache: Path, tmp_path: Path) -> None:
    bin_ = _stub_vllm_env(tmp_path, with_moet=False)
    r = _run(["serve", str(cache)], bin_)
    assert r.returncode == 3, r.stderr
    assert "does not import in vLLM's interpreter" in r.stderr
    assert f"{bin_ / 'python'} -m pip install" in r.stderr                     # how to install it there
    d = _run(["serve", str(cache), "--dry-run"], bin_)                           # a dry run still prints it
    assert d.returncode == 0 and "serve" in d.stdout and "does not import" in d.stderr
    bin2 = _stub_vllm_env(tmp_path, with_moet=True)    # moet_cache on the path, its dependencies not
    r = _run(["serve", str(cache)], bin2)
    assert r.returncode == 3 and "does not import" in r.stderr and "ModuleNotFoundError" in r.stderr
    # Importable but not installed (no entry point): vLLM would not load the moet loader either.
    table = OptionTable("0.34.0", "/x/python", {}, {"moet_cache": "/x/moet_cache/__init__.py", "entry_point": None})
    assert "entry point is not registered" in check_plugin_env(table)[0]
    ok = {"moet_cache": "m", "entry_point": "moet_cache.integrations.vllm.plugin:register", "moet_quant": True}
    assert check_plugin_env(replace(table, environment=ok)) == []
    old = check_plugin_env(replace(table, environment={**ok, "moet_quant": False}))
    import importlib.util
    assert bool(old) == (importlib.util.find_spec("moet_cache.integrations.vllm.method") is not None)   # an older install there


def test_dry_run_prints_the_command_when_vllm_is_broken(cache: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "broken"
    d.mkdir()
    (d / "vllm").write_text(f"#!{sys.executable}\nraise SystemExit(1)\n")   # our interpreter, a vllm that does not import
    (d / "vllm").chmod(0o755)
    monkeypatch.setenv("PYTHONPATH", str(vllm_cpu_env.vllm_site(tmp_path / "site", broken=True)))
    r = _run(["serve", str(cache), "--dry-run", "--json"], d)
    refused = _run(["serve", str(cache)], d)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["argv"][1] == "serve" and doc["flags_checked"] is False
    assert any("cannot load vLLM's argument parser" in w for w in doc["warnings"])
    assert refused.returncode == 3                                               # not a dry run: still refused


def test_tested_versions_are_stated_and_pinnable() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = meta["optional-dependencies"]["vllm"]
    assert f"vllm=={VLLM_PIN}" in extra and f"torch=={TORCH_PIN}" in extra
    torch_req = next(d for d in meta["dependencies"] if d.startswith("torch"))
    assert "<2.15" in torch_req                                                  # admits vLLM's 2.14 pin
    constraints = (ROOT / "constraints" / f"vllm-{VLLM_PIN}.txt").read_text().split()
    assert f"vllm=={VLLM_PIN}" in constraints and f"torch=={TORCH_PIN}" in constraints
    for doc in ("README.md", "docs/SERVING.md"):
        text = (ROOT / doc).read_text()
        assert f"vLLM {VLLM_PIN}" in text and f"torch {TORCH_PIN}" in text, doc


# --- the serve preset: one word, chosen from the model type, V4's rules --------------------------------------

def test_presets_are_presets_and_v4_gets_its_own(cache: Path) -> None:
    r = _run(["serve", str(cache), "--dry-run", "--json"])
    doc = json.loads(r.stdout)
    assert doc["preset"] == "single-gpu-96g" and "profile" not in doc
    v4 = get_preset("auto", "deepseek_v4")
    flags = dict(v4.flags)
    assert v4.name == "v4-flash-96g" and flags["--tokenizer-mode"] == ("deepseek_v4",)
    assert flags["--kv-cache-dtype"] == ("fp8",) and flags["--block-size"] == ("256",)
    assert json.loads(flags["--default-chat-template-kwargs"][0]) == {"thinking": True}
    assert get_preset("auto", "deepseek_v3") is PRESETS["single-gpu-96g"]
    for text in [(ROOT / "cli" / "serve.py").read_text(),
                 *(f.read_text() for f in sorted((ROOT / "moet_cache" / "serve").glob("*.py")))]:
        assert "profile" not in text.replace('"profile" means a routing profile', "")


def test_reasoning_effort_max_needs_393216_tokens_on_v4() -> None:
    def flags(ctx: str, effort: str) -> list[Flag]:
        return [Flag("--max-model-len", (ctx,)),
                Flag("--default-chat-template-kwargs", (json.dumps({"thinking": True, "reasoning_effort": effort}),))]
    with pytest.raises(InputError, match=r'reasoning_effort "max" needs --max-model-len of at least 393,216'):
        check_reasoning_effort(flags("260000", "max"), "deepseek_v4")
    check_reasoning_effort(flags("384K", "max"), "deepseek_v4")                # 393,216 exactly
    check_reasoning_effort(flags("260000", "high"), "deepseek_v4")
    check_reasoning_effort(flags("260000", "max"), "deepseek_v3")              # V4's rule only
