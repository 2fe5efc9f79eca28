"""The one commit protocol of every command that changes a cache (build, retier): uncommit, write,
commit, record, restore.

1. `uncommit()`: COMMIT.json goes first, so a cache being changed never reads complete.
2. The command writes its files (each atomically).
3. `commit(manifest)`: cache.json, then (the command's `before_commit`, e.g. the sweep of unlisted
   files), then COMMIT.json naming cache.json's size and digest, then the stats for the boot check.
4. On any exception (Ctrl-C, SIGTERM, disk full, bad input found late), `restore()` puts the previous
   commit record back only if the boot check then proves every listed file is the one last verified;
   otherwise the cache stays uncommitted and the same command resumes it.

Each window between the steps is a `Window`; a `KillHook` aimed at one makes the process signal itself
there (tests and the fault campaign only; docs/GUARANTEES.md, section 1). The hook is an argument of the
commands that change files (BuildOptions.kill_at, retier_cache, export_checkpoint, `changing`); only the
CLI reads it from the environment, through `KillHook.from_env`: the one reader of MOET_CACHE_TEST_KILL_AT.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..enums import StrEnum
from ..errors import EnvironmentProblem, InputError
from . import layout as L
from ..fsutil import CacheLock, atomic_write_bytes, fsync_dir, read_all, refuse_links
from ..hashing import xxh3_hex
from .manifest import CACHE_MANIFEST, COMMIT_RECORD, CacheManifest, CommitRecord, utc_now, write_record
from ..verify.boot import boot_check
from ..verify.report import VERIFIED, VerifiedBy
from ..verify.state import record_verified_state

KILL_ENV = "MOET_CACHE_TEST_KILL_AT"


class Window(StrEnum):
    """A point between two steps of a command that changes files, where a test can aim a kill."""

    # build and retier, in the order they reach them
    UNCOMMITTED = "uncommitted"
    PARTS_WRITTEN = "parts-written"
    MANIFEST_WRITTEN = "manifest-written"
    SWEPT = "swept"
    COMMITTED = "committed"
    RECORDED = "recorded"
    # export: after a shard's temp file is written and before it is renamed, after a shard, after the index
    EXPORT_SHARD_TEMP = "export-shard-temp"
    EXPORT_SHARD_WRITTEN = "export-shard-written"
    EXPORT_INDEX_WRITTEN = "export-index-written"


#: Every window a kill can be aimed at, in the order a build or retier reaches them; then export's.
WINDOWS = tuple(w.value for w in Window if not w.value.startswith("export-"))
EXPORT_WINDOWS = tuple(w.value for w in Window if w.value.startswith("export-"))
_SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT}


@dataclass(frozen=True)
class KillHook:
    """Test hook: send `signal` to this process each time it reaches the window named `window`."""

    window: str                        # a Window's name (any other name never fires, as before)
    signal: int = signal.SIGKILL

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> KillHook | None:
        """MOET_CACHE_TEST_KILL_AT=WINDOW[:SIGNAL] (KILL, TERM or INT; default KILL) in `environ`; None when
        unset (always, outside tests). The CLI calls this once per command; the library never reads it."""
        spec = environ.get(KILL_ENV)
        if not spec:
            return None
        name, _, sig = spec.partition(":")
        return cls(name, _SIGNALS.get(sig or "KILL", signal.SIGKILL))


def kill_point(hook: KillHook | None, window: Window) -> None:
    """`window` is reached: the hook fires when it names this window; without a hook, nothing happens."""
    if hook is not None and hook.window == window:
        os.kill(os.getpid(), hook.signal)


class Committer:
    """The commit protocol of one cache, for one command run under the cache's lock."""

    def __init__(self, root: Path, kill_at: KillHook | None = None) -> None:
        self.root = root
        self.kill_at = kill_at
        commit = root / COMMIT_RECORD
        try:
            self.previous: bytes | None = read_all(commit, 1 << 20) if commit.is_file() else None
        except (OSError, InputError):
            self.previous = None

    def uncommit(self) -> None:
        """A cache being (re)built must never look complete: the commit record goes first."""
        commit = self.root / COMMIT_RECORD
        if commit.exists():
            commit.unlink()
            fsync_dir(self.root)
        kill_point(self.kill_at, Window.UNCOMMITTED)

    def commit(self, manifest: CacheManifest, before_commit: Callable[[CacheManifest], None] | None = None,
               hash_rate: float | None = None) -> str:
        """Write cache.json, run `before_commit`, write COMMIT.json, record the stats (and `hash_rate`, bytes
        a second this machine hashed cache files at, for the boot check's estimate of a --full); returns
        the digest."""
        kill_point(self.kill_at, Window.PARTS_WRITTEN)
        mdata = write_record(self.root / CACHE_MANIFEST, manifest)
        digest = xxh3_hex(mdata)
        kill_point(self.kill_at, Window.MANIFEST_WRITTEN)
        if before_commit is not None:
            before_commit(manifest)
        kill_point(self.kill_at, Window.SWEPT)
        write_record(self.root / COMMIT_RECORD, CommitRecord(CACHE_MANIFEST, len(mdata), digest, utc_now()))
        kill_point(self.kill_at, Window.COMMITTED)
        record_verified_state(self.root, manifest, digest, by=VerifiedBy.BUILD, bytes_per_second=hash_rate)
        kill_point(self.kill_at, Window.RECORDED)
        return digest

    def restore(self) -> None:
        """After a failure: the previous commit record back, only if every listed file is provably the one
        last verified (same size, mtime and inode: atomic replaces change the inode); else uncommitted."""
        commit = self.root / COMMIT_RECORD
        if self.previous is None or commit.exists():
            return
        try:
            atomic_write_bytes(commit, self.previous)
            if boot_check(self.root, check_source=False).state != VERIFIED:
                commit.unlink()
                fsync_dir(self.root)
        except (OSError, InputError, EnvironmentProblem):
            commit.unlink(missing_ok=True)  # could not prove it: the cache stays uncommitted (rerun resumes)

    @contextmanager
    def guard(self) -> Iterator[Committer]:
        """Run the command's body; on any exception restore what can be proven, then re-raise."""
        try:
            yield self
        except BaseException:
            self.restore()
            raise


@contextmanager
def changing(root: Path, wait: bool = False, kill_at: KillHook | None = None) -> Iterator[Committer]:
    """The frame of every command that changes a cache (build, retier): the cache's lock, no links in the
    folders it writes, and the committer, whose guard restores what it can prove on any exception."""
    with CacheLock(root, wait=wait):
        refuse_links(root, L.WRITTEN_DIRS)
        commits = Committer(root, kill_at)
        with commits.guard():
            yield commits
