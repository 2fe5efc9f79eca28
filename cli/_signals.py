"""SIGINT and SIGTERM, turned into the library's Interrupted error at a point where it is safe to raise.

A signal handler that raises lands wherever the main thread happens to be. Inside long work that is
often torch or safetensors code calling back into Python, which turns the error into another one
(a build stopped by Ctrl-C then reported "shard may be corrupt", exit 2), or a weakref callback,
which prints and swallows it (the build went on and exited 0). So while long work reports progress,
the first signal is only noted: it sets the gate's cancel token, which the library checks between
units of work, and the next progress report raises it too: every long operation reports at least once
per tensor or file. A second signal stops the process at once; that is safe
because every write is atomic and the lock is an flock that dies with the process.
"""

from __future__ import annotations

import os
import signal
from types import FrameType

from moet_cache.cancel import RESUME_HINT, CancelToken
from moet_cache.errors import Interrupted
from moet_cache.progress import Progress

from ._errors import EXIT_ENVIRONMENT


class InterruptGate:
    """Holds a signal while long work runs, until the work's next progress report raises it."""

    def __init__(self) -> None:
        self.pending: str | None = None
        self.deferring = False
        self.token = CancelToken()  # what the library checks; set with the held signal

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    @staticmethod
    def installed() -> InterruptGate | None:
        """The gate the console script installed as the SIGINT handler (None for in-process calls)."""
        gate = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
        return gate if isinstance(gate, InterruptGate) else None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.pending is not None:
            os.write(2, f"Error: interrupted by {name} again; stopped at once ({RESUME_HINT})\n".encode())
            os._exit(EXIT_ENVIRONMENT)
        if self.deferring:
            self.pending = name
            self.token.cancel(f"interrupted by {name}", RESUME_HINT)
            return
        # no long work under way (a lock wait, an import, a short command): raising here is the quick way out
        raise Interrupted(f"interrupted by {name}", RESUME_HINT)

    def check(self) -> None:
        if self.pending is not None:
            self.deferring = False  # the error is on its way: cleanup code must not see it held back again
            raise Interrupted(f"interrupted by {self.pending}", RESUME_HINT)


def cancel_token() -> CancelToken | None:
    """The token the console script's Ctrl-C sets, for the library call (None for in-process calls)."""
    gate = InterruptGate.installed()
    return gate.token if gate is not None else None


class InterruptibleProgress:
    """Passes reports on to the drawn (or silent) progress and raises a held signal at each one."""

    def __init__(self, inner: Progress, gate: InterruptGate) -> None:
        self._inner = inner
        self._gate = gate

    def start(self, total_bytes: int, what: str) -> None:
        self._gate.check()
        self._gate.deferring = True
        self._inner.start(total_bytes, what)

    def advance(self, nbytes: int) -> None:
        self._gate.check()
        self._inner.advance(nbytes)

    def layer_done(self, layer: int) -> None:
        self._gate.check()
        self._inner.layer_done(layer)

    def finish(self) -> None:
        self._gate.deferring = False
        self._inner.finish()
        self._gate.check()
