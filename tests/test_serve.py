"""moet-cache serve: the command from profiles and overrides, refusals, and a real exec of a fake vllm."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import vllm_cpu_env
from typer.testing import CliRunner

from moet_cache import BuildOptions, build_cache, make_checkpoint, small_spec
from moet_cache.cli.app import app, main
from moet_cache.serve import (PRESETS, Flag, OptionInfo, OptionTable, adapt_renames, merge_flags,
                              split_flags)

BIN = Path(sys.executable).parent
MOET = shutil.which("moet-cache", path=str(BIN)) or str(BIN / "moet-cache")


PATH_BIN = vllm_cpu_env.bin_without_vllm(BIN)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("serve")
    src = make_checkpoint(d / "DeepSeek-Tiny-NVFP4", small_spec(n_routed_experts=8, num_hidden_layers=3))
    build_cache(src, d / "cache", BuildOptions(delta_budget="25%"))
    return d / "cache"


@pytest.fixture
def cache_copy(served: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(served, tmp_path / "cache"))


def _env(extra_path: Path | None = None) -> dict[str, str]:
    """Our console script on PATH, no real vLLM, no nvidia-smi (so the run does not depend on the host)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM", "MOET_CACHE"))}
    env["PATH"] = os.pathsep.join(([str(extra_path)] if extra_path else []) + [str(PATH_BIN), "/usr/bin", "/bin"])
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MOET, *args], capture_output=True, text=True, env=env, timeout=120)


