"""moet-cache inspect."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moet_cache.cache.inspection import inspect_view
from moet_cache.cache.quality_curve import QUALITY_DOC
from moet_cache.units import fmt_bytes

from ._boot import checked_view
from ._common import JsonOpt, QuietOpt
from ._output import Output


def inspect(
    cache: Annotated[Path, typer.Argument(help="The cache folder.")],
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Per layer: experts, base bytes, delta experts and bytes, base-only relative error; totals; source."""
    out = Output(json_, quiet)
    info = inspect_view(checked_view(cache, out))  # the boot check first: no summary of a damaged cache
    if out.json_mode:
        out.json({"command": "inspect", **info.__dict__})
        return
    # The source format and scale form get columns only where layers differ (V4's drafter beside its main
    # layers); one line below says them otherwise, which keeps the table within 80 columns.
    forms = sorted({(i.source_format, i.scale_form) for i in info.layers})
    varied = len(forms) > 1
    rows = [[i.layer, i.kind, i.experts, fmt_bytes(i.base_bytes), i.delta_experts, fmt_bytes(i.delta_bytes),
             f"{i.rel_error_mean:.4f}", f"{i.rel_error_worst:.4f} #{i.worst_expert}", f"{i.rel_error_served:.4f}",
             *([i.source_format, i.scale_form] if varied else [])]
            for i in info.layers]
    out.table(f"{cache} (rel. err = relative weight error; served = with the tier at FP4)",
              ["layer", "kind", "experts", "base", "tier", "tier bytes", "rel. err", "worst", "served",
               *(["format", "scales"] if varied else [])], rows)
    if forms and not varied:
        out.print(f"every layer: source format {forms[0][0]}, block scales {forms[0][1]} (w13/w2)")
    b = info.build
    out.print(f"source: {info.source_path} ({info.family or 'deepseek_v3'}, {info.source_layout}); built {info.created} "
              f"by moet-cache {info.tool_version}")
    if info.served_blocks:
        out.print(f"served: {info.served_blocks}")
    d = info.drafter
    if d is not None:
        out.print(f"drafter: {d.layout}, blocks {', '.join(d.blocks)} (cache layers {', '.join(map(str, d.layers))}): "
                  f"planes {fmt_bytes(d.base_bytes)}, dense {fmt_bytes(d.dense_bytes)}, tier {fmt_bytes(d.tier_bytes)} "
                  f"({d.tier_experts} experts)")
    out.print(f"build: layers {b.layers[0]}-{b.layers[-1]} ({len(b.layers)}), lossless={b.lossless}, "
              f"include_drafter={b.include_mtp}, delta budget {fmt_bytes(b.delta_budget_bytes)}, "
              f"profile {'yes' if b.profile_xxh3 else 'none'}, base tables {b.base_table}")
    out.print(f"totals: base {fmt_bytes(info.base_bytes)}, delta tier {fmt_bytes(info.delta_tier_bytes)} "
              f"({info.tier_experts}/{info.total_experts} experts), lossless deltas {fmt_bytes(info.delta_all_bytes)}, "
              f"dense {fmt_bytes(info.dense_bytes)}, all files {fmt_bytes(info.total_bytes)}")
    if info.mid_experts:
        out.print(f"mid tier: {info.mid_experts}/{info.total_experts} experts at 3 bits, {fmt_bytes(info.mid_tier_bytes)} "
                  f"of mid planes and tables (budget {fmt_bytes(b.mid_budget_bytes)})")
    r = info.reference_kl
    if r is not None and r.mid_fraction:
        out.print(f"tier {r.fraction:.1%} and mid tier {r.mid_fraction:.1%} of the main layers' experts: on the "
                  f"{r.reference.upper()} reference model a default build with a tier and mid tier of those fractions "
                  f"gives KL to FP4 {r.kl:.4f} nats a byte ({QUALITY_DOC})")
    elif r is not None:
        out.print(f"tier {r.fraction:.1%} of the main layers' experts: on the {r.reference.upper()} reference model "
                  f"a default build's tier of that fraction gives KL to FP4 {r.kl:.4f} nats a byte ({QUALITY_DOC})")
