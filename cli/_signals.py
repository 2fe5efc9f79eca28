"""SIGINT and SIGTERM, turned into the library's Interrupted error at a point where it is safe to raise.

A signal handler that raises lands wherever the main thread happens to be. Inside long work that is
often torch or safetensors code calling back into Python, which turns the error into another one
(a build stopped by Ctrl-C then reported "shard may be corrupt", exit 2), or a weakref callback,
which prints and swallows it (the build went on and exited 0). So while long work reports progress,
the first signal is only noted: it sets the gate's cancel token, which the library checks between
units of work, and the next progress report raises it too: every long operation reports at least once
per tensor or file. A second signal stops the process at once with exit 3, as the first does (with
--json it still writes the one document, saying 3); that is safe because every write is atomic and the
lock is an flock that dies with the process. Once the outcome is printed (`settle`), a signal can no
longer change the exit code: the process ends with the code it printed.
"""

from __future__ import annotations

import json
import os
import signal
from types import FrameType

from moet_cache.cancel import RESUME_HINT, CancelToken
from moet_cache.errors import Interrupted
from moet_cache.progress import Progress

from ._errors import EXIT_ENVIRONMENT
from ._output import envelope


class InterruptGate:
    """Holds a signal while long work runs, until the work's next progress report raises it."""

    def __init__(self) -> None:
        self.pending: str | None = None
        self.deferring = False
        self.token = CancelToken()  # what the library checks; set with the held signal
        self.command: str | None = None  # the command, and whether it prints a JSON document (main sets them)
        self.json_mode = False
        self.settled: int | None = None  # the exit code once the outcome is printed

    def settle(self, exit_code: int) -> None:
        """The outcome is decided and printed: from now on a signal is held, and a second one ends the
        process with this code (no new message, no second JSON document)."""
        self.settled = exit_code
        self.deferring = True

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
            if self.settled is not None:
                os._exit(self.settled)
            message = f"interrupted by {name} again; stopped at once"
            os.write(2, f"Error: {message} ({RESUME_HINT})\n".encode())
            if self.json_mode:  # the one document, as on every exit; the work's own was never printed
                doc = envelope(self.command, EXIT_ENVIRONMENT, message, RESUME_HINT, Interrupted.__name__)
                os.write(1, (json.dumps(doc, indent=2) + "\n").encode())
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
