"""The one "bounded window of futures": work submitted in order, at most `window` submitted and not yet
taken, results taken in order. It bounds memory (each future holds a read buffer or a split expert) while
keeping the disk and the workers busy; the build's reads and splits, its dense chunk ring, the tier's
re-split and the full verify's hashing all run through it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import TypeVar

from .cancel import CancelToken

_T = TypeVar("_T")
_R = TypeVar("_R")


def bounded_window(submit: Callable[[_T], Future[_R]], items: Iterable[_T], window: int,
                   cancel: CancelToken | None = None) -> Iterator[_R]:
    """Yield submit(item).result() for each item, in order, with at most `window` futures submitted and
    not yet yielded; while the caller works on one result, window - 1 more are on their way.

    A consumer that holds reused buffers sizes the window to its ring: the buffer of a yielded result is
    handed to a new submission only once the caller asks for the next one. `cancel` is checked before each
    submission and each result. Stopped early (an error, cancel, an abandoned generator), the futures not
    started are cancelled; those running finish on their pool, which the caller shuts down.
    """
    if window < 1:
        raise ValueError(f"window must be at least 1, not {window}")
    pending: deque[Future[_R]] = deque()
    try:
        for item in items:
            if cancel is not None:
                cancel.check()
            pending.append(submit(item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            if cancel is not None:
                cancel.check()
            yield pending.popleft().result()
    finally:
        for fut in pending:
            fut.cancel()


__all__ = ["bounded_window"]
