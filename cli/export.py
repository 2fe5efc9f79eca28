"""moet-cache export."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moet_cache.units import fmt_bytes

from ._common import JsonOpt, QuietOpt, kill_hook
from ._output import Output
from ._progress import cancel_token, progress_for


def export(
    cache: Annotated[Path, typer.Argument(help="A cache built with --lossless.")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="A new folder for the NVFP4 checkpoint.")],
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write the NVFP4 checkpoint again, in the source's layout: every tensor exact (bytes, dtype, shape,
    shard); the shard files are not byte-identical (their headers are moet-cache's). Resumes when rerun."""
    from moet_cache import export_checkpoint  # here, not at the top: it imports torch (seconds)
    out = Output(json_, quiet)
    r = export_checkpoint(cache, out_dir, progress_for(out), cancel_token(), kill_hook())
    if out.json_mode:
        out.json({"command": "export", **r.__dict__})
    else:
        out.print(f"exported {r.tensors} tensors in {r.shards} shards ({fmt_bytes(r.bytes_written)}) to {r.out}")
