"""The one table that maps library exceptions to exit codes and one-line messages."""

from __future__ import annotations

from moet_cache.cacheview import ListedFileError
from moet_cache.errors import EnvironmentProblem, InputError, Interrupted, MoetError, VerificationError

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, EXIT_ENVIRONMENT = 0, 1, 2, 3

# Most specific first; the first class that matches decides.
ERROR_TABLE: tuple[tuple[type[BaseException], int], ...] = (
    (Interrupted, EXIT_ENVIRONMENT),
    (VerificationError, EXIT_PROBLEM),
    (ListedFileError, EXIT_PROBLEM),  # a file the cache lists is missing or not its bytes: a damaged cache
    (InputError, EXIT_USAGE),
    (EnvironmentProblem, EXIT_ENVIRONMENT),
    (MoetError, EXIT_USAGE),
    (KeyboardInterrupt, EXIT_ENVIRONMENT),
    (MemoryError, EXIT_ENVIRONMENT),
    (OSError, EXIT_ENVIRONMENT),
)


def exit_code_for(exc: BaseException) -> int | None:
    for cls, code in ERROR_TABLE:
        if isinstance(exc, cls):
            return code
    return None


def message_for(exc: BaseException, with_hint: bool = True) -> str:
    """The one-line message (with its hint in parentheses unless `with_hint` is False)."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted; a build resumes where it stopped when run again"
    if isinstance(exc, (MoetError, Interrupted)):
        return str(exc) if with_hint else exc.message
    if isinstance(exc, MemoryError):
        return "out of memory; close other programs or use a machine with more memory"
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        return f"{exc.strerror or exc}{where}" + ("; check the disk and the permissions" if with_hint else "")
    return str(exc)


def hint_for(exc: BaseException) -> str | None:
    """What to do about it, as a separate string (the JSON document's `hint`)."""
    if isinstance(exc, (MoetError, Interrupted)):
        return exc.hint
    if isinstance(exc, OSError):
        return "check the disk and the permissions"
    return None
