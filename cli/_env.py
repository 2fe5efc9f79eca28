"""The environment variables the command line reads, each checked against the values it allows.

A value outside them is refused (exit 2) with one line that names the variable and what it may be: a
typo such as MOET_CACHE_SPLIT_DEVICE=gpu must not quietly run the default. Empty counts as unset. The
library reads no environment variable; each is read here, by the command it concerns, and handed on as
an option.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from moet_cache.errors import InputError

DEBUG_ENV = "MOET_CACHE_DEBUG"
DEBUG_VALUES = ("0", "1")


def env_choice(name: str, allowed: tuple[str, ...], default: str, environ: Mapping[str, str] | None = None) -> str:
    """The value of `name` (one of `allowed`), or `default` when unset or empty; any other value is an error."""
    value = (os.environ if environ is None else environ).get(name, "")
    if value == "":
        return default
    if value not in allowed:
        raise InputError(f"environment variable {name}={value!r} is not one of: {', '.join(allowed)}",
                         f"set {name} to one of them, or unset it")
    return value


def debug_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """MOET_CACHE_DEBUG: 1 adds tracebacks to errors (as --debug); 0 or unset does not."""
    return env_choice(DEBUG_ENV, DEBUG_VALUES, "0", environ) == "1"
