"""The loader's I/O engine: runs a load's jobs (plan.py) on worker threads, with bounded bytes in flight.

A bounded pipeline, not batches: worker threads read tensor byte ranges (reads.py) straight into
preallocated host tensors or, into a GPU, through the pinned staging of staging.py. A job is handed
out as soon as it is complete, in completion order; an error, a closed generator or Ctrl-C stops
every worker at its next read, waits for them and frees what they hold.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from ..cancel import CancelToken, check as check_cancel
from ..fsutil import FileId
from ..progress import Progress
from .options import LoadOptions
from .plan import Job
from .reads import Files, read_host
from .staging import CudaStaging, PinnedPool

#: What a load does with a job's tensors once they are read (on the worker; the CUDA stream it
#: ran on, or None on the CPU path): the API's per-layer finishing (delta_experts, expand).
Finish = Callable[[Job, dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]


class Pipeline:
    """Runs jobs on `opts.workers` threads. Into host memory at most `opts.max_inflight` bytes are read
    but not yet handed over; into a GPU the pinned staging bounds the bytes (staging.py)."""

    def __init__(self, root: Path, opts: LoadOptions, finish: Finish, pinned: PinnedPool | None = None,
                 opened: Mapping[str, FileId] | None = None) -> None:
        self.files = Files(root, opened)
        self.opts = opts
        self.finish = finish
        self.staging = CudaStaging(self.files, opts, pinned or PinnedPool()) if opts.device.type == "cuda" else None

    def run_job(self, job: Job) -> dict[str, torch.Tensor]:
        """One job, on a worker thread: read (and stage) its tensors, then finish them."""
        if self.staging is None:
            return self.finish(job, read_host(self.files, job, self.opts.tuning.cpu_chunk, self.opts.verify_hash), None)
        stream = self.staging.stream()
        out = self.staging.job(job, stream)
        with torch.cuda.stream(stream):
            result = self.finish(job, out, stream)
        stream.synchronize()
        return result

    def _bounds(self) -> tuple[int, int]:
        """(jobs submitted at most, bytes of submitted jobs at most). CPU: the budget bounds bytes read but
        not yet yielded. GPU: the pinned slots bound the staging bytes, the workers the jobs on the device;
        without hashing the workers share each job's windows and the job threads only wait on them."""
        workers = self.opts.workers
        if self.staging is None:
            return 2 * workers, self.opts.max_inflight
        if self.staging.share_windows(workers):
            return self.opts.tuning.gpu_jobs_in_flight, 1 << 62
        return 2 * workers, 1 << 62

    def run(self, jobs: Sequence[Job], progress: Progress, what: str,
            before_yield: Callable[[Job], None] | None = None,
            cancel: CancelToken | None = None) -> Iterator[tuple[Job, dict[str, torch.Tensor]]]:
        """Yield (job, tensors) as each job completes; before_yield may refuse a job (it raises);
        `cancel` stops it between jobs (Interrupted; the wait below wakes every 0.25 s to look)."""
        pending = deque(jobs)
        running: dict[Future[dict[str, torch.Tensor]], Job] = {}
        pool = ThreadPoolExecutor(max_workers=self.opts.workers, thread_name_prefix="moet-load")
        max_jobs, budget = self._bounds()
        progress.start(sum(j.nbytes for j in jobs), what)
        try:
            while pending or running:
                check_cancel(cancel)
                # a job always starts when none runs, however big; else only within both bounds
                while pending and (not running or (len(running) < max_jobs and
                                                   sum(j.nbytes for j in running.values()) + pending[0].nbytes <= budget)):
                    job = pending.popleft()
                    running[pool.submit(self.run_job, job)] = job
                done, _ = wait(list(running), timeout=0.25, return_when=FIRST_COMPLETED)
                for fut in done:
                    job = running.pop(fut)
                    tensors = fut.result()  # a worker's error ends the load here
                    if before_yield is not None:
                        before_yield(job)
                    progress.advance(job.nbytes)
                    if job.layer is not None:
                        progress.layer_done(job.layer)
                    yield job, tensors
        finally:
            self._stop(pool, running)
            progress.finish()

    def _stop(self, pool: ThreadPoolExecutor, running: dict[Future[dict[str, torch.Tensor]], Job]) -> None:
        """Error, Ctrl-C, cancel or an abandoned generator (or the end): stop every worker at its next
        read, wait for them, drop what they hold, wait for every copy out of staging, close the files."""
        self.files.stop.set()
        for fut in running:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        running.clear()
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        self.files.close()


__all__ = ["Finish", "Pipeline"]
