"""Verify a cache: the boot check (stats and small manifests only), a full re-hash, or against the source.

Each check returns a frozen report and prints nothing; the CLI turns it into output and an exit code.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterable

from . import layout as L
from .manifest import utc_now
from .enums import StrEnum, TensorKind
from .cacheview import CacheView, ListedFileError, entry_digest, open_view, read_committed_manifest
from .errors import InputError, VerificationError
from .folders import EMPTY_DETAIL, FolderKind, require_cache_folder
from .fsutil import atomic_write_json, file_id, lock_is_held, open_regular, pread_into, read_json_file, refuse_links
from .hashing import xxh3_file_hex, xxh3_hex
from .machine import usable_cores
from .manifest import CACHE_MANIFEST, COMMIT_RECORD, VERIFIED_STATE, CacheManifest, DeltaIndex, FileEntry, ManifestError, TensorEntry
from .cancel import CancelToken, check as check_cancel
from .progress import NullProgress, Progress
from .window import bounded_window



class State(StrEnum):
    """A check's verdict on a cache, most serious first."""

    CORRUPT = "corrupt"
    INCOMPLETE = "incomplete"
    STALE = "stale"
    UNVERIFIED = "unverified"
    VERIFIED = "verified"


class Check(StrEnum):
    """Which check made a report."""

    BOOT = "boot"          # stats and small manifests only
    FULL = "full"          # every listed byte re-hashed
    AGAINST = "against"    # the cache's planes rebuilt from the source and compared


class VerifiedBy(StrEnum):
    """What recorded a cache's stats as verified (.state/verified.json's `by`)."""

    BUILD = "build"
    FULL = "full"


# The states by the short names the code and tests use.
CORRUPT, INCOMPLETE, STALE, UNVERIFIED, VERIFIED = State
STATE_TEXT = {
    VERIFIED: "complete and verified",
    UNVERIFIED: "complete, not re-verified since a change",
    INCOMPLETE: "incomplete",
    STALE: "stale: the source changed since the build",
    CORRUPT: "corrupt",
}


class ProblemKind(StrEnum):
    """What is wrong with one file or record of a cache."""

    MISSING = "missing"          # a listed file is not there
    SIZE = "size"                # its size is not the listed one
    DIGEST = "digest"            # its bytes do not match the listed digest
    UNREADABLE = "unreadable"    # it cannot be read (an I/O error)
    LINK = "link"                # not a plain file (a link, a folder)
    MANIFEST = "manifest"        # a manifest is malformed or does not match its record
    COMMIT = "commit"            # no commit record (or a build is running)
    COVERAGE = "coverage"        # a served layer lacks its manifest, base file or delta-index entry
    STALE = "stale"              # the source changed since the build
    CHANGED = "changed"          # stats differ from the last verification: not damage, not proven either
    MISMATCH = "mismatch"        # the cache's planes differ from the source's (verify --against)


@dataclass(frozen=True)
class Problem:
    kind: ProblemKind
    path: str
    detail: str
    layer: int | None = None
    tensor: str | None = None

    def describe(self) -> str:
        where = self.path
        if self.layer is not None:
            where += f" (layer {self.layer}" + (f", tensor {self.tensor})" if self.tensor else ")")
        return f"{where}: {self.detail}"


@dataclass(frozen=True)
class VerifyReport:
    mode: Check
    state: State
    problems: tuple[Problem, ...]
    files_checked: int
    bytes_hashed: int = 0
    seconds: float = 0.0
    verified_by: str | None = None   # what the last recorded verification was (VerifiedBy; read back from disk)
    verified_at: str | None = None
    source_present: bool | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.state == VERIFIED

    @property
    def complete(self) -> bool:
        return self.state in (VERIFIED, UNVERIFIED)

    @property
    def state_text(self) -> str:
        return STATE_TEXT[self.state]

    def problems_text(self, limit: int = 3) -> str:
        """The first `limit` problems in one line, and how many more there are."""
        first = "; ".join(p.describe() for p in self.problems[:limit])
        more = f" (and {len(self.problems) - limit} more)" if len(self.problems) > limit else ""
        return first + more


# The opened-cache view by the verifier's older names (the loader's Cache.files, the tests, the campaign).
CacheFiles = CacheView
load_cache_files = open_view


