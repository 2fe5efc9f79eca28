"""moet-cache plan: what a cache (or a checkpoint's future cache) takes on a GPU, and what fits."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from moet_cache import serve
from moet_cache.plan.drafter_vram import DrafterLayout
from moet_cache.errors import InputError
from moet_cache.cache.folders import FolderKind, folder_kind
from moet_cache.plan.parallel import Parallel
from moet_cache.plan import (DEFAULT_GPU, Footprint, GPU_PRESETS, GpuPreset, KV_DTYPES, Plan, PlanSettings, Speculative, Suggestion, detect_gpu, footprint_of_view, make_plan, parse_sizes_list, read_footprint, resolve_gpu)
from moet_cache.cache.quality_curve import QUALITY_DOC, QualityCurve, TierChange, packaged_curve, tier_change
from moet_cache.units import GIB, parse_size, parse_tokens

from ._boot import checked_view
from ._common import JsonOpt, QuietOpt
from ._errors import EXIT_OK, EXIT_PROBLEM
from ._output import Output, styled


def _g(n: float) -> str:
    """GiB with two decimals, more for small figures (a synthetic cache is a few MiB)."""
    return f"{n / GIB:.2f}" if abs(n) >= GIB / 100 or n == 0 else f"{n / GIB:.5f}"


def tier_gain(p: Plan, curve: QualityCurve) -> TierChange | None:
    """What the free bytes' extra tier experts do to the reference model's KL (quality_curve.py), the cache's
    mid tier kept."""
    fp = p.footprint
    return tier_change(curve, fp.tier_experts, p.extra_delta_experts, fp.total_experts, fp.source_format,
                       fp.mid_experts)


def mid_gain(p: Plan, curve: QualityCurve) -> TierChange | None:
    """What the free bytes' extra mid-tier experts do to the reference model's KL (None: the cache has no mid
    tier, or no room for more of it)."""
    fp = p.footprint
    if not p.extra_mid_experts:
        return None
    return tier_change(curve, fp.tier_experts, 0, fp.total_experts, fp.source_format, fp.mid_experts,
                       p.extra_mid_experts)


def suggestion_tier_change(p: Plan, x: Suggestion, curve: QualityCurve) -> TierChange | None:
    """What a suggestion's smaller tier costs on the reference model, the mid tier kept (None: it keeps the
    tier)."""
    fp = p.footprint
    if x.tier_experts is None:
        return None
    return tier_change(curve, fp.tier_experts, x.tier_experts - fp.tier_experts, fp.total_experts,
                       fp.source_format, fp.mid_experts)


def _change_document(change: TierChange | None, curve: QualityCurve, added_bytes: int,
                     mid_added_bytes: int = 0) -> dict | None:
    if change is None:
        return None
    return {"reference_model": change.reference, "tier_fraction": change.fraction,
            "tier_fraction_after": change.fraction_after, "tier_bytes_added": added_bytes,
            "mid_fraction": change.mid_fraction, "mid_fraction_after": change.mid_fraction_after,
            "mid_bytes_added": mid_added_bytes,
            "kl_to_fp4": change.kl, "kl_to_fp4_after": change.kl_after,
            "kl_change_percent": change.change_percent, "table_form": curve.table_form,
            "tier_policy": curve.tier_policy,
            "mid_policy": curve.mid_policy if change.mid_fraction or change.mid_fraction_after else None,
            "measured_by": curve.command, "results": curve.results,
            "results_commit": curve.results_commit, "doc": QUALITY_DOC}


def _change_words(change: TierChange) -> str:
    """The change in the curve's terms: the tier's fractions (beside the mid tier's, where the cache has one),
    or the mid tier's (beside the tier's) where the mid tier is what changes."""
    if change.mid_fraction_after != change.mid_fraction and change.fraction_after == change.fraction:
        what = (f"mid tier {change.mid_fraction:.1%} -> {change.mid_fraction_after:.1%} of experts "
                f"(beside a tier of {change.fraction:.1%})")
    else:
        what = f"{change.fraction:.1%} -> {change.fraction_after:.1%} of experts"
        if change.mid_fraction != change.mid_fraction_after:   # a tier grown into the mid tier's experts
            what += f" (mid tier {change.mid_fraction:.1%} -> {change.mid_fraction_after:.1%})"
        elif change.mid_fraction:
            what += f" (beside a mid tier of {change.mid_fraction:.1%})"
    return (f"{what}: KL to FP4 {change.change_percent:+.1f}% on the {change.reference.upper()} reference model "
            f"({change.kl:.4f} -> {change.kl_after:.4f} nats a byte; {QUALITY_DOC})")


def tier_gain_document(p: Plan, curve: QualityCurve) -> dict | None:
    return _change_document(tier_gain(p, curve), curve, p.extra_delta_experts * p.footprint.expert_delta_bytes)


def mid_gain_document(p: Plan, curve: QualityCurve) -> dict | None:
    return _change_document(mid_gain(p, curve), curve, 0, p.extra_mid_experts * p.footprint.expert_mid_bytes)


def plan_document(p: Plan, curve: QualityCurve | None = None) -> dict:
    """The plan as one JSON document: every figure in bytes and in GiB."""
    fp, s = p.footprint, p.settings
    curve = curve or packaged_curve()
    terms = {"base_planes": p.base, "delta_tier": p.delta, "dense": p.dense, "mtp_weights": p.mtp_weights,
             "drafter_reserves": p.drafter_reserves, "cudagraph_reserve": p.cudagraph,
             "activation_reserve": p.activations, "communication_reserve": p.comm, "kv_cache": p.kv}
    v4, d = p.v4_kv, p.drafter
    whole = fp.whole or fp
    return {
        # Every figure below is one GPU's: the fullest rank's when the model is split over several.
        "parallel": {"tensor_parallel_size": s.parallel.size, "expert_parallel": s.parallel.expert,
                     "gpus": s.parallel.size, "per_rank": s.parallel.size > 1,
                     "whole_model_bytes": {"base_planes": whole.base_bytes, "delta_tier": whole.delta_tier_bytes,
                                           "dense": whole.dense_bytes},
                     "dense_split_bytes": whole.dense_split_bytes,
                     "rank_tier_experts": fp.tier_experts if s.parallel.size > 1 else None},
        "command": "plan", "path": fp.path, "source": fp.source, "exact": fp.exact,
        "gpu": {"name": s.gpu.name, "total_bytes": s.gpu.total_bytes, "total_gib": s.gpu.total_bytes / GIB,
                "note": s.gpu.note},
        "settings": {"gpu_memory_utilization": s.utilization, "max_model_len": s.max_model_len,
                     "kv_cache_dtype": s.kv_cache_dtype, "max_num_seqs": s.max_num_seqs,
                     "cudagraph_capture_sizes": list(s.cudagraph_sizes), "speculative": s.speculative,
                     "block_size": s.block_size, "kv_bytes_per_token": s.kv_bytes_per_token,
                     "max_num_batched_tokens": s.batched_tokens, "async_scheduling": s.async_scheduling},
        "attention": fp.attention.kind,
        "budget_bytes": p.budget, "budget_gib": p.budget / GIB,
        "terms_bytes": terms, "terms_gib": {k: v / GIB for k, v in terms.items()},
        "kv_bytes_per_token_per_layer": None if v4 else p.kv_per_token_layer, "kv_layers": p.kv_layers,
        "kv_bytes_per_token": None if v4 else p.kv_per_token_layer * p.kv_layers, "kv_tokens": p.kv_tokens,
        "kv_raw_bytes": p.kv_raw, "kv_raw_gib": p.kv_raw / GIB,
        "kv_allocator": None if v4 is None else {
            "bytes_per_block": v4.bytes_per_block, "blocks_per_sequence": v4.blocks_per_seq,
            "window_blocks_per_sequence": v4.window_blocks_per_seq, "groups": v4.groups,
            "tokens_in_flight": v4.in_flight, "raw_bytes_per_token": v4.raw_per_token},
        "need_bytes": p.need, "need_gib": p.need / GIB, "fits": p.fits, "thin_margin": p.thin,
        "margin_bytes": p.margin, "margin_gib": p.margin / GIB, "deciding": p.deciding,
        "kv_room_bytes": p.kv_room,
        "max_kv_bytes_per_token_per_layer": p.max_kv_per_token_layer or None,
        "longest_context": p.context_limit, "longest_context_kv": p.longest_context,
        "buys": {"extra_full_length_sequences": p.extra_full_seqs, "extra_delta_experts": p.extra_delta_experts,
                 "delta_experts": [fp.tier_experts, fp.total_experts],
                 "delta_experts_reference_kl": tier_gain_document(p, curve),
                 "extra_mid_experts": p.extra_mid_experts, "mid_experts": [fp.mid_experts, fp.total_experts],
                 "mid_experts_reference_kl": mid_gain_document(p, curve),
                 "mtp_bytes": p.mtp_need, "mtp_fits": p.mtp_fits},
        "suggestions": [{"change": x.change, "setting": x.setting, "margin_bytes": x.margin, "where": x.where,
                         "advice": x.advice(), "thin_margin": x.thin(p.budget),
                         "reference_kl": None if x.tier_experts is None else _change_document(
                             suggestion_tier_change(p, x, curve), curve,
                             (x.tier_experts - fp.tier_experts) * fp.expert_delta_bytes)}
                        for x in p.suggestions],
        "drafter": None if d is None else {
            "layout": d.layout, "counted": s.speculative != Speculative.NONE, "layers": d.layers,
            "num_speculative_tokens": d.speculative_tokens, "weights_bytes": d.weights,
            "context_wkv_copy_bytes": d.copies, "buffers_bytes": d.buffers, "workspace_lane_bytes": d.workspace,
            "cudagraph_bytes": d.graphs, "kv_bytes": d.kv, "total_bytes": d.total, "total_gib": d.total / GIB},
        "warnings": list(p.warnings),
        "notes": list(p.notes),
    }


def _kv_row(p: Plan) -> list[str]:
    s = p.settings
    if p.v4_kv is not None:
        k = p.v4_kv
        return ["KV cache", _g(p.kv), f"vLLM's allocation: {k.seqs} x {k.blocks_per_seq} blocks + 1 of "
                f"{k.bytes_per_block:,} B ({k.groups} groups; {k.window_blocks_per_seq} blocks a sequence for the "
                f"windows and compressor states, {k.in_flight} tokens in flight); records alone {_g(p.kv_raw)} GiB"]
    per_token = p.kv_per_token_layer * p.kv_layers
    return ["KV cache", _g(p.kv), f"{p.kv_tokens} tokens x {per_token} B ({p.kv_per_token_layer} B x {p.kv_layers} "
            f"layers, {s.kv_cache_dtype if s.kv_bytes_per_token is None else 'given'})"]


def show_plan(out: Output, p: Plan, curve: QualityCurve | None = None) -> None:
    fp, s = p.footprint, p.settings
    curve = curve or packaged_curve()
    how = "exact bytes from the cache's manifests" if fp.exact else "computed from config.json and the shard headers"
    out.print(f"{fp.path}: {fp.served_layers} served MoE layers ({how})")
    out.print(f"GPU {s.gpu.name} ({s.gpu.note}): {_g(s.gpu.total_bytes)} GiB x {s.utilization} = {_g(p.budget)} GiB "
              "usable. All figures in GiB (2^30 bytes); 1 GB = 0.931 GiB.")
    if s.parallel.size > 1:
        w = fp.whole or fp
        out.print(f"{s.parallel.size} GPUs, {s.parallel.label}: every figure is one GPU's, the fullest rank's "
                  f"(the whole model: base planes {_g(w.base_bytes)}, delta tier {_g(w.delta_tier_bytes)}, "
                  f"dense {_g(w.dense_bytes)} GiB; the KV cache is whole on every GPU)")
    split = ("" if s.parallel.size == 1 else
             f" ({'whole experts, E/' if s.parallel.expert else '1/'}{s.parallel.size} of each layer's)")
    rows = [
        ["base planes", _g(p.base), f"{fp.served_layers} layers, 2-bit codes + block scales{split}"],
        ["delta tier", _g(p.delta), f"{fp.tier_experts} of {fp.total_experts} experts at FP4"
         + ("" if s.parallel.size == 1 else " on this GPU" if s.parallel.expert else f", 1/{s.parallel.size} of each")],
        ["dense weights", _g(p.dense), "attention, shared experts, embeddings, copied unchanged"
         + ("" if s.parallel.size == 1 else "; vLLM's column/row-parallel layers 1/N, the rest whole")],
    ]
    d = p.drafter
    if p.mtp_weights and d is not None:
        what = "planes, dense" + (", head stack" if d.layout == DrafterLayout.DSPARK else "")
        rows.append([f"{d.layout} drafter", _g(p.mtp_weights), f"{d.layers} draft layer{'s' * (d.layers != 1)}: "
                     f"{what}" + (f", context_wkv_proj copies {_g(d.copies)}" if d.copies else "")])
        rows.append(["drafter reserves", _g(p.drafter_reserves), f"buffers {_g(d.buffers)}, workspace lane "
                     f"{_g(d.workspace)} (estimate), CUDA graphs {_g(d.graphs)} (estimate)"])
    elif p.mtp_weights:
        rows.append(["MTP layer", _g(p.mtp_weights), "speculative decoding" + ("" if fp.mtp_exact else " (estimate)")])
    rows += [
        ["CUDA graphs", _g(p.cudagraph), f"{len(s.cudagraph_sizes)} capture sizes"
         + (" (given)" if s.cudagraph_reserve is not None else " (estimate)")],
        ["activations", _g(p.activations), "given" if s.activation_reserve is not None
         else f"estimate for {s.batched_tokens} batched tokens"],
    ]
    if p.comm:
        rows.append(["communication", _g(p.comm), "NCCL and all-reduce buffers (estimate)"])
    rows += [
        _kv_row(p),
        ["total", _g(p.need), f"of {_g(p.budget)} usable"],
    ]
    out.table(None, ["Term", "GiB", "What"], rows, wrap=("What",))
    # the verdict is what plan is asked for: printed with --quiet too (out.result); the rest are notes
    if p.fits:
        if p.thin:
            out.result(styled("fits, barely", "yellow", f": {_g(p.margin)} GiB to spare ({p.deciding})"))
        else:
            out.result(styled("fits", "green", f", with {_g(p.margin)} GiB to spare ({p.deciding})"))
        out.print("the free bytes would buy one of:")
        out.print(f"  {p.extra_full_seqs} more concurrent {s.max_model_len}-token sequences")
        out.print(f"  a context of {p.context_limit} tokens for {s.max_num_seqs} sequence(s)")
        how = "build again with a larger --delta-budget (retier drops the mid tier)" if fp.mid_experts \
            else "moet-cache retier"
        out.print(f"  {p.extra_delta_experts} more delta-tier experts "
                  f"({fp.tier_experts + p.extra_delta_experts} of {fp.total_experts}): {how}")
        gain = tier_gain(p, curve)
        if gain is not None:
            out.print(f"    +{_g(p.extra_delta_experts * fp.expert_delta_bytes)} GiB of tier, {_change_words(gain)}")
        mid = mid_gain(p, curve)
        if mid is not None:
            added = p.extra_mid_experts * fp.expert_mid_bytes
            out.print(f"  {p.extra_mid_experts} more mid-tier experts ({fp.mid_experts + p.extra_mid_experts} of "
                      f"{fp.total_experts}): build again with --mid-budget {added:,} bytes larger")
            out.print(f"    +{_g(added)} GiB of mid tier, {_change_words(mid)}")
    else:
        short = f"short by {_g(-p.margin)} GiB. " if p.margin < 0 else ""
        out.result(styled("does not fit", "red", f": {short}Deciding term: {p.deciding}"))
        out.print("nearest settings that fit:")
        for x in p.suggestions:
            thin = ": the edge, within the estimates' error" if x.thin(p.budget) else ""
            out.print(f"  {x.change}: {x.advice()} (leaves {_g(x.margin)} GiB{thin})")
            cost = suggestion_tier_change(p, x, curve)
            if cost is not None:
                out.print(f"    tier {_change_words(cost)}")
    if p.mtp_need:
        verdict = "fits" if p.mtp_fits else "does not fit"
        what = f"the {d.layout} drafter" if d is not None else "drafter"
        on = " (counted above)" if s.speculative != Speculative.NONE else ""
        out.print(f"speculative decoding ({what}: weights, KV and reserves, {_g(p.mtp_need)} GiB){on}: {verdict}")
    if p.max_kv_per_token_layer:
        out.print(f"largest KV per token per layer that fits: {p.max_kv_per_token_layer} B")
    out.print(f"longest context that fits: {p.context_limit} tokens")
    for w in p.warnings:
        out.warn(w)


def _split_positionals(path: Path, extra: list[str] | None, sizes: str | None) -> tuple[Path, str | None]:
    """vLLM's spelling of the capture sizes, `--cudagraph-capture-sizes 1 2 4 8`: the numbers after the first
    arrive as extra positionals and are folded back into the option (the folder is the one non-number)."""
    words = [str(path), *(extra or [])]
    ints = [w for w in words if w.isascii() and w.isdigit() and not Path(w).is_dir()]
    rest = [w for w in words if w not in ints]
    if len(rest) != 1:
        raise InputError(f"plan takes one cache or checkpoint folder, got {rest or 'none'}")
    if ints and sizes is None:
        raise InputError(f"unexpected values {' '.join(ints)}", "give capture sizes after --cudagraph-capture-sizes")
    if ints:
        sizes = " ".join([sizes or "", *ints])
    return Path(rest[0]), sizes


def resolve_plan_gpu(gpu: str, default: str = DEFAULT_GPU) -> GpuPreset:
    """`auto`: the GPU nvidia-smi sees (as serve does), else the default preset (the settings preset's card)."""
    if gpu.strip().lower() == "auto":
        seen = detect_gpu(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        if seen is not None:
            return seen
        d = GPU_PRESETS[default]
        return GpuPreset(d.name, d.total_bytes, d.note + "; no GPU seen, the default preset (--gpu to choose)")
    return resolve_gpu(gpu)


def _footprint(path: Path, delta_budget: str | None, out: Output) -> Footprint:
    """A cache's exact bytes after the boot check (a damaged cache is exit 1, not a plan), or a checkpoint's
    computed from config.json and the shard headers."""
    kind = folder_kind(path)
    if kind == FolderKind.EMPTY:
        raise InputError(f"{path} is an empty folder", "give a cache folder or an NVFP4 checkpoint folder")
    if kind == FolderKind.CACHE:
        return footprint_of_view(checked_view(path, out), delta_budget)
    return read_footprint(path, delta_budget)


def _drafter(fp: Footprint, card: GpuPreset, preset_name: str, speculative: str, tier_given: bool,
             settings_for: Callable[[DrafterLayout], PlanSettings]) -> tuple[Footprint, DrafterLayout | None,
                                                                                   str | None]:
    """The drafter planned: serve's choice (auto: with the footprint it planned), the one asked for, or none;
    and the line that says why."""
    if speculative == "auto":
        choice = serve.choose_drafter(fp, card, preset_name, tier_given=tier_given, settings_for=settings_for)
        return choice.footprint, choice.layout, choice.reason
    if speculative not in Speculative.names():
        raise InputError(f"--speculative {speculative!r}", "use auto, dspark, mtp or none")
    return fp, (None if speculative == Speculative.NONE else DrafterLayout(speculative)), None


def plan(
    path: Annotated[Path, typer.Argument(help="A cache folder (exact bytes) or an NVFP4 checkpoint (computed).")],
    extra: Annotated[Optional[list[str]], typer.Argument(hidden=True, show_default=False)] = None,
    gpu: Annotated[str, typer.Option(help=f"auto (the GPU nvidia-smi sees, as serve; else {DEFAULT_GPU}), a preset ({', '.join(GPU_PRESETS)}) or its memory, e.g. 96GB, 95.6GiB.")] = "auto",
    gpu_memory_utilization: Annotated[Optional[float], typer.Option(help="vLLM's share of the GPU's memory. Default: the serve preset's.", show_default=False)] = None,
    max_model_len: Annotated[Optional[str], typer.Option(help="Context length in tokens, as vLLM reads it: 131072, 128k, 128K. Default: the serve preset's, capped at the model's positions.", show_default=False)] = None,
    kv_cache_dtype: Annotated[Optional[str], typer.Option(help=f"One of {', '.join(KV_DTYPES)}. Default: the serve preset's, one the model's attention runs.", show_default=False)] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Full-length sequences the KV cache must hold at once.")] = 1,
    cudagraph_capture_sizes: Annotated[Optional[str], typer.Option(help="CUDA-graph batch sizes as vLLM takes them (1 2 4 8), or 1,2,4,8; none for eager. Default: the serve preset's.")] = None,
    delta_budget: Annotated[Optional[str], typer.Option(help="Plan with this delta tier (4.5GB, 2GiB, 25%, 0) instead of the built one.")] = None,
    speculative: Annotated[str, typer.Option(help="auto: the drafter serve would start (on when it fits); dspark or mtp: count the model's drafter (weights, KV, buffers, workspace, CUDA graphs); none.")] = "auto",
    kv_bytes_per_token: Annotated[Optional[int], typer.Option(min=1, help="KV bytes per token per layer, for attention moet-cache does not know.")] = None,
    block_size: Annotated[Optional[int], typer.Option(min=1, help="KV-cache block size in tokens. Default: the serve preset's.", show_default=False)] = None,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option(min=1, help="vLLM's --max-num-batched-tokens (activations; V4's windows). Default: the serve preset's, else vLLM's 8192.", show_default=False)] = None,
    async_scheduling: Annotated[Optional[bool], typer.Option("--async-scheduling/--no-async-scheduling", help="vLLM's async scheduling (on by default: two batches in flight).", show_default=False)] = None,
    cudagraph_reserve: Annotated[Optional[str], typer.Option(help="Override the CUDA-graph estimate (e.g. 1GiB).")] = None,
    activation_reserve: Annotated[Optional[str], typer.Option(help="Override the activation estimate (e.g. 2GiB).")] = None,
    tensor_parallel_size: Annotated[Optional[int], typer.Option("--tensor-parallel-size", "-tp", min=1, help="GPUs of this card vLLM splits the model over; the plan sizes the fullest one. Default: the serve preset's.", show_default=False)] = None,
    enable_expert_parallel: Annotated[bool, typer.Option("--enable-expert-parallel", "-ep", help="Whole experts a GPU (vLLM's expert parallelism) instead of a slice of each.")] = False,
    settings_preset: Annotated[str, typer.Option("--settings", help=f"The serve preset to plan: auto (the one serve picks for the model) or {', '.join(serve.PRESETS)}.")] = serve.DEFAULT_PRESET,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Plan the VRAM: weights, KV cache, reserves, headroom; exit 0 when it fits, 1 when it does not.
    Unless given, every setting is the one `moet-cache serve` would start with (its preset for the model)."""
    out = Output(json_, quiet)
    path, sizes = _split_positionals(path, extra, cudagraph_capture_sizes)
    fp = _footprint(path, delta_budget, out)
    chosen = serve.get_preset(settings_preset, serve.model_type_of(fp.model))
    given = {"utilization": gpu_memory_utilization,
             "max_model_len": parse_tokens(max_model_len) if max_model_len is not None else None,
             "kv_cache_dtype": kv_cache_dtype, "block_size": block_size, "batched_tokens": max_num_batched_tokens,
             "async_scheduling": async_scheduling,
             "cudagraph_sizes": parse_sizes_list(sizes) if sizes is not None else None}
    card = resolve_plan_gpu(gpu, chosen.gpu or DEFAULT_GPU)

    def settings_for(drafter: DrafterLayout | None) -> PlanSettings:   # the preset's, the flags given over them
        defaults = serve.preset_plan_settings(fp.model, card, chosen.name, drafter=drafter)[1]
        if tensor_parallel_size is not None or enable_expert_parallel:
            defaults = replace(defaults, parallel=Parallel(tensor_parallel_size or defaults.parallel.size,
                                                           enable_expert_parallel or defaults.parallel.expert))
        return replace(
            defaults, **{k: v for k, v in given.items() if v is not None},
            max_num_seqs=max_num_seqs, speculative=str(drafter or Speculative.NONE),
            kv_bytes_per_token=kv_bytes_per_token,
            cudagraph_reserve=parse_size(cudagraph_reserve, what="--cudagraph-reserve") if cudagraph_reserve else None,
            activation_reserve=parse_size(activation_reserve, what="--activation-reserve") if activation_reserve else None)
    fp, drafter, said = _drafter(fp, card, chosen.name, speculative, delta_budget is not None, settings_for)
    preset = chosen.name
    settings = settings_for(drafter)
    p = make_plan(fp, settings)
    curve = packaged_curve()
    if out.json_mode:
        out.json({**plan_document(p, curve), "preset": preset, "speculative_choice": said},
                 EXIT_OK if p.fits else EXIT_PROBLEM)
    else:
        out.print(f"settings: the {preset} preset `moet-cache serve` starts, with the flags given here")
        if said:
            out.print(said)
        show_plan(out, p, curve)
    raise typer.Exit(EXIT_OK if p.fits else EXIT_PROBLEM)