def _main(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
          extra_path: Path | None = None) -> tuple[int, str, str]:
    """The console script's main() in this process: the real exit-code table, without a torch import."""
    for k in [k for k in os.environ if k.startswith("VLLM")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("PATH", _env(extra_path)["PATH"])
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def _dry_json(args: list[str], monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setenv("PATH", os.pathsep.join([str(PATH_BIN), "/usr/bin", "/bin"]))
    r = CliRunner().invoke(app, ["serve", "--dry-run", "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _flags(argv: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in split_flags(argv[3:]):
        assert f.option not in out, f"{f.option} appears twice"
        out[f.option] = list(f.values)
    return out


# --- dry runs ---------------------------------------------------------------------------------------

def test_dry_run_default_preset_fitted_to_the_model(served: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = _dry_json([str(served)], monkeypatch)
    argv = doc["argv"]
    assert argv[:3] == ["vllm", "serve", str((served / "model").resolve())]
    f = _flags(argv)
    assert f["--tensor-parallel-size"] == ["1"] and f["--gpu-memory-utilization"] == ["0.96"]
    # The preset's 260K and fp8_ds_mla, fitted to this model: 4,096 positions, no sparse indexer.
    assert f["--max-model-len"] == ["4096"] and f["--kv-cache-dtype"] == ["fp8"]
    assert f["--block-size"] == ["256"] and f["--cudagraph-capture-sizes"] == ["1", "2", "4", "8"]
    assert json.loads(f["--default-chat-template-kwargs"][0]) == {"thinking": True}
    assert "--speculative-config" not in f
    assert f["--load-format"] == ["moet"]
    assert json.loads(f["--model-loader-extra-config"][0]) == {"cache": str(served.resolve())}
    assert f["--served-model-name"] == ["DeepSeek-Tiny-NVFP4"]
    plugin = str((Path(__file__).parents[1] / "moet_cache" / "integrations" / "vllm" / "parsers.py").resolve())
    assert f["--reasoning-parser"] == ["moet_deepseek"] and f["--reasoning-parser-plugin"] == [plugin]
    assert f["--tool-call-parser"] == ["moet_deepseek"] and f["--tool-parser-plugin"] == [plugin]
    assert f["--enable-auto-tool-choice"] == []
    assert doc["boot_state"] == "verified" and doc["flags_checked"] is False
    assert any("not checked" in w for w in doc["warnings"])


def test_by_default_vllm_computes_on_the_planes_and_stock_is_explicit(served: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Default: the model folder's config.json names the moet method (plan's VRAM), no expansion asked.
    cfg = json.loads((served / "model" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "moet"
    doc = _dry_json([str(served)], monkeypatch)
    f = _flags(doc["argv"])
    assert "--hf-overrides" not in f and "expand" not in json.loads(f["--model-loader-extra-config"][0])
    assert not any("--stock" in w for w in doc["warnings"])
    # --stock: vLLM gets the source's own quantization block and the loader expands the planes; it warns.
    doc = _dry_json([str(served), "--stock"], monkeypatch)
    f = _flags(doc["argv"])
    assert json.loads(f["--hf-overrides"][0]) == {"quantization_config": cfg["quantization_config"]["source"]}
    assert json.loads(f["--model-loader-extra-config"][0])["expand"] is True
    assert any("FP4 size in VRAM" in w for w in doc["warnings"])


def test_dry_run_overrides_replace_the_profile_and_renames_are_adapted(served: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    doc = _dry_json([str(served), "--", "--max-model-len", "32768", "--cuda-graph-sizes", "1", "2",
                     "--max_num_seqs=4", "--enable-prefix-caching"], monkeypatch)
    f = _flags(doc["argv"])
    assert f["--max-model-len"] == ["32768"]
    assert f["--cudagraph-capture-sizes"] == ["1", "2"] and "--cuda-graph-sizes" not in f
    assert f["--max-num-seqs"] == ["4"] and f["--enable-prefix-caching"] == []
    assert f["--kv-cache-dtype"] == ["fp8"]                 # untouched preset flags stay
    # The override takes the profile flag's place, not the end of the line.
    assert doc["argv"].index("--max-model-len") < doc["argv"].index("--kv-cache-dtype")
    assert any("--cuda-graph-sizes is now --cudagraph-capture-sizes" in n for n in doc["notes"])


def test_dry_run_other_profile_and_human_output(served: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = _flags(_dry_json([str(served), "--settings", "eager-debug"], monkeypatch)["argv"])
    assert f["--enforce-eager"] == [] and "--cudagraph-capture-sizes" not in f
    assert f["--max-model-len"] == ["4096"]                 # 32768, capped at the model's positions
    monkeypatch.setenv("VLLM_PLUGINS", "other_plugin")
    r = CliRunner().invoke(app, ["serve", str(served), "--dry-run"])
    assert r.exit_code == 0, r.output
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("VLLM_PLUGINS=other_plugin,moet_cache vllm serve ")
    assert "--load-format moet" in last and "'{\"thinking\": true}'" in last


def test_every_profile_flag_is_documented() -> None:
    doc = (Path(__file__).parents[1] / "docs" / "SERVING.md").read_text()
    for p in PRESETS.values():
        assert f"`{p.name}`" in doc
        for opt, values in p.flags + p.drafter_flags:
            assert " ".join([opt, *values]) in doc, (p.name, opt)


# --- refusals -------------------------------------------------------------------------------------------

def test_no_vllm_is_exit_2_with_the_install_command(served: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _main(["serve", str(served)], monkeypatch, capsys)
    assert code == 2
    assert "vLLM is not installed" in err and "[vllm]" in err


def test_corrupt_and_incomplete_caches_are_refused_unless_forced(cache_copy: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    base = cache_copy / "layers" / "layer-001.base.safetensors"
    with open(base, "r+b") as fh:
        fh.truncate(base.stat().st_size - 1)
    code, _, err = _main(["serve", str(cache_copy), "--dry-run"], monkeypatch, capsys)
    assert code == 1 and "corrupt" in err and "layer-001.base.safetensors" in err
    code, out, err = _main(["serve", str(cache_copy), "--dry-run", "--force"], monkeypatch, capsys)
    assert code == 0 and "--force" in err and "vllm serve" in out
    (cache_copy / "COMMIT.json").unlink()
    code, _, err = _main(["serve", str(cache_copy), "--dry-run"], monkeypatch, capsys)
    assert code == 1 and "incomplete" in err


def test_a_changed_file_makes_the_loader_hash_every_tensor(cache_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = cache_copy / "layers" / "layer-002.base.safetensors"
    data = bytearray(base.read_bytes())
    data[-1] ^= 0xFF  # same size, new bytes: the boot check sees a change, not the damage
    base.write_bytes(bytes(data))
    doc = _dry_json([str(cache_copy)], monkeypatch)
    assert doc["boot_state"] == "unverified"
    extra = json.loads(_flags(doc["argv"])["--model-loader-extra-config"][0])
    assert extra == {"cache": str(cache_copy.resolve()), "verify": "hash"}
    # The contract with the loader plugin: it takes this extra config as it stands.
    from moet_cache.integrations.vllm.loader import LOAD_FORMAT, PluginOptions
    opts = PluginOptions.from_extra(extra)
    assert opts.verify == "hash" and opts.cache == str(cache_copy.resolve())
    assert _flags(doc["argv"])["--load-format"] == [LOAD_FORMAT]
    assert any("hash every tensor" in w for w in doc["warnings"])


# --- the exec, for real ---------------------------------------------------------------------------------

FAKE_VLLM = """#!{python}
import json, os, sys
with open({record!r}, "w") as f:
    json.dump({{"argv": sys.argv, "pid": os.getpid(), "env": dict(os.environ)}}, f)
sys.exit(7)
"""


def _fake_vllm(tmp_path: Path) -> tuple[Path, Path]:
    d = tmp_path / "fakebin"
    d.mkdir()
    record = tmp_path / "record.json"
    exe = d / "vllm"
    exe.write_text(FAKE_VLLM.format(python=sys.executable, record=str(record)))
    exe.chmod(0o755)
    return d, record


def test_serve_execs_vllm_with_the_command_and_environment(served: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    fakebin, record = _fake_vllm(tmp_path)
    site = str(vllm_cpu_env.vllm_site(tmp_path / "site"))
    monkeypatch.setenv("VLLM_PLUGINS", "x")
    monkeypatch.setenv("PATH", _env(fakebin)["PATH"])
    monkeypatch.setenv("PYTHONPATH", site)
    assert main(["serve", "--skip-flag-check", "--dry-run", "--json", str(served), "--", "--max-num-seqs", "2"]) == 0
    expected = json.loads(capsys.readouterr().out)["argv"]
    env = _env(fakebin) | {"VLLM_PLUGINS": "x", "PYTHONPATH": site}
    proc = subprocess.Popen([MOET, "serve", str(served), "--skip-flag-check", "--", "--max-num-seqs", "2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 7, err                         # vLLM's exit code is ours: we were replaced
    rec = json.loads(record.read_text())
    assert rec["pid"] == proc.pid                            # the same process: exec, not a child
    assert expected[0] == str(fakebin / "vllm")
    assert rec["argv"] == expected
    assert rec["env"]["VLLM_PLUGINS"] == "x,moet_cache" and rec["env"]["PATH"] == env["PATH"]
    assert "not checked against vLLM's parser" in err


def test_a_vllm_whose_parser_cannot_load_is_an_environment_error(served: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    fakebin, record = _fake_vllm(tmp_path)  # its interpreter is ours, with a vllm package that does not import
    monkeypatch.setenv("PYTHONPATH", str(vllm_cpu_env.vllm_site(tmp_path / "site", broken=True)))
    code, _, err = _main(["serve", str(served)], monkeypatch, capsys, fakebin)
    assert code == 3 and "cannot load vLLM's argument parser" in err
    assert "--skip-flag-check" in err and not record.exists()


# --- flag handling without vLLM (pure functions) ----------------------------------------------------------

def test_split_merge_and_renames_with_an_option_table() -> None:
    table = OptionTable("9.9", "python", {
        "--tensor-parallel-size": OptionInfo("tensor_parallel_size", None),
        "-tp": OptionInfo("tensor_parallel_size", None),
        "--cuda-graph-sizes": OptionInfo("cuda_graph_sizes", "+"),
        "--enforce-eager": OptionInfo("enforce_eager", 0),
        "--max-model-len": OptionInfo("max_model_len", None),
    })
    base = [Flag("--tensor-parallel-size", ("1",)), Flag("--cudagraph-capture-sizes", ("1", "2"))]
    flags, notes = adapt_renames(base, table)          # an older vLLM that only knows the old name
    assert flags[1] == Flag("--cuda-graph-sizes", ("1", "2")) and "knows --cudagraph-capture-sizes" in notes[0]
    user = split_flags(["-tp", "2", "--enforce-eager", "--max_model_len", "-1"], table)
    assert user == [Flag("-tp", ("2",)), Flag("--enforce-eager", ()), Flag("--max-model-len", ("-1",))]
    merged = merge_flags(flags, user, table)
    assert merged[0] == Flag("-tp", ("2",)) and len(merged) == 4   # same dest: replaced, not repeated
    with pytest.raises(Exception, match="unexpected value"):
        split_flags(["/some/model", "--enforce-eager"], table)


# --- the plan before the exec, on the GPU that nvidia-smi reports ----------------------------------------

FAKE_SMI = """#!/bin/sh
echo "$@" > {record}
echo "NVIDIA RTX PRO 6000 Blackwell Workstation Edition, 97887"
"""


def test_serve_plans_for_the_gpu_it_sees_and_warns_when_it_does_not_fit(
        served: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "smi"
    d.mkdir()
    record = tmp_path / "smi-args"
    (d / "nvidia-smi").write_text(FAKE_SMI.format(record=record))
    (d / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    code, _, err = _main(["serve", "--dry-run", str(served)], monkeypatch, capsys, d)
    assert code == 0 and "plan: fits NVIDIA RTX PRO 6000 Blackwell Workstation Edition" in err
    assert record.read_text().split()[-2:] == ["-i", "1"]        # the first visible GPU
    # 10M tokens x 3 layers x 260 B = 7.3 GiB of KV against 0.05 x 95.59 GiB: warned, with what would fit.
    code, out, err = _main(["serve", "--dry-run", str(served), "--", "--gpu-memory-utilization", "0.05",
                            "--max-model-len", "10000000"], monkeypatch, capsys, d)
    assert code == 0 and "vllm serve" in out
    assert "do not fit NVIDIA RTX PRO 6000" in err and "nearest: --max-model-len" in err


def test_a_stale_cache_is_refused(served: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    shard = sorted((served.parent / "DeepSeek-Tiny-NVFP4").glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the source "rewritten" after the build
    try:
        code, _, err = _main(["serve", "--dry-run", str(served)], monkeypatch, capsys)
    finally:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert code == 1 and "stale" in err and shard.name in err
