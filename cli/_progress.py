"""Draws the library's progress callbacks with rich (bytes, speed, time left) on stderr."""

from __future__ import annotations

from rich.progress import (BarColumn, DownloadColumn, Progress as RichProgress, TextColumn,
                           TimeRemainingColumn, TransferSpeedColumn)

from moet_cache.progress import NullProgress, Progress

from ._output import Output
from ._signals import InterruptGate, InterruptibleProgress, cancel_token

__all__ = ["RichBytesProgress", "cancel_token", "progress_for"]


class RichBytesProgress:
    def __init__(self, out: Output) -> None:
        self._bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=out.err, transient=False)
        self._task: int | None = None

    def start(self, total_bytes: int, what: str) -> None:
        if self._task is None:
            self._bar.start()
        else:
            self._bar.remove_task(self._task)
        self._task = self._bar.add_task(what, total=total_bytes)

    def advance(self, nbytes: int) -> None:
        if self._task is not None:
            self._bar.advance(self._task, nbytes)

    def layer_done(self, layer: int) -> None:
        if self._task is not None:
            self._bar.update(self._task, description=f"build (layer {layer} done)")

    def finish(self) -> None:
        if self._task is not None:
            self._bar.stop()
            self._task = None


def progress_for(out: Output) -> Progress:
    drawn: Progress = RichBytesProgress(out) if out.show_progress else NullProgress()
    gate = InterruptGate.installed()
    return InterruptibleProgress(drawn, gate) if gate is not None else drawn
