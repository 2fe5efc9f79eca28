"""moet-cache serve: boot-check the cache, build the `vllm serve` command from a settings preset, exec vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from moet_cache.serve import DEFAULT_PRESET, PRESETS, build_serve_command, exec_vllm, preflight_plan
from moet_cache.units import GIB
from moet_cache.verify import State

from ._common import JsonOpt, QuietOpt
from ._output import Output


def serve(
    cache: Annotated[Path, typer.Argument(help="The cache folder.")],
    vllm_args: Annotated[Optional[list[str]], typer.Argument(
        help="After --: any `vllm serve` flags; they replace the preset's.", show_default=False)] = None,
    settings: Annotated[str, typer.Option(help=f"Settings preset: auto (the one for the cache's model type) or {', '.join(PRESETS)}.")] = DEFAULT_PRESET,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the command and environment; do not start vLLM.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Serve an incomplete, stale or corrupt cache anyway (warns).")] = False,
    skip_flag_check: Annotated[bool, typer.Option("--skip-flag-check", help="Do not check the flags with vLLM's own parser.")] = False,
    stock: Annotated[bool, typer.Option("--stock", help="vLLM's own FP4 MoE on planes expanded to FP4 (costs FP4 VRAM; warns). Default: the moet method computes on the planes.")] = False,
    no_speculative: Annotated[bool, typer.Option("--no-speculative", help="Do not start the cache's drafter. Default: speculative decoding (DSpark or MTP) is on when the cache holds the drafter's planes and the plan fits it.")] = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Start vLLM on a verified cache (it replaces this process); `--dry-run` only prints the command."""
    out = Output(json_, quiet)
    cmd = build_serve_command(cache, settings, list(vllm_args or []), force=force,
                                      skip_flag_check=skip_flag_check, require_vllm=not dry_run, stock=stock,
                                      speculative=not no_speculative)
    for w in cmd.warnings:
        out.warn(w)
    for n in cmd.notes:
        out.info(f"note: {n}")
    # vLLM's CPU build holds the model in host RAM: a GPU plan (and its GPU-only rules, such as V4's FP8 KV)
    # would not describe what starts.
    pre = preflight_plan(cmd) if cmd.boot_state != State.CORRUPT and not cmd.cpu else None
    if pre is not None:
        for w in pre.warnings:
            out.warn(f"plan: {w}")
    if cmd.cpu:
        out.info("vLLM's CPU build: no GPU to plan")
    elif pre is None or not pre.gpu_seen:
        out.info("no GPU seen (nvidia-smi): no fit verdict; run `moet-cache plan CACHE --gpu CARD` for a card")
    elif not pre.fits:
        out.warn(f"these settings do not fit {pre.gpu}: short by {-pre.margin / GIB:.2f} GiB ({pre.deciding}); "
                 + ("nearest: " + "; ".join(pre.suggestions) if pre.suggestions else "see `moet-cache plan`"))
    else:
        out.info(f"plan: fits {pre.gpu} with {pre.margin / GIB:.2f} GiB to spare")
    if dry_run:
        if out.json_mode:
            out.json({"command": "serve", "dry_run": True, "argv": list(cmd.argv), "shell": cmd.shell(),
                      "env_added": dict(cmd.env_added), "cache": cmd.cache, "preset": cmd.preset,
                      "model_type": cmd.model_type, "torch_version": cmd.torch_version,
                      "boot_state": cmd.boot_state, "vllm": cmd.vllm, "vllm_version": cmd.vllm_version,
                      "flags_checked": cmd.flags_checked, "warnings": list(cmd.warnings), "notes": list(cmd.notes),
                      "plan": None if pre is None else pre.__dict__,
                      "nodes": [{"node_rank": r, "argv": list(a), "shell": cmd.shell(a)}
                                for r, a in enumerate(cmd.nodes)],
                      "verify_each_node": f"moet-cache verify {cmd.cache}" if cmd.nodes else None})
        else:
            env = "\n".join(f"  {k}={v}" for k, v in cmd.env_added) or "  (inherited unchanged)"
            out.result(Text(f"environment added:\n{env}"))
            if not cmd.nodes:
                out.result(Text(cmd.shell()))  # plain text: no rich markup in paths and JSON
            else:
                # Every node reads its ranks' bytes from the cache at this path: its own copy or a shared file system.
                out.result(Text(f"on every node, the cache at {cmd.cache}, checked first: moet-cache verify {cmd.cache}"))
                for r, argv in enumerate(cmd.nodes):
                    out.result(Text(f"node {r}{' (head: the API server)' if r == 0 else ''}: {cmd.shell(argv)}"))
        return
    exec_vllm(cmd)
