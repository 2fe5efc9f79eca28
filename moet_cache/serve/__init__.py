"""Serve a verified cache with vLLM: named settings presets, the `vllm serve` command, and its checks.

    flags     vLLM's command-line flags as data: split, renamed, merged, checked; one list a node
    presets   the named settings presets fitted to the model, the settings a command plans, the drafter's choice
    vllm_env  which vLLM: its distribution, how it starts, its own parser read in its own interpreter
    command   build_serve_command: the boot check, the loader's flags, the plan before exec, the exec
Layered in that order: flags imports none of the others, command imports all three.
"""

from __future__ import annotations

from .command import PreflightPlan, ServeCommand, build_serve_command, exec_vllm, hub_repo_name, preflight_plan
from .flags import Flag, OptionInfo, OptionTable, adapt_renames, merge_flags, split_flags
from .presets import (DEFAULT_PRESET, PRESETS, DrafterChoice, Preset, check_reasoning_effort, choose_drafter,
                      fit_preset, get_preset, model_type_of, preset_plan_settings, settings_from_argv,
                      settings_from_flags, speculative_flag)
from .vllm_env import SERVER_MODULE, TORCH_PIN, VLLM_PIN, VllmProbe, check_plugin_env, vllm_python

__all__ = [
    "DEFAULT_PRESET", "PRESETS", "SERVER_MODULE", "TORCH_PIN", "VLLM_PIN", "DrafterChoice", "Flag", "OptionInfo",
    "OptionTable", "PreflightPlan", "Preset", "ServeCommand", "VllmProbe", "adapt_renames", "build_serve_command",
    "check_plugin_env", "check_reasoning_effort", "choose_drafter", "exec_vllm", "fit_preset", "get_preset",
    "hub_repo_name", "merge_flags", "model_type_of", "preflight_plan", "preset_plan_settings", "settings_from_argv",
    "settings_from_flags", "speculative_flag", "split_flags", "vllm_python",
]
