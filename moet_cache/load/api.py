"""The loader's public API: a verified cache into CPU or GPU memory at disk speed (docs/LOADER.md).

    cache = open_cache(path)                       # refuses an incomplete, stale or corrupt cache
    for layer in cache.load(device="cuda:0"):      # LoadedLayer(index, tensors, nbytes)
        ...
    for name, tensor in cache.load_dense(device="cuda:0"):
        ...

This module decides what a load means (options.py checks the arguments, plan.py turns the manifests
into jobs, the verify mode's gates run here) and hands the jobs to the I/O engine (engine.py, with
staging.py into a GPU). Argument errors are raised by the call; read and verification errors while
iterating.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch

from ..cache import layout as L
from ..cache.cacheview import CacheView, ListedFileError, entry_digest, read_commit
from ..cancel import CancelToken
from ..enums import BaseTable, DeltaMode, VerifyMode
from ..errors import InputError, VerificationError
from ..fsutil import FileId, file_id
from ..cache.manifest import DeltaIndex, FileEntry, ManifestError, TensorEntry
from ..progress import NullProgress, Progress
from ..verify.boot import boot_check, boot_view
from ..verify.report import CORRUPT, INCOMPLETE, STALE, VERIFIED, Problem, ProblemKind, VerifyReport
from .assemble import assemble_layer
from .engine import Finish, Pipeline
from .options import LoadOptions, Tuning
from .plan import Job, dense_jobs, layer_job, read_pack_header
from .shard import Shard
from .staging import PinnedPool

DENSE_MIN_INFLIGHT = 1 << 20     # load_dense's floor for the in-flight bytes (its jobs are ~64 MiB groups)


def _as_read(job: Job, tensors: dict[str, torch.Tensor], stream: object) -> dict[str, torch.Tensor]:
    """load_dense's Finish: dense tensors are handed out as read."""
    return tensors


@dataclass(frozen=True)
class LoadedLayer:
    """One served MoE layer in memory: `index` is the model's layer number (docs/LOADER.md names)."""

    index: int
    tensors: dict[str, torch.Tensor]
    nbytes: int                      # bytes read from the cache for this layer


def _refuse(report: VerifyReport, root: Path) -> VerificationError:
    return VerificationError(f"the cache at {root} is {report.state_text}: {report.problems_text()}",
                             "run moet-cache verify for the details, then moet-cache build to repair it",
                             list(report.problems))


def _boot_gate(root: Path) -> None:
    """verify='boot': the boot check must pass before anything is handed out."""
    report = boot_check(root)
    if report.state != VERIFIED:
        if report.state in (CORRUPT, INCOMPLETE, STALE):
            raise _refuse(report, root)
        raise VerificationError(
            f"the cache at {root} changed since its last verification "
            f"({report.problems[0].describe() if report.problems else 'no verification recorded'})",
            "run moet-cache verify --full once, or load with verify='hash'", list(report.problems))


class _Gates:
    """The verify mode's checks that run beside the reads (two side threads), and the test each job
    passes before it is handed out: the boot check (verify='boot'), and the tier pack's whole-file
    digest (verify='hash': the pack has one digest, so no layer using it goes out before it matched)."""

    def __init__(self, root: Path, verify: VerifyMode, pack: FileEntry | None) -> None:
        self.pack = pack if verify == VerifyMode.HASH else None
        self._boot: Future[None] | None = None
        self._pack: Future[str | None] | None = None
        self._side = ThreadPoolExecutor(max_workers=2, thread_name_prefix="moet-check") \
            if verify == VerifyMode.BOOT or self.pack is not None else None
        if self._side is not None:
            if verify == VerifyMode.BOOT:
                self._boot = self._side.submit(_boot_gate, root)
            if self.pack is not None:
                self._pack = self._side.submit(entry_digest, root, self.pack)

    def before_yield(self, job: Job) -> None:
        if self._boot is not None:
            self._boot.result()
        if job.uses_pack and self._pack is not None and self.pack is not None:
            if self._pack.result() != self.pack.xxh3:
                raise VerificationError(f"{self.pack.path} does not match its xxh3-128 digest",
                                        "the delta pack is corrupt: run moet-cache build again",
                                        [Problem(ProblemKind.DIGEST, self.pack.path,
                                                 "contents differ from cache.json")])

    def close(self) -> None:
        if self._side is not None:
            self._side.shutdown(wait=True, cancel_futures=True)


