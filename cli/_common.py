"""Options every command shares, the command class (plain help, real metavars), and the version text."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperArgument, TyperCommand

from ._env import env_choice

if TYPE_CHECKING:
    from moet_cache.cache.commit import KillHook

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout, on every exit.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No summaries, progress or notes (errors and warnings still print).")]

# Option value placeholders by the option's type, where an option gives none of its own.
_TYPE_METAVARS = {"path": "PATH", "int": "N", "float": "X", "str": "TEXT", "text": "TEXT"}


class MoetCommand(TyperCommand):
    """A typer command whose help reads like a Unix tool's: `Usage: moet-cache build [OPTIONS] SRC CACHE`,
    options as `--delta-budget SIZE`, never `{src}` or `<str>`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for p in self.params:
            if p.metavar is not None or getattr(p, "is_flag", False):
                continue
            if isinstance(p, TyperArgument):
                p.metavar = (p.name or "ARG").upper()
            else:
                label = p.type_descriptor.path_type if p.type_descriptor.is_path else p.bare_type()
                p.metavar = _TYPE_METAVARS.get(str(label).strip("<>").split()[0].lower(), "VALUE")

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for p in self.params:
            if isinstance(p, TyperArgument):
                name = p.metavar or (p.name or "ARG").upper()
                pieces.append(name if p.required and p.nargs == 1 else f"[{name}...]" if p.nargs != 1 else f"[{name}]")
        return pieces


def kill_hook() -> KillHook | None:
    """The fault tests' hook (MOET_CACHE_TEST_KILL_AT, moet_cache.cache.commit.KillHook) for the commands that change
    files; None outside tests. Read here, never by the library."""
    from moet_cache.cache.commit import KILL_ENV, KillHook, Window
    window, _, sig = os.environ.get(KILL_ENV, "").partition(":")
    if window or sig:  # a misspelt window would never fire: the test would pass without its kill
        env_choice(KILL_ENV, Window.names(), "", {KILL_ENV: window})
        env_choice(KILL_ENV, (f"{window}:KILL", f"{window}:TERM", f"{window}:INT"), "",
                   {KILL_ENV: f"{window}:{sig}" if sig else ""})
    return KillHook.from_env(os.environ)


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_text() -> str:
    """moet-cache's version and what it runs with; reads package metadata only (importing vLLM takes seconds)."""
    from moet_cache.version import __version__
    kernels = importlib.util.find_spec("moet_cache.codec._kernels") is not None
    lines = [f"moet-cache {__version__}",
             f"python {platform.python_version()}",
             f"torch {_dist_version('torch') or 'not installed'}",
             f"vllm {_dist_version('vllm') or 'not installed'}",
             f"C kernels: {'built' if kernels else 'not built (the numpy kernels are used)'}"]
    return "\n".join(lines)
