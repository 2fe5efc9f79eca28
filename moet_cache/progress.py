"""The one progress seam: the library reports, the CLI draws (or nothing does)."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def start(self, total_bytes: int, what: str) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def layer_done(self, layer: int) -> None: ...
    def finish(self) -> None: ...


class NullProgress:
    """Reports nowhere (library default, --quiet and --json)."""

    def start(self, total_bytes: int, what: str) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def layer_done(self, layer: int) -> None:
        pass

    def finish(self) -> None:
        pass