def _stat_key(st: os.stat_result) -> list[int]:
    return list(file_id(st))  # as JSON keeps it


def record_verified_state(root: Path, manifest: CacheManifest, manifest_xxh3: str, by: VerifiedBy,
                          bytes_per_second: float | None = None, view: CacheView | None = None,
                          damaged: dict[str, str] | None = None, unproven: Collection[str] = ()) -> None:
    """Remember each file's (size, mtime_ns, inode) after a build or a full verify, for the boot check,
    and the speed this machine hashed the cache at (kept from the previous record when none is given).
    `view`: the committed cache as the caller opened it (--full: the view it hashed); else opened here.
    `damaged`: what a failed --full found ({path: what}): those files get no stats, and the boot check
    reports them as corrupt until a build replaces them or a --full finds them whole; `unproven`: other
    files the --full did not hash (missing, a link, the wrong size), which get no stats either."""
    refuse_links(root, (".state",))
    cf = view if view is not None else open_view(root)
    damaged = damaged or {}
    stats = {f.path: _stat_key((root / f.path).stat()) for f, _ in cf.files
             if f.path not in damaged and f.path not in unproven}
    for name in (CACHE_MANIFEST, COMMIT_RECORD):
        stats[name] = _stat_key((root / name).stat())
    if bytes_per_second is None:
        bytes_per_second = _recorded_speed(_verified_state(root, None))
    doc = {"format": "moet-cache-verified", "format_version": 1, "manifest_xxh3": manifest_xxh3,
           "by": by, "at": utc_now(), "files": stats, "hash_bytes_per_second": bytes_per_second}
    if damaged:
        doc["damaged"] = dict(sorted(damaged.items()))
    atomic_write_json(root / VERIFIED_STATE, doc)


def _recorded_damage(state: dict[str, Any] | None) -> dict[str, str]:
    """What the last --full of this manifest found damaged ({path: what}); empty when it found nothing."""
    damaged = state.get("damaged") if state else None
    if not isinstance(damaged, dict):
        return {}
    return {k: v if isinstance(v, str) else "damaged" for k, v in damaged.items() if isinstance(k, str)}


MIN_SPEED_SAMPLE = 256 << 10  # fewer bytes hashed than this say nothing about a disk's speed


def speed_sample(nbytes: int, seconds: float) -> float | None:
    """Bytes a second, from enough bytes hashed to mean something; else None (nothing recorded)."""
    return nbytes / seconds if nbytes >= MIN_SPEED_SAMPLE and seconds > 0 else None


def _recorded_speed(state: dict[str, Any] | None) -> float | None:
    v = state.get("hash_bytes_per_second") if state else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 1e3 < v < 1e13 else None


def _verified_state(root: Path, manifest_xxh3: str | None) -> dict[str, Any] | None:
    """The record of the last build or full verify (of this manifest; of any when `manifest_xxh3` is None)."""
    try:
        doc = read_json_file(root / VERIFIED_STATE)
    except InputError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict) or \
            manifest_xxh3 is not None and doc.get("manifest_xxh3") != manifest_xxh3:
        return None
    return doc


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
            from .checkpoint import header_digest  # here: checkpoint imports torch (seconds), rarely needed
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
    state = _verified_state(root, cf.manifest_xxh3)
    recorded = state["files"] if state else {}
    damaged = _recorded_damage(state)
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
        elif recorded.get(f.path) != _stat_key(st):
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
        details = _full_cost(cf, changed, _recorded_speed(state or _verified_state(root, None)))
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


UNREADABLE = "unreadable"


def _hash_file(root: Path, f: FileEntry) -> tuple[FileEntry, str | None]:
    """(entry, digest); digest None: missing, a link or the wrong size (a boot-check problem already);
    UNREADABLE + the error: the file is there but a read failed (EIO, EACCES): it is not verified."""
    try:
        return f, entry_digest(root, f)
    except OSError as e:
        return f, f"{UNREADABLE}: {e.strerror or e}"


