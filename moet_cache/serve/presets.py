"""The serve presets: named sets of `vllm serve` flags (docs/SERVING.md), fitted to the model and to vLLM's
CPU build; the PlanSettings a command's flags ask for (what `moet-cache plan` plans); and whether serve starts
the model's drafter, decided by one function for plan and serve."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from ..plan.drafter_vram import DrafterLayout
from ..errors import InputError
from ..plan.kv_v4 import REASONING_MAX_CONTEXT
from ..plan.parallel import Parallel
from ..plan import (Footprint, GpuPreset, PlanSettings, Speculative, attention_from_config, make_plan,
                    max_position_embeddings, parse_sizes_list)
from ..units import GIB, parse_budget, parse_tokens
from .flags import Flag, last_values, split_flags


# The KV space serve gives vLLM's CPU build, which otherwise reserves --gpu-memory-utilization of the host's RAM.
CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class Preset:
    """A named set of `vllm serve` flags (a settings preset; "profile" means a routing profile in moet-cache)."""

    name: str
    description: str
    flags: tuple[tuple[str, tuple[str, ...]], ...]
    env: tuple[tuple[str, str], ...] = ()
    model_types: tuple[str, ...] = ()      # the config.json model_type values `--settings auto` picks it for
    gpu: str = ""                          # the GPU preset (plan.GPU_PRESETS) it is made for; "": one 96 GB card
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


def model_type_of(cfg: dict[str, Any]) -> str:
    mt = cfg.get("model_type")
    return mt if isinstance(mt, str) else ""


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
    tp = last_values(given, "--tensor-parallel-size", "-tp")   # the last of either spelling, as vLLM's parser reads it
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
