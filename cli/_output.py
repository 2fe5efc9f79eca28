"""The one place that decides how results are printed: data on stdout (rich or JSON), the rest on stderr."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:  # NaN has no JSON form
        return None
    return obj


class Output:
    """How a command talks: `--json` gives one JSON document on stdout; `--quiet` keeps stderr quiet."""

    def __init__(self, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        self.out = Console(file=sys.stdout, soft_wrap=True, highlight=False)
        self.err = Console(file=sys.stderr, soft_wrap=True, highlight=False)

    @property
    def show_progress(self) -> bool:
        return not (self.json_mode or self.quiet) and self.err.is_terminal

    def json(self, doc: Any) -> None:
        sys.stdout.write(json.dumps(to_jsonable(doc), indent=2) + "\n")
        sys.stdout.flush()

    def print(self, *items: Any) -> None:
        """Human output on stdout (skipped in JSON mode: the JSON document is the output)."""
        if not self.json_mode:
            self.out.print(*items)

    def table(self, title: str | None, columns: list[str], rows: list[list[Any]]) -> None:
        if self.json_mode:
            return
        t = Table(title=title, show_lines=False, pad_edge=False)
        for i, c in enumerate(columns):
            t.add_column(c, justify="left" if i == 0 else "right", overflow="fold")
        for r in rows:
            t.add_row(*[str(x) for x in r])
        self.out.print(t)

    def info(self, msg: str) -> None:
        if not self.quiet and not self.json_mode:
            self.err.print(msg)

    def warn(self, msg: str) -> None:
        if not self.quiet:
            self.err.print(f"[yellow]warning:[/yellow] {msg}")