def _bad_tensors(root: Path, f: FileEntry, tensors: Iterable[TensorEntry]) -> list[str]:
    """Which tensors of a damaged file no longer match their digests."""
    bad = []
    try:
        fd = open_regular(root / f.path)
    except OSError:
        return bad
    try:
        for t in tensors:
            if t.file != f.path:
                continue
            buf = memoryview(bytearray(t.end - t.begin))
            try:
                n = pread_into(fd, buf, t.begin)
            except OSError:
                n = -1
            if n != buf.nbytes or xxh3_hex(buf) != t.xxh3:
                bad.append(t.name)
    finally:
        os.close(fd)
    return bad


def full_verify(root: str | os.PathLike[str], workers: int | None = None,
                progress: Progress | None = None, cancel: CancelToken | None = None) -> VerifyReport:
    """Re-hash every byte of every listed file in parallel; on success, record it for the boot check.
    `cancel` stops it between files (Interrupted); nothing is recorded then."""
    t0 = time.perf_counter()
    root = Path(root)
    progress = progress or NullProgress()
    boot, view = boot_view(root)
    if view is None:  # no commit record, or manifests that cannot be read: nothing to hash against
        return VerifyReport(Check.FULL, boot.state, boot.problems, 0, seconds=time.perf_counter() - t0)
    cf = view
    total = sum(f.size for f, _ in cf.files)
    progress.start(total, "verify")
    # "changed" is what --full settles; a "digest" or "unreadable" problem (a small file's, or the damage a
    # previous --full recorded) comes back from the re-hash below if it is still there
    problems = [p for p in boot.problems
                if p.kind not in (ProblemKind.CHANGED, ProblemKind.DIGEST, ProblemKind.UNREADABLE)]
    hashed = 0
    layer_of = {f.path: layer for f, layer in cf.files}
    n_workers = workers or min(8, usable_cores())
    with ThreadPoolExecutor(max_workers=n_workers) as pool:
        for f, digest in bounded_window(lambda fe: pool.submit(_hash_file, root, fe[0]), cf.files,
                                        4 * n_workers, cancel):
            progress.advance(f.size)
            if digest is None:
                continue  # missing or wrong size: already a boot-check problem
            if digest.startswith(UNREADABLE):
                problems.append(Problem(ProblemKind.UNREADABLE, f.path, f"cannot be read ({digest.split(': ', 1)[1]}): "
                                        "its bytes are not verified; check the disk", layer_of.get(f.path)))
                continue
            hashed += f.size
            if digest != f.xxh3:
                layer = layer_of.get(f.path)
                tensors = cf.layers[layer].tensors if layer is not None else ()
                bad = _bad_tensors(root, f, tensors) if tensors else []
                detail = "contents differ from the manifest (xxh3-128 mismatch)"
                if bad:
                    problems.append(Problem(ProblemKind.DIGEST, f.path, detail, layer, ", ".join(bad)))
                else:
                    problems.append(Problem(ProblemKind.DIGEST, f.path,
                                            detail + ("; header or padding damaged" if tensors else ""), layer))
    progress.finish()
    if problems:
        verdict = INCOMPLETE if all(p.kind in (ProblemKind.MISSING, ProblemKind.COMMIT) for p in problems) else CORRUPT
        if all(p.kind == ProblemKind.STALE for p in problems):
            verdict = STALE
    else:
        verdict = VERIFIED
        secs = time.perf_counter() - t0
        record_verified_state(root, cf.manifest, cf.manifest_xxh3, by=VerifiedBy.FULL,
                              bytes_per_second=speed_sample(hashed, secs), view=cf)
    damaged = {p.path: p.detail for p in problems if p.kind in (ProblemKind.DIGEST, ProblemKind.UNREADABLE)}
    if damaged:
        # Remembered, so that the boot check (every serve, load, retier, build's "nothing to do") refuses the
        # cache until a build replaces these files or a later --full finds them whole.
        record_verified_state(root, cf.manifest, cf.manifest_xxh3, by=VerifiedBy.FULL, view=cf, damaged=damaged,
                              unproven={p.path for p in problems})
    ok = verdict == VERIFIED
    return VerifyReport(Check.FULL, verdict, tuple(problems), len(cf.files), bytes_hashed=hashed,
                        seconds=time.perf_counter() - t0, verified_by=VerifiedBy.FULL if ok else None,
                        verified_at=utc_now() if ok else None,
                        source_present=boot.source_present)


