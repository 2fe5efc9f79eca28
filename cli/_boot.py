"""The boot check in front of the commands that read a cache without verifying it (inspect, plan).

A cache with a missing, cut or non-plain file, or no commit record, is refused with the verifier's own
line (exit 1) before any manifest is summarised: a figure from a damaged cache is not a figure.
"""

from __future__ import annotations

from pathlib import Path

from moet_cache.cache.cacheview import CacheView
from moet_cache.errors import VerificationError
from moet_cache.verify import CORRUPT, INCOMPLETE, STALE, Problem, ProblemKind, boot_view

from ._output import Output


def boot_failure(cache: Path, problems: tuple[Problem, ...], state_text: str) -> str:
    """One line: what the boot check found (its first problem; how many more)."""
    first = problems[0].describe() if problems else "no details"
    more = f"; and {len(problems) - 1} more" if len(problems) > 1 else ""
    return f"{cache}: the cache is {state_text} ({first}{more})"


def checked_view(cache: Path, out: Output) -> CacheView:
    """The cache's view after a boot check that found it complete; a damaged or unfinished cache raises
    VerificationError (exit 1); a cache whose source changed is read, with a warning."""
    report, view = boot_view(cache)
    if report.state in (INCOMPLETE, CORRUPT) or view is None:
        damage = tuple(p for p in report.problems if p.kind != ProblemKind.CHANGED)
        raise VerificationError(boot_failure(cache, damage, report.state_text),
                                f"`moet-cache verify {cache}` lists every problem; run `moet-cache build SRC "
                                f"{cache}` to finish or repair it", list(report.problems))
    if report.state == STALE:
        out.warn(f"{cache}: {report.state_text} (the figures are the cache's, not the changed source's)")
    return view
