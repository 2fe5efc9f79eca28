"""The one table that maps library exceptions to exit codes and one-line messages."""

from __future__ import annotations

from moet_cache.errors import EnvironmentProblem, InputError, Interrupted, MoetError, VerificationError

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, EXIT_ENVIRONMENT = 0, 1, 2, 3

# Most specific first; the first class that matches decides.
ERROR_TABLE: tuple[tuple[type[BaseException], int], ...] = (
    (Interrupted, EXIT_ENVIRONMENT),
    (VerificationError, EXIT_PROBLEM),
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


def message_for(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted; a build resumes where it stopped when run again"
    if isinstance(exc, (MoetError, Interrupted)):
        return str(exc)
    if isinstance(exc, MemoryError):
        return "out of memory; close other programs or use a machine with more memory"
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        return f"{exc.strerror or exc}{where}; check the disk and the permissions"
    return str(exc)
