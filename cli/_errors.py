"""The one table that maps library exceptions to exit codes and one-line messages."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from moet_cache.cache.cacheview import ListedFileError
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


# An OSError that reached the top, by its errno: its exit code and what to do. The message keeps the
# system's own words (strerror) and the path: an I/O error is never reported as a missing file.
_PATH_HINT = "check the path"
OS_ERRORS: dict[int, tuple[int, str]] = {
    errno.ENOENT: (EXIT_USAGE, _PATH_HINT),
    errno.ENOTDIR: (EXIT_USAGE, "a part of the path is a file, not a folder; check the path"),
    errno.EISDIR: (EXIT_USAGE, "a folder is where a file was expected; check the path"),
    errno.EEXIST: (EXIT_USAGE, "it is in the way; choose another path"),
    errno.ENAMETOOLONG: (EXIT_USAGE, _PATH_HINT),
    errno.ELOOP: (EXIT_USAGE, "a loop of symbolic links; check the path"),
    errno.EIO: (EXIT_ENVIRONMENT, "the disk or the file system failed a read or write; check the disk (dmesg) "
                                  "and run `moet-cache verify --full` on a cache that was read"),
    errno.EACCES: (EXIT_ENVIRONMENT, "check the permissions"),
    errno.EPERM: (EXIT_ENVIRONMENT, "check the permissions"),
    errno.EROFS: (EXIT_ENVIRONMENT, "the file system is read-only; choose a writable folder"),
    errno.ENOSPC: (EXIT_ENVIRONMENT, "free space on that file system and run the command again; a build resumes"),
    errno.EDQUOT: (EXIT_ENVIRONMENT, "free space (your disk quota) and run the command again; a build resumes"),
}
OS_DEFAULT_HINT = "check the disk and the permissions"


def _free_bytes(path: str) -> int | None:
    """The free bytes of the file system that holds `path` (its nearest existing folder); None if unknown."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def _os_message(exc: OSError) -> str:
    what = exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc))
    where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT) and exc.filename:
        free = _free_bytes(str(exc.filename))
        where += f" ({free} bytes free there)" if free is not None else ""
    return f"{what}{where}"


def exit_code_for(exc: BaseException) -> int | None:
    if isinstance(exc, OSError) and exc.errno in OS_ERRORS:
        return OS_ERRORS[exc.errno][0]
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
        hint = hint_for(exc)
        return _os_message(exc) + (f" ({hint})" if with_hint and hint else "")
    return str(exc)


def hint_for(exc: BaseException) -> str | None:
    """What to do about it, as a separate string (the JSON document's `hint`)."""
    if isinstance(exc, (MoetError, Interrupted)):
        return exc.hint
    if isinstance(exc, OSError):
        return OS_ERRORS.get(exc.errno or 0, (EXIT_ENVIRONMENT, OS_DEFAULT_HINT))[1]
    return None
