"""moet-cache build / retier."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from moet_cache.enums import BaseTable
from moet_cache.errors import InputError
from moet_cache.cache.tiering import DEFAULT_DELTA_BUDGET
from moet_cache.units import fmt_bytes

from ._common import JsonOpt, QuietOpt, kill_hook
from ._env import env_choice
from ._output import Output
from ._progress import cancel_token, progress_for

#: The environment variable for BuildTuning.split_device (read here, never by the library).
SPLIT_DEVICE_ENV = "MOET_CACHE_SPLIT_DEVICE"


#: The environment variable for BuildTuning.host_kernel (read here, never by the library).
KERNELS_ENV = "MOET_CACHE_KERNELS"


def split_device_from_env() -> str:
    """MOET_CACHE_SPLIT_DEVICE: auto (also when unset), cpu, torch-cpu or cuda; any other value is refused."""
    from moet_cache.build.options import SPLIT_DEVICES
    return env_choice(SPLIT_DEVICE_ENV, SPLIT_DEVICES, "auto")


def host_kernel_from_env() -> str:
    """MOET_CACHE_KERNELS: numpy (A/B runs) or c; unset: the fastest built; any other value is refused."""
    from moet_cache.codec.planes import KERNEL, HostKernel
    want = env_choice(KERNELS_ENV, HostKernel.names(), KERNEL)
    if want == HostKernel.C and KERNEL != HostKernel.C:  # the library would fall back to numpy without a word
        raise InputError(f"environment variable {KERNELS_ENV}=c, but the C kernels are not built here",
                         f"install moet-cache with a C compiler present, or set {KERNELS_ENV}=numpy or unset it")
    return want


def build(
    src: Annotated[Path, typer.Argument(metavar="SRC", show_default=False, help="The NVFP4 checkpoint folder (config.json, shards).")],
    cache: Annotated[Path, typer.Argument(help="The cache folder to build or resume.")],
    delta_budget: Annotated[str, typer.Option(metavar="SIZE", help="Bytes of FP4 delta planes to keep (4.5GB, 2GiB, 25%).")] = DEFAULT_DELTA_BUDGET,
    profile: Annotated[Optional[Path], typer.Option(metavar="PROFILE.json", help="Routing profile JSON (per-layer per-expert token counts).")] = None,
    lossless: Annotated[bool, typer.Option("--lossless", help="Also keep every expert's delta planes: export and retier without the source.")] = False,
    layers: Annotated[Optional[str], typer.Option(metavar="LAYERS", help="Served MoE layers, e.g. 3-60 or 3,5,7-9 (default: all).")] = None,
    include_mtp: Annotated[bool, typer.Option("--include-drafter", "--include-mtp", help="Also keep the speculative-decoding drafter (DSpark's or MTP's blocks mtp.K and head tensors), its routed experts as planes. --include-mtp is the same option.")] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Wait for another build of this cache instead of failing.")] = False,
    base_table: Annotated[BaseTable, typer.Option(metavar="[fitted|x4]", help="Base tables: fitted, the default (the mean FP4 value of each base code: the smallest error; on the reference models base-only KL to FP4 0.069 against x4's 0.079 on MXFP4, 0.089 against 0.091 on NVFP4, docs/QUALITY.md), or x4 (a, 4a, -a, -4a: the GPU decodes them with bit arithmetic, 5-16% faster at up to 16 tokens, for that larger error); docs/BUILD.md.")] = BaseTable.FITTED,
    mid_budget: Annotated[Optional[str], typer.Option(metavar="SIZE", help="Bytes of the 3-bit mid tier (1GB, 5%): experts outside the delta tier that keep the delta's high bit (an eighth byte a weight) through a fitted 8-entry table; chosen as the delta tier is (default: none).")] = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Build the cache once; a rerun resumes a killed build, or confirms a complete one."""
    from moet_cache import BuildOptions, BuildTuning, build_cache  # here, not at the top: it imports torch (seconds)
    out = Output(json_, quiet)
    opts = BuildOptions(delta_budget=delta_budget, profile=str(profile) if profile else None,
                        lossless=lossless, layers=layers, include_mtp=include_mtp, wait=wait, base_table=base_table,
                        mid_budget=mid_budget,
                        tuning=BuildTuning(split_device=split_device_from_env(), host_kernel=host_kernel_from_env()),
                        kill_at=kill_hook())
    r = build_cache(src, cache, opts, progress_for(out), cancel_token())
    if out.json_mode:
        out.json({"command": "build", **r.__dict__})
        return
    if r.already_complete:
        out.print(f"{cache}: already complete and verified for this source and these settings; nothing to do")
        return
    rate = r.source_bytes / r.seconds / 1e9 if r.seconds > 0 else 0.0
    out.print(f"built {cache}: {len(r.layers)} layers ({len(r.layers_built)} built, {len(r.layers_reused)} reused), "
              f"{fmt_bytes(r.cache_bytes)} in {r.seconds:.1f} s ({rate:.2f} GB/s of source)")
    out.print(f"delta tier: {r.tier_experts} experts, {fmt_bytes(r.tier_bytes)} of delta planes (budget "
              f"{fmt_bytes(r.budget_bytes)}; the pack file adds a {fmt_bytes(r.tier_file_bytes - r.tier_bytes)} header)")
    if r.mid_experts:
        out.print(f"mid tier: {r.mid_experts} experts at 3 bits, {fmt_bytes(r.mid_bytes)} of mid planes and tables")


def retier(
    cache: Annotated[Path, typer.Argument(help="A cache built with --lossless.")],
    delta_budget: Annotated[str, typer.Option(metavar="SIZE", help="New tier budget (4.5GB, 2GiB, 25%).")] = DEFAULT_DELTA_BUDGET,
    profile: Annotated[Optional[Path], typer.Option(metavar="PROFILE.json", help="Routing profile JSON.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait for a running build instead of failing.")] = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Choose a new FP4 delta tier for a --lossless cache, without the source."""
    from moet_cache import retier_cache  # here, not at the top: it imports torch (seconds)
    out = Output(json_, quiet)
    r = retier_cache(cache, delta_budget, str(profile) if profile else None, wait, cancel_token(), kill_hook())
    if out.json_mode:
        out.json({"command": "retier", **r.__dict__})
    else:
        out.print(f"re-tiered {cache}: {r.tier_experts} experts, {fmt_bytes(r.tier_bytes)} of delta planes "
                  f"(budget {fmt_bytes(r.budget_bytes)}; the pack file adds a {fmt_bytes(r.tier_file_bytes - r.tier_bytes)} header{', weighted by the profile' if r.weighted_by_profile else ''})")
