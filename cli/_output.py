"""The one place that decides how results are printed: data on stdout (rich or JSON), the rest on stderr."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import sys
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from moet_cache.errors import OutputError


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


# The keys every JSON document carries, whatever the command and however it ended (README "JSON output").
ENVELOPE_KEYS = ("command", "ok", "exit_code", "error", "hint")


def envelope(command: str | None, exit_code: int, error: str | None = None, hint: str | None = None,
             error_type: str | None = None) -> dict[str, Any]:
    """The keys every `--json` document starts with; a failed command's document is this alone."""
    doc: dict[str, Any] = {"command": command, "ok": exit_code == 0, "exit_code": exit_code,
                           "error": error, "hint": hint}
    if error_type is not None:
        doc["error_type"] = error_type
    return doc


def stdout_lost(e: OSError) -> OutputError:
    """Standard output failed (a full disk, a closed pipe): point it at /dev/null, so that nothing written
    later (the interpreter's last flush included) fails again, and say so in one line."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file descriptor (an in-process runner's buffer)
        pass
    return OutputError(f"cannot write to standard output: {e.strerror or e}",
                       "check where the output goes: a full disk, or a pipe closed early")


def write_json(doc: Any) -> None:
    try:
        sys.stdout.write(json.dumps(to_jsonable(doc), indent=2) + "\n")
        sys.stdout.flush()
    except OSError as e:
        raise stdout_lost(e) from None


def _least_width(columns: list[str], cells: list[list[str]], wrap: tuple[str, ...]) -> int:
    """The narrowest width at which a table (Output.table's: two spaces between columns, none at the
    edges) shows every unwrapped cell whole: their longest lines; a wrapped column needs its longest word."""
    widths = []
    for i, c in enumerate(columns):
        texts = [c, *(r[i] for r in cells)]
        if c in wrap:
            widths.append(max(len(w) for t in texts for w in (t.split() or [""])))
        else:
            widths.append(max(len(line) for t in texts for line in (t.splitlines() or [""])))
    return sum(widths) + 2 * (len(columns) - 1)


def styled(words: str, style: str, rest: str = "") -> Text:
    """`words` in `style`, then `rest` plain: nothing in either is read as markup."""
    return Text.assemble((words, style), rest)


class _Console(Console):
    """rich's console, but a closed pipe is an OSError like a full disk (rich itself exits 1 on it, which
    is this tool's 'verification found a problem')."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


class Output:
    """How a command talks: `--json` gives one JSON document on stdout; `--quiet` prints no summaries and
    no notes (errors and warnings still go to stderr)."""

    def __init__(self, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        # markup off: a path or a message is printed as it is ('[/x]' in a folder name is not a style);
        # styled words are rich Text objects (styled())
        self.out = _Console(file=sys.stdout, soft_wrap=True, highlight=False, markup=False)
        self.err = Console(file=sys.stderr, soft_wrap=True, highlight=False, markup=False)

    @property
    def show_progress(self) -> bool:
        return not (self.json_mode or self.quiet) and self.err.is_terminal

    def json(self, doc: dict[str, Any], exit_code: int = 0) -> None:
        """The command's one JSON document: its own keys and the envelope's (`ok` is `exit_code == 0`)."""
        write_json({**doc, **envelope(doc.get("command"), exit_code)})

    def _stdout(self, *items: Any, console: Console | None = None) -> None:
        try:
            (console or self.out).print(*items)
            self.out.file.flush()
        except OSError as e:
            raise stdout_lost(e) from None

    def print(self, *items: Any) -> None:
        """A summary on stdout (skipped in JSON mode, where the document is the output, and with --quiet)."""
        if not (self.json_mode or self.quiet):
            self._stdout(*items)

    def result(self, *items: Any) -> None:
        """What the command was asked for (e.g. serve --dry-run's command line): printed even with --quiet."""
        if not self.json_mode:
            self._stdout(*items)

    def table(self, title: str | None, columns: list[str], rows: list[list[Any]], wrap: tuple[str, ...] = ()) -> None:
        """A table at the width of the terminal, or of COLUMNS (80 when unset) on a pipe or in a log.

        Only the columns named in `wrap` (descriptions) wrap, at spaces; every other cell (numbers, sizes,
        names) is printed whole on one line. When the whole cells do not fit that width, the table is
        printed as wide as they need rather than cut or split inside a number."""
        if self.json_mode:
            return
        # rules under the header only, two spaces between columns: 80 columns hold inspect's nine
        t = Table(title=title, show_lines=False, pad_edge=False, show_edge=False, collapse_padding=True,
                  box=box.SIMPLE_HEAD)
        cells = [[str(x) for x in r] for r in rows]
        for i, c in enumerate(columns):
            wraps = c in wrap
            t.add_column(c, justify="left" if i == 0 or wraps else "right", no_wrap=not wraps,
                         overflow="fold" if wraps else "ellipsis")
        for r in cells:
            t.add_row(*r)
        out = self.out
        need = _least_width(columns, cells, wrap)
        if need > out.width:
            out = _Console(file=out.file, width=need, soft_wrap=True, highlight=False, markup=False)
        self._stdout(t, console=out)

    def info(self, msg: str) -> None:
        if not self.quiet and not self.json_mode:
            self.err.print(msg)

    def warn(self, msg: str) -> None:
        if not self.quiet:
            self.err.print(styled("warning:", "yellow", f" {msg}"))
