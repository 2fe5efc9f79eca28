"""The boot check, run at every start (serve, load, retier, a build's "nothing to do"): the commit record,
the manifests, each listed file's stats against the recorded verified state, the small files' digests,
coverage of every served layer, and whether the source changed since the build."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ..cache import layout as L
from ..cache.cacheview import CacheView, ListedFileError, entry_digest, open_view
from ..cache.folders import EMPTY_DETAIL, FolderKind, require_cache_folder
from ..fsutil import lock_is_held
from ..hashing import xxh3_file_hex
from ..cache.manifest import CACHE_MANIFEST, COMMIT_RECORD, DeltaIndex, FileEntry, ManifestError
from .report import CORRUPT, INCOMPLETE, STALE, UNVERIFIED, VERIFIED, Check, Problem, ProblemKind, VerifyReport
from .state import recorded_damage, recorded_speed, stat_key, verified_state

# The opened-cache view by its older names (the loader's Cache.files, the tests, the campaign).
CacheFiles = CacheView
load_cache_files = open_view


def _structure(cf: CacheView, reported: set[str]) -> list[Problem]:
    """Coverage: every served layer has its manifest, its base file and its delta-index entry.
    `reported`: paths that already have a problem (missing, wrong size, a link), not read again here."""
    problems = []
    for layer in cf.manifest.build.layers:
        lm = cf.layers.get(layer)
        if lm is None:
            problems.append(Problem(ProblemKind.COVERAGE, CACHE_MANIFEST, "served layer has no layer manifest", layer))
        elif not any(f.role == L.Role.BASE for f in lm.files):
            problems.append(Problem(ProblemKind.COVERAGE, L.layer_manifest(layer), "no base-plane file", layer))
    if not any(f.role == L.Role.AUX and f.path == f"{L.AUX_DIR}/config.json" for f in cf.manifest.files):
        problems.append(Problem(ProblemKind.COVERAGE, CACHE_MANIFEST, f"the cache's model folder lists no config.json "
                                f"({L.AUX_DIR}/config.json): a server could not start from it"))
    idx = cf.manifest.file(L.Role.DELTA_INDEX)
    if idx is None or cf.manifest.file(L.Role.PACK) is None:
        return problems + [Problem(ProblemKind.COVERAGE, L.DELTA_INDEX, "the cache lists no delta tier")]
    if idx.path in reported:
        return problems
    try:
        index = cf.delta_index
    except ListedFileError as e:  # the boot check reads this small file anyway: a damaged one is not trusted
        return problems + [Problem(ProblemKind.DIGEST, e.path, e.message)]
    assert index is not None
    have = {layer for layer, _ in index.layers}
    for layer in cf.manifest.build.layers:
        if layer not in have:
            problems.append(Problem(ProblemKind.COVERAGE, idx.path, "served layer has no delta-index entry", layer))
    for layer, experts in index.layers:
        n = cf.layers[layer].n_experts if layer in cf.layers else 0
        if any(e >= n for e in experts):
            problems.append(Problem(ProblemKind.COVERAGE, idx.path, f"delta index names an expert >= {n}", layer))
    return problems + _mid_structure(cf, index, idx.path)


def _mid_structure(cf: CacheView, index: DeltaIndex, path: str) -> list[Problem]:
    """The mid tier's coverage: there when the build asked for one, an entry per served layer, experts that
    exist and are not also in the 4-bit tier."""
    if index.mid_layers is None:
        return [Problem(ProblemKind.COVERAGE, path, "the build asked for a mid tier and the delta index has none")] \
            if cf.manifest.build.mid_budget_bytes else []
    problems = []
    have = {layer for layer, _ in index.mid_layers}
    for layer in cf.manifest.build.layers:
        if layer not in have:
            problems.append(Problem(ProblemKind.COVERAGE, path, "served layer has no mid-tier entry", layer))
    for layer, experts in index.mid_layers:
        n = cf.layers[layer].n_experts if layer in cf.layers else 0
        if any(e >= n for e in experts):
            problems.append(Problem(ProblemKind.COVERAGE, path, f"the mid tier names an expert >= {n}", layer))
        if set(experts) & set(index.experts_of(layer) or ()):
            problems.append(Problem(ProblemKind.COVERAGE, path, "an expert is in both the delta and the mid tier",
                                    layer))
    return problems


def _source_changes(cf: CacheView) -> tuple[bool, list[Problem]]:
    src = Path(cf.manifest.source_path)
    if not src.is_dir():
        return False, []
    problems = []
    fp = cf.manifest.source_fingerprint
    cfg = src / "config.json"
    if cfg.is_file() and xxh3_file_hex(cfg, follow=True) != fp.config_xxh3:
        problems.append(Problem(ProblemKind.STALE, "config.json", "the source's config.json changed"))
    for shard in fp.shards:
        p = src / shard.name
        try:
            st = p.stat()
        except FileNotFoundError:
            problems.append(Problem(ProblemKind.STALE, shard.name, "the source shard is gone"))
            continue
        except OSError as e:  # there, but the disk fails it: say so, not "gone"
            problems.append(Problem(ProblemKind.STALE, shard.name, f"the source shard cannot be read: {e.strerror or e}"))
            continue
        if st.st_size != shard.size:
            problems.append(Problem(ProblemKind.STALE, p.name,
                                    f"the source shard's size changed ({shard.size} -> {st.st_size})"))
        elif st.st_mtime_ns != shard.mtime_ns:
            from ..source.checkpoint import header_digest  # here: checkpoint imports torch (seconds), rarely needed
            same_header = header_digest(p) == shard.header_xxh3
            problems.append(Problem(ProblemKind.STALE, p.name, "the source shard was rewritten since the build"
                                    + ("" if same_header else " (its header differs)")))
    return True, problems


def boot_check(root: str | os.PathLike[str], check_source: bool = True) -> VerifyReport:
    """The cheap check for every boot: manifests, file stats, commit record, coverage, source staleness."""
    return boot_view(root, check_source)[0]


def boot_view(root: str | os.PathLike[str], check_source: bool = True) -> tuple[VerifyReport, CacheView | None]:
    """The boot check, and the opened-cache view it checked (None when the manifests could not be read):
    a command that goes on to read the cache (load, serve, --against) reads it through this view."""
    t0 = time.perf_counter()
    root = Path(root)
    kind = require_cache_folder(root)  # a typo, a file, a checkpoint: named as what it is (exit 2)
    if not (root / COMMIT_RECORD).is_file():
        detail = EMPTY_DETAIL if kind == FolderKind.EMPTY else \
            "a build is running" if lock_is_held(root) else "no commit record: the build did not finish"
        return VerifyReport(Check.BOOT, INCOMPLETE, (Problem(ProblemKind.COMMIT, COMMIT_RECORD, detail),), 0,
                            seconds=time.perf_counter() - t0), None
    try:
        cf = open_view(root)
    except ManifestError as e:
        return VerifyReport(Check.BOOT, CORRUPT, (Problem(ProblemKind.MANIFEST, CACHE_MANIFEST, e.message),), 0,
                            seconds=time.perf_counter() - t0), None
    state = verified_state(root, cf.manifest_xxh3)
    recorded = state["files"] if state else {}
    damaged = recorded_damage(state)
    problems: list[Problem] = []
    changed: list[Problem] = []
    for f, layer in cf.files:
        p = root / f.path
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            problems.append(Problem(ProblemKind.MISSING, f.path, "file is missing", layer))
            continue
        except OSError as e:  # an I/O error is not a missing file: say what the system said
            problems.append(Problem(ProblemKind.UNREADABLE, f.path, f"cannot stat: {e.strerror or e}", layer))
            continue
        if not os.path.isfile(p) or os.path.islink(p):
            problems.append(Problem(ProblemKind.LINK, f.path, "not a plain file", layer))
        elif st.st_size != f.size:
            problems.append(Problem(ProblemKind.SIZE, f.path,
                                    f"size is {st.st_size}, the manifest says {f.size}", layer))
        elif f.path in damaged:
            at = state.get("at") if state else None
            problems.append(Problem(ProblemKind.DIGEST, f.path, f"the last verify --full ({at}) found it damaged "
                                    f"({damaged[f.path]}); build the cache again to repair it", layer))
        elif (bad := _small_file_problem(root, f, layer)) is not None:
            problems.append(bad)
        elif recorded.get(f.path) != stat_key(st):
            changed.append(Problem(ProblemKind.CHANGED, f.path, _how_changed(recorded.get(f.path), st), layer))
    problems += _structure(cf, {p.path for p in problems})
    present, stale = _source_changes(cf) if check_source else (None, [])
    if any(p.kind == ProblemKind.MISSING for p in problems) and not any(
            p.kind in (ProblemKind.SIZE, ProblemKind.LINK, ProblemKind.DIGEST, ProblemKind.UNREADABLE) for p in problems):
        verdict = INCOMPLETE
    elif problems:
        verdict = CORRUPT
    elif stale:
        verdict = STALE
    elif changed or state is None:
        verdict = UNVERIFIED
    else:
        verdict = VERIFIED
    details: dict[str, Any] = {}
    if verdict == UNVERIFIED:
        details = _full_cost(cf, changed, recorded_speed(state or verified_state(root, None)))
    return VerifyReport(Check.BOOT, verdict, tuple(problems + stale + changed), len(cf.files),
                        seconds=time.perf_counter() - t0, verified_by=state.get("by") if state else None,
                        verified_at=state.get("at") if state else None, source_present=present, details=details), cf


#: The small files the boot check hashes on every start (what vLLM reads from model/, the records a build
#: resumes from, the source map): cheap next to the planes, and read by a server without any other check.
#: Layer manifests and the delta index are hashed when the view and the coverage check read them.
SMALL_ROLES = (L.Role.AUX, L.Role.SOURCE_CONFIG, L.Role.PART, L.Role.SOURCE_MAP)


def _small_file_problem(root: Path, f: FileEntry, layer: int | None) -> Problem | None:
    """A small listed file's bytes against its digest (hashed through the read seam); None when they match
    or when `f` is not one of the small files."""
    if f.role not in SMALL_ROLES:
        return None
    try:
        digest = entry_digest(root, f)
    except OSError as e:
        return Problem(ProblemKind.UNREADABLE, f.path, f"cannot be read ({e.strerror or e}); check the disk", layer)
    if digest != f.xxh3:
        return Problem(ProblemKind.DIGEST, f.path, "contents differ from the manifest (xxh3-128 mismatch); "
                       "build the cache again to repair it", layer)
    return None


def _how_changed(recorded: Any, st: os.stat_result) -> str:
    """Plain words for a file whose stats differ from the last verification: not damage, just not proven."""
    if isinstance(recorded, list) and len(recorded) == 3 and recorded[:2] == [st.st_size, st.st_mtime_ns]:
        return "copied since the last full verify (same size and time, another inode; e.g. cp -a)"
    if isinstance(recorded, list) and len(recorded) == 3:
        return "touched or rewritten since the last full verify (same size, another modification time)"
    return "not yet verified on this copy (no record of it)"


def _full_cost(cf: CacheView, changed: list[Problem], speed: float | None) -> dict[str, Any]:
    """What one `verify --full` costs: every listed byte, and the time at the speed recorded here."""
    total = sum(f.size for f, _ in cf.files)
    copied = sum(1 for p in changed if p.detail.startswith("copied"))
    return {"changed_files": len(changed), "copied_files": copied, "touched_files": len(changed) - copied,
            "full_verify_bytes": total, "hash_bytes_per_second": speed,
            "full_verify_seconds_estimate": round(total / speed, 1) if speed else None}
