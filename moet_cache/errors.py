"""One exception hierarchy for the library; the CLI maps each class to an exit code in one place."""

from __future__ import annotations


class _Message:
    """A one-line message and a hint that says what to do about it."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class MoetError(_Message, Exception):
    """Base of every error the library raises on purpose. `hint` says what to do about it."""


class InputError(MoetError):
    """Bad input or usage: a malformed checkpoint, manifest, profile or argument (exit 2)."""


class UnsupportedCheckpointError(InputError):
    """The checkpoint is readable but not an NVFP4 MoE checkpoint we know (exit 2)."""


class UnsafePathError(InputError):
    """A path from a manifest is absolute, climbs out of the cache or passes through a link (exit 2)."""


class VerificationError(MoetError):
    """The cache (or the source against it) is incomplete, stale, corrupt or mismatched (exit 1)."""

    def __init__(self, message: str, hint: str | None = None, problems: list | None = None) -> None:
        super().__init__(message, hint)
        self.problems = list(problems or [])


class EnvironmentProblem(MoetError):
    """The machine is in the way: lock held, disk full, interrupted, missing program (exit 3)."""


class LockHeldError(EnvironmentProblem):
    """Another process holds the cache's lock."""


class DiskFullError(EnvironmentProblem):
    """Not enough free space to write the cache."""


class OutputError(EnvironmentProblem):
    """Standard output cannot be written: the file it goes to is on a full disk, or the pipe was closed."""


class MissingDependencyError(InputError):
    """An optional program or package (e.g. vLLM) is needed and absent (exit 2: install it)."""


class Interrupted(_Message, BaseException):
    """The user pressed Ctrl-C (or the process got SIGINT/SIGTERM); work stopped cleanly (exit 3).

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way can turn it
    into another error.
    """