def cache_read_errors(fn: Any) -> Any:
    """A cache file that safetensors cannot read although its manifest passed is a damaged cache (exit 1)."""
    import functools

    from safetensors import SafetensorError

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SafetensorError as e:
            raise VerificationError(f"a cache file is not readable safetensors: {e}",
                                    "run moet-cache verify --full, then build the cache again") from None
    return wrapper


def _against_listed(cf: CacheView) -> list[Problem]:
    """What --against needs the cache to list: its source map and model config, both readable."""
    problems: list[Problem] = []
    if cf.manifest.file(L.Role.SOURCE_MAP) is None:
        problems.append(Problem(ProblemKind.COVERAGE, CACHE_MANIFEST,
                                "the cache lists no source map (source-map.json)"))
    if not any(f.role == L.Role.AUX and f.path.rsplit("/", 1)[-1] == "config.json" for f, _ in cf.files):
        problems.append(Problem(ProblemKind.COVERAGE, CACHE_MANIFEST,
                                f"the cache lists no model config ({L.AUX_DIR}/config.json)"))
    try:
        cf.delta_index, cf.source_map  # noqa: B018 - read (and checked) now, so damage is reported here
    except ListedFileError as e:
        problems.append(Problem(ProblemKind.DIGEST, e.path, e.message))
    return problems


def _differs(got: Any, want: Any) -> bool:
    """Whether two arrays (or scalars) differ in any byte."""
    import numpy as np
    a, b = (np.ascontiguousarray(np.asarray(v).reshape(-1)).view(np.uint8) for v in (got, want))
    return not np.array_equal(a, b)