class Cache:
    """An opened cache: its checked manifests; `load` and `load_dense` read it into memory."""

    def __init__(self, view: CacheView, report: VerifyReport, opened: Mapping[str, FileId] | None = None) -> None:
        self.root = view.root
        self.view = view
        self.report = report
        # every listed file as it was opened (None: not recorded; then any file is read as it is found)
        self.opened = opened
        self._pinned = PinnedPool()  # staging reused by this cache's GPU loads (pinning is slow)

    @property
    def files(self) -> CacheView:
        """The opened-cache view (its older name here): manifest, layer manifests, listed files."""
        return self.view

    @property
    def delta_index(self) -> DeltaIndex | None:
        return self.view.delta_index

    def release(self) -> None:
        """Free the pinned staging memory kept for the next GPU load."""
        self._pinned.clear()

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.view.layers))

    @property
    def lossless(self) -> bool:
        return self.view.manifest.build.lossless

    @property
    def base_table(self) -> BaseTable:
        """The form of every base table (fitted, or x4: a * X4_PATTERN, decodable by bit arithmetic)."""
        return self.view.manifest.build.base_table

    # the MoE layers ---------------------------------------------------------------------------
    def load(self, device: str | torch.device = "cpu", delta: DeltaMode | str = DeltaMode.TIER,
             verify: VerifyMode | str = VerifyMode.BOOT,
             workers: int | None = None, max_inflight: str | int = "2GiB", progress: Progress | None = None,
             expand: bool = False, layers: Sequence[int] | None = None,
             tuning: Tuning | None = None, cancel: CancelToken | None = None,
             shard: Shard | None = None) -> Iterator[LoadedLayer]:
        """Yield every served layer (or those in `layers`) as it completes; see docs/LOADER.md.
        `cancel` (set from any thread) stops the load between layers with Interrupted; `shard`: a rank's
        share of the experts (tensor/expert parallelism), read alone."""
        return self.load_with(LoadOptions.parse(device, delta, verify, workers, max_inflight, expand, layers, tuning,
                                                shard), progress, cancel)

    def load_with(self, opts: LoadOptions, progress: Progress | None = None,
                  cancel: CancelToken | None = None) -> Iterator[LoadedLayer]:
        """`load` with its arguments already checked into a LoadOptions."""
        if opts.delta == DeltaMode.ALL and not self.lossless:
            raise InputError("delta='all' needs a --lossless cache (this one keeps only the tier's planes)",
                             "use delta='tier', or build with --lossless")
        sel = self.layers if opts.layers is None else opts.layers
        missing = [x for x in sel if x not in self.view.layers]
        if missing:
            raise InputError(f"the cache has no layer {missing[0]}", f"its layers are {list(self.layers)}")
        pack_fe = None
        if opts.delta == DeltaMode.TIER and any(self.view.tier_experts(x) or self.view.mid_experts(x) for x in sel):
            pack_fe = self.view.manifest.file(L.Role.PACK)
            if pack_fe is None:
                raise VerificationError("the delta index names tier experts, cache.json lists no delta pack",
                                        "run moet-cache build again")
        pack = read_pack_header(self.root, pack_fe, self.opened) if pack_fe is not None else None
        jobs = [layer_job(self.view.layers[x], opts.delta, self.view.tier_experts(x), pack, opts.shard,
                          self.view.mid_experts(x)) for x in sel]
        return self._run_layers(jobs, opts, progress or NullProgress(), pack_fe, cancel)

    def _finish(self, opts: LoadOptions) -> Finish:
        def finish(job: Job, t: dict[str, torch.Tensor], stream: object) -> dict[str, torch.Tensor]:
            assert job.layer is not None
            index = self.view.delta_index
            mid = self.view.mid_experts(job.layer) if index is not None and index.mid_layers is not None else None
            return assemble_layer(self.view.layers[job.layer], t, opts.delta, job.delta_experts, opts.expand, stream,
                                  mid)
        return finish

    def _run_layers(self, jobs: list[Job], opts: LoadOptions, progress: Progress,
                    pack_fe: FileEntry | None, cancel: CancelToken | None = None) -> Iterator[LoadedLayer]:
        pipe = Pipeline(self.root, opts, self._finish(opts), self._pinned, self.opened)
        gates = _Gates(self.root, opts.verify, pack_fe)
        try:
            for job, tensors in pipe.run(jobs, progress, "load", gates.before_yield, cancel):
                assert job.layer is not None
                yield LoadedLayer(job.layer, tensors, job.nbytes)
        finally:
            gates.close()

    # the dense tensors ------------------------------------------------------------------------
    def dense_entries(self) -> list[TensorEntry]:
        """Every dense tensor the cache holds (from the dense part manifests, digests checked)."""
        out: list[TensorEntry] = []
        dense_files = {f.path for f in self.view.manifest.files if f.role == L.Role.DENSE}
        try:
            parts = self.view.dense_parts  # read through the view: each checked against cache.json once
        except ListedFileError as e:  # a damaged cache: refused like one (exit 1)
            raise VerificationError(e.message, e.hint) from None
        for part in parts:
            for t in part.tensors:
                if t.file not in dense_files:
                    raise VerificationError(f"a dense part manifest: tensor {t.name} is in {t.file}, "
                                            "which cache.json does not list")
                out.append(t)
        return out

    def load_dense(self, device: str | torch.device = "cpu", verify: VerifyMode | str = VerifyMode.BOOT,
                   workers: int | None = None,
                   max_inflight: str | int = "2GiB", progress: Progress | None = None,
                   tuning: Tuning | None = None, cancel: CancelToken | None = None,
                   only: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (source name, tensor) for every dense tensor, with the checks of `load` (and its `cancel`);
        `only`: read just the tensors whose source name it accepts (the others are not read at all)."""
        opts = LoadOptions.parse(device, verify=verify, workers=workers, max_inflight=max_inflight, tuning=tuning)
        return self.load_dense_with(opts, progress, cancel, only)

    def load_dense_with(self, opts: LoadOptions, progress: Progress | None = None,
                        cancel: CancelToken | None = None,
                        only: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """`load_dense` with its arguments already checked (delta, expand and layers are not used)."""
        if opts.verify == VerifyMode.BOOT:
            _boot_gate(self.root)
        entries = [t for t in self.dense_entries() if only is None or only(t.name)]
        jobs = dense_jobs(entries, opts.tuning.dense_job)
        pipe = Pipeline(self.root, dataclasses.replace(opts, max_inflight=max(opts.max_inflight, DENSE_MIN_INFLIGHT)),
                        _as_read, self._pinned, self.opened)
        for _, tensors in pipe.run(jobs, progress or NullProgress(), "load dense", cancel=cancel):
            yield from tensors.items()


OPEN_TRIES = 3  # a commit that lands while the cache is opened: open again, this many times at most


def open_cache(path: str | os.PathLike[str], check_source: bool = True) -> Cache:
    """Open a cache for loading: manifests read and checked; incomplete, stale or corrupt is refused.

    The files are identified as they are opened (size, mtime, inode), under a commit record that still
    names the same manifest afterwards; a load reads those very files or refuses (a build or retier that
    commits meanwhile replaces them), so it never mixes two commits."""
    root = Path(path)
    for _ in range(OPEN_TRIES):
        report, view = boot_view(root, check_source=check_source)
        if report.state in (CORRUPT, INCOMPLETE, STALE) or view is None:
            raise _refuse(report, root)
        opened = _file_ids(view)
        if _committed_digest(root) == view.manifest_xxh3:
            return Cache(view, report, opened)  # the boot check read the delta index through the view
    raise VerificationError(f"the cache at {root} was committed again while it was opened, {OPEN_TRIES} times",
                            "wait for the build or retier that is changing it, then open it again")


def _file_ids(view: CacheView) -> dict[str, FileId]:
    """Every listed file's identity now (a missing one is left out: reading it is refused)."""
    ids = {}
    for f, _ in view.files:
        try:
            ids[f.path] = file_id(os.lstat(view.root / f.path))
        except OSError:
            continue
    return ids


def _committed_digest(root: Path) -> str | None:
    """The digest of the manifest the commit record names now; None when there is none (a build is running)."""
    try:
        return read_commit(root)[1]
    except (ManifestError, OSError):
        return None


__all__ = ["Cache", "LoadedLayer", "open_cache"]
