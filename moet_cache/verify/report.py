"""The records a check returns: its verdict on the cache (State), which check made it (Check), what is wrong
(Problem, ProblemKind), and the report itself (VerifyReport). Each check returns one and prints nothing; the
CLI turns it into output and an exit code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..enums import StrEnum


class State(StrEnum):
    """A check's verdict on a cache, most serious first."""

    CORRUPT = "corrupt"
    INCOMPLETE = "incomplete"
    STALE = "stale"
    UNVERIFIED = "unverified"
    VERIFIED = "verified"


class Check(StrEnum):
    """Which check made a report."""

    BOOT = "boot"          # stats and small manifests only
    FULL = "full"          # every listed byte re-hashed
    AGAINST = "against"    # the cache's planes rebuilt from the source and compared


class VerifiedBy(StrEnum):
    """What recorded a cache's stats as verified (.state/verified.json's `by`)."""

    BUILD = "build"
    FULL = "full"


# The states by the short names the code and tests use.
CORRUPT, INCOMPLETE, STALE, UNVERIFIED, VERIFIED = State
STATE_TEXT = {
    VERIFIED: "complete and verified",
    UNVERIFIED: "complete, not re-verified since a change",
    INCOMPLETE: "incomplete",
    STALE: "stale: the source changed since the build",
    CORRUPT: "corrupt",
}


class ProblemKind(StrEnum):
    """What is wrong with one file or record of a cache."""

    MISSING = "missing"          # a listed file is not there
    SIZE = "size"                # its size is not the listed one
    DIGEST = "digest"            # its bytes do not match the listed digest
    UNREADABLE = "unreadable"    # it cannot be read (an I/O error)
    LINK = "link"                # not a plain file (a link, a folder)
    MANIFEST = "manifest"        # a manifest is malformed or does not match its record
    COMMIT = "commit"            # no commit record (or a build is running)
    COVERAGE = "coverage"        # a served layer lacks its manifest, base file or delta-index entry
    STALE = "stale"              # the source changed since the build
    CHANGED = "changed"          # stats differ from the last verification: not damage, not proven either
    MISMATCH = "mismatch"        # the cache's planes differ from the source's (verify --against)


@dataclass(frozen=True)
class Problem:
    kind: ProblemKind
    path: str
    detail: str
    layer: int | None = None
    tensor: str | None = None

    def describe(self) -> str:
        where = self.path
        if self.layer is not None:
            where += f" (layer {self.layer}" + (f", tensor {self.tensor})" if self.tensor else ")")
        return f"{where}: {self.detail}"


@dataclass(frozen=True)
class VerifyReport:
    mode: Check
    state: State
    problems: tuple[Problem, ...]
    files_checked: int
    bytes_hashed: int = 0
    seconds: float = 0.0
    verified_by: str | None = None   # what the last recorded verification was (VerifiedBy; read back from disk)
    verified_at: str | None = None
    source_present: bool | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.state == VERIFIED

    @property
    def complete(self) -> bool:
        return self.state in (VERIFIED, UNVERIFIED)

    @property
    def state_text(self) -> str:
        return STATE_TEXT[self.state]

    def problems_text(self, limit: int = 3) -> str:
        """The first `limit` problems in one line, and how many more there are."""
        first = "; ".join(p.describe() for p in self.problems[:limit])
        more = f" (and {len(self.problems) - limit} more)" if len(self.problems) > limit else ""
        return first + more
