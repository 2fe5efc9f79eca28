"""The library's cancel token: a caller (another thread, or the CLI's Ctrl-C handler) asks long work to
stop; build, retier, verify, export and load check it between units of work (an expert, a chunk, a file,
a layer) and raise Interrupted there, where stopping is safe: every write is atomic, and a build or
retier stopped this way goes through the committer's restore (the cache never reads complete unless it is).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .errors import Interrupted

RESUME_HINT = "nothing is lost: run the same command again to resume"


@dataclass(frozen=True, eq=False)
class CancelToken:
    """Set once, from any thread; never cleared (a new run takes a new token)."""

    _event: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    # (message, hint) of the first cancel; a list only because the record is frozen and set later
    _why: list[tuple[str, str | None]] = field(default_factory=list, init=False, repr=False)

    def cancel(self, message: str = "cancelled", hint: str | None = RESUME_HINT) -> None:
        """Ask the work to stop; the first reason wins (a second Ctrl-C does not rename the first)."""
        if not self._why:
            self._why.append((message, hint))
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise Interrupted if the work was asked to stop; the work calls this between its units."""
        if self._event.is_set():
            message, hint = self._why[0] if self._why else ("cancelled", RESUME_HINT)
            raise Interrupted(message, hint)


def check(token: CancelToken | None) -> None:
    """token.check() for an optional token (None: the caller never cancels)."""
    if token is not None:
        token.check()


__all__ = ["CancelToken", "RESUME_HINT", "check"]