@dataclass(frozen=True)
class _LayerAgainst:
    """One served layer's cache files, open, and what comparing an expert's projection needs of them."""

    layer: int
    lm: Any              # LayerManifest
    geo: Any             # its LayerGeometry, once a layer
    base_path: str
    base: Any            # the base file, a stread.TensorFile (pread, no map)
    all_path: str | None
    all: Any             # the lossless delta file (a TensorFile), or None
    pack: Any            # the tier pack (a TensorFile), or None
    tier: list[int]
    checked: dict[str, int]
    names: frozenset[str] = frozenset()  # the base file's tensor names
    form: str = "fitted"                 # the cache's base-table form (enums.BaseTable): the tables are refit in it
    mid: tuple[int, ...] = ()            # the layer's mid-tier experts (their planes and tables in the pack)

    def expert(self, ck: Any, e: int, want_fmt: Any, progress: Progress) -> list[Problem]:
        """Every projection of expert e against the source, in order; the first one's problems, or none."""
        from .checkpoint import PROJECTIONS
        for j, proj in enumerate(PROJECTIONS):
            x = ck.read_raw_expert(self.layer, e, proj)
            if want_fmt is not None and x.fmt is not want_fmt:
                return [Problem(ProblemKind.MISMATCH, self.base_path, f"expert {e} {proj}: the source is "
                                f"{x.fmt.name}, the cache was built from {want_fmt.name}", self.layer)]
            problems = self.projection(e, j, proj, x)
            progress.advance(x.codes.nbytes)
            ck.release(x.codes)
            if problems:
                return problems
        return []

    def projection(self, e: int, j: int, proj: str, x: Any) -> list[Problem]:
        """Expert e's projection `proj` (j-th) in the cache against the source's raw tensors x."""
        import numpy as np

        from .formats import stored_scales
        from .geometry import is_w13, names_of
        from .planes import code_histogram, fit_base_table, fit_mid_table, mid_plane, split_planes
        problems: list[Problem] = []
        name = f"expert {e} {proj}"

        def mismatch(what: str, tensor: str, path: str = self.base_path) -> None:
            problems.append(Problem(ProblemKind.MISMATCH, path, f"{name}: {what} differs from the source",
                                    self.layer, tensor))
        bf, base, delta = self.base, *split_planes(x.codes)
        base_name, delta_name, scale_name = names_of(proj)
        rows, w13 = self.geo.rows(proj), is_w13(proj)
        at = (e, j) if w13 else (e,)
        if _differs(bf.row(base_name, e)[rows], base):
            mismatch("base plane", base_name)
        try:
            want_scale = stored_scales(x.scale_bytes, x.fmt.scale_form, self.lm.scale_form(scale_name))
        except InputError:
            want_scale = None
        if want_scale is None or _differs(bf.row(scale_name, e)[rows], want_scale):
            mismatch("block scales", scale_name)
        s2 = L.W13_SCALE_2 if w13 else L.W2_SCALE_2
        if _differs(bf.array(s2)[at], np.float32(x.scale_2)):
            mismatch("global scale", s2)
        tname = L.W13_TABLE if w13 else L.W2_TABLE
        if _differs(bf.array(tname)[at], fit_base_table(code_histogram(x.codes), self.form)):
            mismatch(f"{self.form} table (recomputed from the source's codes)", tname)
        iname = L.W13_INPUT_SCALE if w13 else L.W2_INPUT_SCALE
        if (x.input_scale is None) != (iname not in self.names):
            mismatch("presence of an input scale", iname)
        elif x.input_scale is not None and _differs(bf.array(iname)[at],
                                                    np.float32(x.fmt.multiply(x.input_scale))):
            mismatch("input scale", iname)
        self.checked["scales"] += 1 + (x.global_scale is not None) + (x.input_scale is not None)
        self.checked["tables"] += 1
        deltas = []
        if self.all is not None:
            deltas.append((self.all_path, delta_name, self.all.row(delta_name, e)[rows]))
            for kind, t in ((TensorKind.GLOBAL_SCALE, x.global_scale), (TensorKind.INPUT_SCALE, x.input_scale)):
                raw = L.source_scalar(proj, kind)
                if t is not None and _differs(self.all.row(raw, e), t):
                    mismatch(f"source {kind.replace('_', ' ')}", raw, self.all_path)
        if e in self.tier:
            which = L.pack_tensor(self.layer, delta_name)
            deltas.append((L.PACK, which, self.pack.row(which, self.tier.index(e))[rows]))
        for path, tensor, got in deltas:
            self.checked["delta_planes"] += 1
            if _differs(got, delta):
                problems.append(Problem(ProblemKind.MISMATCH, path, f"{name}: delta plane differs from the source",
                                        self.layer, tensor))
        if e in self.mid:
            k = self.mid.index(e)
            plane, table = (L.W13_MID, L.W13_MID_TABLE) if w13 else (L.W2_MID, L.W2_MID_TABLE)
            plane, table = L.pack_tensor(self.layer, plane), L.pack_tensor(self.layer, table)
            self.checked["mid_planes"] += 1
            if _differs(self.pack.row(plane, k)[rows], mid_plane(delta)):
                mismatch("mid plane", plane, L.PACK)
            if _differs(self.pack.array(table)[(k, j) if w13 else (k,)], fit_mid_table(code_histogram(x.codes))):
                mismatch("mid table (recomputed from the source's codes)", table, L.PACK)
        return problems


def _layer_against(root: Path, cf: CacheView, layer: int, ck: Any, pack: Any, checked: dict[str, int],
                   progress: Progress, cancel: CancelToken | None) -> list[Problem]:
    """Every expert of one served layer against the source; the first problems found, or none."""
    from .formats import FORMATS
    from .stread import TensorFile
    lm = cf.layers[layer]
    base_fe = next(f for f in lm.files if f.role == L.Role.BASE)
    all_fe = next((f for f in lm.files if f.role == L.Role.DELTA_ALL), None)
    want_fmt = FORMATS.get(lm.source_format) if lm.source_format else None
    with TensorFile(root, base_fe.path) as bf, ExitStack() as stack:
        allf = stack.enter_context(TensorFile(root, all_fe.path)) if all_fe else None
        la = _LayerAgainst(layer, lm, lm.geometry(), base_fe.path, bf, all_fe.path if all_fe else None, allf,
                           pack, list(cf.tier_experts(layer)), checked, frozenset(bf.keys()),
                           cf.manifest.build.base_table, cf.mid_experts(layer))
        for e in range(lm.n_experts):
            check_cancel(cancel)
            problems = la.expert(ck, e, want_fmt, progress)
            checked["experts"] += 1  # the expert that failed counts as checked, as it always did
            if problems:
                return problems
    return []


