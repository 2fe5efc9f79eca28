"""retier_cache: a new delta tier for a --lossless cache, from its own delta files, without the source."""

from __future__ import annotations

import os
from dataclasses import replace
from functools import partial
from pathlib import Path

from ..cache.cacheview import CacheView, file_matches, open_uncommitted_view
from ..cancel import CancelToken, check as check_cancel
from ..cache.commit import KillHook, changing
from ..errors import InputError, VerificationError
from ..cache.manifest import COMMIT_RECORD, ManifestError, utc_now
from ..cache.tiering import check_profile, choose_tier, load_profile
from ..units import parse_budget
from ..verify.boot import boot_view
from ..verify.report import UNVERIFIED, VERIFIED, Problem, ProblemKind, VerifyReport
from .options import RetierResult
from .tier import TIER_PART, TIER_ROLES, file_deltas, tier_candidates, tier_key, write_tier
from .written import sweep


def retier_cache(cache: str | os.PathLike[str], delta_budget: str, profile: str | None = None,
                 wait: bool = False, cancel: CancelToken | None = None,
                 kill_at: KillHook | None = None) -> RetierResult:
    """Choose a new delta tier for a --lossless cache, without the source; recommits the cache.

    It first proves every file it keeps (the boot check, and a re-hash of what changed since the last
    verification) and checks every delta plane it copies against its digest: a damaged, incomplete or
    unreadable cache is a VerificationError (exit 1), and the cache is left as it was.

    The same commit protocol as a build (moet_cache.cache.commit): interrupted with Ctrl-C, SIGTERM or `cancel`
    it puts the previous commit back where it can prove nothing changed; killed inside its window it leaves
    the cache uncommitted, and the same command resumes it (from cache.json, re-hashing the files it keeps).
    """
    root = Path(cache)
    with changing(root, wait, kill_at) as commits:
        cf = _retier_source(root, cancel)
        m = cf.manifest
        total = sum(lm.n_experts * lm.expert_delta_bytes for lm in cf.layers.values())
        budget = parse_budget(delta_budget, total, what="delta budget")
        prof = load_profile(profile) if profile else None
        if prof:
            check_profile(prof, {layer: lm.n_experts for layer, lm in cf.layers.items()})
        chosen = choose_tier(tier_candidates(cf.layers, prof), budget)
        if cancel is not None:
            cancel.check()
        commits.uncommit()
        deltas = file_deltas(root, cf.layers)  # each copied plane's tensor checked against its digest
        key = tier_key({r.layer: r.xxh3 for r in m.layers}, budget, prof.digest if prof else None)
        tier = write_tier(root, cf.layers, chosen, deltas, budget, prof, key, cancel)
        keep = [f for f in m.files if f.role not in TIER_ROLES and f.path != TIER_PART]
        new = replace(m, created=utc_now(), files=(*keep, *tier),
                      build=replace(m.build, delta_budget_bytes=budget, profile_xxh3=prof.digest if prof else None,
                                    mid_budget_bytes=0))  # the mid planes need the source: not carried
        if cancel is not None:
            cancel.check()  # the last moment a cancel is taken: from here the commit runs to its end
        commits.commit(new, partial(sweep, root))
        used = sum(cf.layers[layer].expert_delta_bytes * len(ex) for layer, ex in chosen.items())
        return RetierResult(str(root), budget, sum(len(ex) for ex in chosen.values()), used, tier[0].size,
                            prof is not None)


def _retier_source(root: Path, cancel: CancelToken | None = None) -> CacheView:
    """The cache to re-tier, every file it keeps proven: the committed one, its files unchanged since the last
    verification (the boot check) or re-hashed now where they changed (a copy, a touch, a retier killed
    before it recorded its commit); or the one a killed retier (or build) left uncommitted, every kept file
    re-hashed. The tier itself is rewritten anyway. A retier recommits the cache as verified, so anything
    else is refused (exit 1): a corrupt or incomplete cache, a kept file that does not match its digest."""
    changed: set[str] | None = None  # None: re-hash every kept file
    if (root / COMMIT_RECORD).is_file():
        report, view = boot_view(root, check_source=False)  # retier does not need the source: staleness aside
        if view is None or report.state not in (VERIFIED, UNVERIFIED):
            raise _refuse(root, report)
        cf, changed = view, {p.path for p in report.problems if p.kind == ProblemKind.CHANGED}
    else:
        try:
            cf = open_uncommitted_view(root)
        except ManifestError as e:
            raise InputError(f"{root} is not committed and cannot be resumed without the source: {e.message}",
                             "run moet-cache build SRC CACHE (with --lossless) to finish it") from None
    if not cf.manifest.build.lossless:
        raise InputError("only a --lossless cache keeps every delta plane, so only it can be re-tiered",
                         "build again with the new --delta-budget (the source is needed)")
    _rehash_kept(root, cf, changed, cancel)
    return cf


def _rehash_kept(root: Path, cf: CacheView, paths: set[str] | None, cancel: CancelToken | None) -> None:
    """Every file the new commit keeps (of `paths`; all when None) still matches its digest, re-hashed now
    (`cancel` is looked at between files)."""
    for f, _ in cf.files:
        check_cancel(cancel)
        if f.role in TIER_ROLES or f.path == TIER_PART or paths is not None and f.path not in paths:
            continue
        if not file_matches(root, f):
            where = f"{root}:" if paths is not None else f"{root} is not committed and"
            raise VerificationError(f"{where} {f.path} does not match its record (xxh3-128) or cannot be "
                                    "read, so the cache is not re-tiered", "run moet-cache verify --full for the details, "
                                    "then moet-cache build SRC CACHE (with --lossless) to repair it",
                                    [Problem(ProblemKind.DIGEST, f.path, "contents differ from the manifest")])


def _refuse(root: Path, report: VerifyReport) -> VerificationError:
    """Why a committed cache is not re-tiered (corrupt, incomplete), and what to do first."""
    return VerificationError(f"{root} is {report.state_text}, so it is not re-tiered: {report.problems_text()}",
                             "run moet-cache verify --full for the details, then moet-cache build SRC CACHE "
                             "(with --lossless) to repair it", list(report.problems))
