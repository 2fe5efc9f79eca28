"""moet-cache verify: the boot check, --full, or --against SRC."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from moet_cache import boot_check, full_verify, verify_against
from moet_cache.units import fmt_bytes
from moet_cache.verify import Check, State, VerifyReport

from ._common import JsonOpt, QuietOpt
from ._errors import EXIT_OK, EXIT_PROBLEM
from ._output import Output, styled
from ._progress import cancel_token, progress_for

MAX_LISTED = 20


def report_exit_code(r: VerifyReport) -> int:
    return EXIT_OK if r.ok else EXIT_PROBLEM


def unverified_hint(r: VerifyReport) -> str:
    """Copied or touched files are not damage: say so, and what one --full costs here."""
    d = r.details
    what = (f"{d['changed_files']} files were copied ({d['copied_files']}) or touched ({d['touched_files']}) "
            "since the last full verify; that is not damage, but the boot check cannot prove their bytes. "
            if d.get("changed_files") else "no full verify is recorded for this cache. ")
    cost = ""
    if d.get("full_verify_bytes") is not None:
        cost = f" It re-hashes {fmt_bytes(d['full_verify_bytes'])} once"
        speed, est = d.get("hash_bytes_per_second"), d.get("full_verify_seconds_estimate")
        if speed and est is not None:
            cost += f", about {est:.0f} s" if est >= 10 else f", about {est:.1f} s"
            cost += f" at the {speed / 1e9:.2f} GB/s measured on this machine."
        else:
            cost += " (no hashing speed recorded here yet)."
    return f"hint: {what}Run `moet-cache verify --full` once to re-hash and record them.{cost}"


def show_report(out: Output, r: VerifyReport, cache: Path) -> None:
    if out.json_mode:
        out.json({"command": "verify", "cache": str(cache), "complete": r.complete,
                  "state_text": r.state_text, **r.__dict__}, report_exit_code(r))
        return
    style = "green" if r.ok else "yellow" if r.complete else "red"
    extra = f", verified by {r.verified_by} at {r.verified_at}" if r.ok and r.verified_by else ""
    speed = f", {r.bytes_hashed / r.seconds / 1e9:.2f} GB/s" if r.bytes_hashed and r.seconds > 0 else ""
    out.print(styled(f"{cache}: {r.state_text}", style, f" ({r.mode} check, {r.files_checked} files, "
                                                           f"{r.seconds:.2f} s{speed}{extra})"))
    for p in r.problems[:MAX_LISTED]:
        out.print(f"  {p.kind}: {p.describe()}")
    if len(r.problems) > MAX_LISTED:
        out.print(f"  ... and {len(r.problems) - MAX_LISTED} more (use --json for all)")
    if r.details and r.mode == Check.AGAINST:
        out.print("  checked: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in r.details.items()))
    if r.state == State.UNVERIFIED:
        out.info(unverified_hint(r))
    elif not r.complete:
        out.info("hint: run `moet-cache build SRC CACHE` again to finish or repair the cache")


def verify(
    cache: Annotated[Path, typer.Argument(help="The cache folder.")],
    full: Annotated[bool, typer.Option("--full", help="Re-hash every byte (and record it for the boot check).")] = False,
    against: Annotated[Optional[Path], typer.Option("--against", metavar="SRC", help="Check every plane against this source checkpoint.")] = None,
    workers: Annotated[Optional[int], typer.Option(min=1, max=64, help="Hashing threads for --full.")] = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Verify a cache. Exit 0: complete and verified; 1: anything else (the report says what)."""
    out = Output(json_, quiet)
    if against is not None:
        r = verify_against(cache, against, progress_for(out), cancel_token())
    elif full:
        r = full_verify(cache, workers, progress_for(out), cancel_token())
    else:
        r = boot_check(cache)
    show_report(out, r, cache)
    raise typer.Exit(report_exit_code(r))