@cache_read_errors
def verify_against(root: str | os.PathLike[str], src: str | os.PathLike[str],
                   progress: Progress | None = None, cancel: CancelToken | None = None) -> VerifyReport:
    """Every plane, block scale, global scale, input scale and table of every expert equals what the
    source gives (planes and scales bit for bit, tables recomputed from the source's codes); every dense
    tensor is there and equal; names the first mismatch. A cache the boot check finds incomplete or
    corrupt is reported as such (exit 1), as is one without its model config or source map."""
    # numpy, torch and safetensors are imported inside, not at the top: the boot check (every start of
    # `moet-cache verify`) needs none of them, and torch alone costs seconds of import time.
    from .checkpoint import open_checkpoint
    from .stread import TensorFile
    t0 = time.perf_counter()
    root = Path(root)
    progress = progress or NullProgress()
    boot, cf = boot_view(root, check_source=False)
    if not boot.complete or cf is None:
        return VerifyReport(Check.AGAINST, boot.state, boot.problems, boot.files_checked, seconds=time.perf_counter() - t0)
    problems = _against_listed(cf)
    if problems:
        return VerifyReport(Check.AGAINST, CORRUPT, tuple(problems), len(cf.files), seconds=time.perf_counter() - t0)
    checked = {"experts": 0, "delta_planes": 0, "scales": 0, "tables": 0, "dense_tensors": 0}
    if cf.delta_index is not None and cf.delta_index.mid_layers is not None:
        checked["mid_planes"] = 0
    with open_checkpoint(src) as ck:
        if ck.layout != cf.manifest.source_layout:
            return VerifyReport(Check.AGAINST, CORRUPT, (Problem(ProblemKind.MISMATCH, CACHE_MANIFEST,
                                f"the source is {ck.layout}, the cache was built from {cf.manifest.source_layout}"),),
                                len(cf.files), seconds=time.perf_counter() - t0)
        with ExitStack() as stack:
            pack = stack.enter_context(TensorFile(root, L.PACK)) if cf.delta_index else None
            progress.start(sum(lm.source_bytes for lm in cf.layers.values()), "verify --against")
            for layer in sorted(cf.layers):
                problems = _layer_against(root, cf, layer, ck, pack, checked, progress, cancel)
                if problems:
                    break
        if not problems:
            problems = _dense_against(root, cf, ck, checked, cf.source_map)
    progress.finish()
    return VerifyReport(Check.AGAINST, CORRUPT if problems else VERIFIED, tuple(problems[:1]), len(cf.files),
                        seconds=time.perf_counter() - t0, details=checked)


def _dense_against(root: Path, cf: CacheView, ck: Any, checked: dict[str, int], smap: Any) -> list[Problem]:
    """Every tensor the source map lists that is not a plane of a served layer is in a dense file, equal."""
    from .stread import TensorFile
    planed = ck.expert_tensor_names(list(cf.manifest.build.layers))
    shards = smap.get("shards") if isinstance(smap, dict) else None
    listed = {t[0] for sh in (shards if isinstance(shards, list) else ()) if isinstance(sh, dict)
              for t in (sh.get("tensors") if isinstance(sh.get("tensors"), list) else ())
              if isinstance(t, list) and t and isinstance(t[0], str)}
    seen: set[str] = set()
    for f, _ in cf.files:
        if f.role != L.Role.DENSE:
            continue
        with TensorFile(root, f.path) as df:
            for name in df.keys():
                checked["dense_tensors"] += 1
                seen.add(name)
                ent, want = df.header.tensors[name], ck.tensors.get(name)
                if want is None or (ent.dtype, tuple(ent.shape)) != (want.dtype, tuple(want.shape)) \
                        or _differs(df.raw(name), ck.get_raw(name)):
                    return [Problem(ProblemKind.MISMATCH, f.path,
                                    f"dense tensor {name} differs from the source", None, name)]
    missing = sorted(listed - planed - seen)
    if missing:
        return [Problem(ProblemKind.MISSING, L.DENSE_DIR, f"dense tensor {missing[0]} of the source is in no dense file"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""), None, missing[0])]
    return []


__all__ = ["boot_check", "boot_view", "full_verify", "verify_against", "VerifyReport", "Problem", "load_cache_files",
           "record_verified_state", "read_committed_manifest"]
