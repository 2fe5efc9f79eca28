"""The full check (verify --full): every byte of every listed file re-hashed in parallel against its
digest, a damaged file's tensors named, and the outcome recorded for the boot check."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

from ..cache.cacheview import entry_digest
from ..cancel import CancelToken
from ..fsutil import open_regular, pread_into
from ..hashing import xxh3_hex
from ..machine import usable_cores
from ..cache.manifest import FileEntry, TensorEntry, utc_now
from ..progress import NullProgress, Progress
from ..window import bounded_window
from .boot import boot_view
from .report import CORRUPT, INCOMPLETE, STALE, VERIFIED, Check, Problem, ProblemKind, VerifiedBy, VerifyReport
from .state import record_verified_state, speed_sample


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
