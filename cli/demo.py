"""moet-cache demo: the embedded default, end to end."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from moet_cache.errors import InputError

from ._common import JsonOpt, QuietOpt
from ._errors import EXIT_OK, EXIT_PROBLEM
from ._output import Output, styled
from ._progress import progress_for

# moet_cache.source.checkpoint's names for the two layouts, spelled here so that loading the CLI does not
# import it (and torch, seconds); tests/test_bench.py checks they stay equal.
MODELOPT, COMPRESSED_TENSORS = "modelopt", "compressed-tensors"
# The embedded default is DeepSeek-V4-Flash as shipped (-0731-NVFP4: NVFP4 main experts cast from MXFP4,
# MXFP4 drafter); the other V4 forms, and the V3 family in both NVFP4 layouts, on request.
V4_LAYOUTS = {"v4": "hybrid", "v4-mxfp4": "mxfp4", "v4-nvfp4": "nvfp4", "v4-ct": "ct-nvfp4"}


def demo(
    workdir: Annotated[Optional[Path], typer.Option(help="A new or empty folder to write the checkpoint and cache into (default: a temp folder, removed after).")] = None,
    layout: Annotated[str, typer.Option(help="v4 (DeepSeek-V4-Flash -0731-NVFP4 style, the default), v4-mxfp4, v4-nvfp4, "
                                             "v4-ct, or the V3 family: modelopt, compressed-tensors.")] = "v4",
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Make a synthetic DeepSeek-V4-Flash checkpoint (or V3 with --layout), build its cache, verify it three ways, inspect it, plan it on a GPU."""
    from moet_cache import BuildOptions, boot_check, build_cache, full_verify, inspect_cache, make_checkpoint, \
        small_spec, verify_against
    from moet_cache.source.synthetic import make_v4_checkpoint, small_v4_spec
    out = Output(json_, quiet)
    if layout not in (MODELOPT, COMPRESSED_TENSORS, *V4_LAYOUTS):
        raise typer.BadParameter(f"layout must be one of {', '.join([*V4_LAYOUTS, MODELOPT, COMPRESSED_TENSORS])}",
                                 param_hint="--layout")
    with tempfile.TemporaryDirectory(prefix="moet-demo-") as tmp:
        base = workdir or Path(tmp)
        src, cache = base / "checkpoint", base / "cache"
        taken = next((d for d in (src, cache) if d.exists() and (not d.is_dir() or any(d.iterdir()))), None)
        if taken is not None:  # the demo writes a whole checkpoint there: never over a user's files
            raise InputError(f"{taken} already exists and is not empty; the demo writes a new checkpoint and cache",
                             "give --workdir a new or empty folder")
        t0 = time.perf_counter()
        if layout in V4_LAYOUTS:  # three main layers (compress_ratios 0, 4, 128) and one drafter block
            make_v4_checkpoint(src, small_v4_spec(V4_LAYOUTS[layout], num_hidden_layers=3))
        else:
            make_checkpoint(src, small_spec(layout))
        out.info(f"synthetic {layout} checkpoint: {src}")
        built = build_cache(src, cache, BuildOptions(delta_budget="25%"), progress_for(out))
        boot = boot_check(cache)
        full = full_verify(cache)
        against = verify_against(cache, src)
        info = inspect_cache(cache)
        # what `moet-cache plan CACHE --gpu rtx-pro-6000` says: exact bytes from the cache's manifests, the
        # settings serve would start
        from moet_cache import serve
        from moet_cache.plan import DEFAULT_GPU, GPU_PRESETS, make_plan, read_footprint

        from .plan import plan_document, show_plan
        fp = read_footprint(cache)
        plan = make_plan(fp, serve.preset_plan_settings(fp.model, GPU_PRESETS[DEFAULT_GPU])[1])
        ok = boot.ok and full.ok and against.ok
        doc = {"command": "demo", "ok": ok, "checkpoint": str(src), "cache": str(cache),
               "kept": workdir is not None, "build": built.__dict__, "boot_check": boot.state,
               "verify_full": full.state, "verify_against": against.state, "inspect": info.__dict__,
               "plan": plan_document(plan),
               "seconds": time.perf_counter() - t0}
        if out.json_mode:
            out.json(doc, EXIT_OK if ok else EXIT_PROBLEM)
        else:
            out.print(f"build: {len(built.layers)} layers, {built.tier_experts} tier experts, {built.seconds:.2f} s")
            out.print(f"verify (boot check): {boot.state_text} in {boot.seconds * 1000:.1f} ms")
            out.print(f"verify --full: {full.state_text}, {full.bytes_hashed} bytes hashed")
            out.print(f"verify --against source: {against.state_text} ({against.details})")
            from .inspect_cmd import inspect as show
            show(cache, json_=False, quiet=quiet)
            show_plan(out, plan)
            out.print(styled(f"demo {'passed' if ok else 'FAILED'}", "green" if ok else "red",
                             f" in {doc['seconds']:.1f} s"
                             + ("" if workdir else " (temporary files removed; pass --workdir to keep them)")))
    raise typer.Exit(EXIT_OK if ok else EXIT_PROBLEM)
