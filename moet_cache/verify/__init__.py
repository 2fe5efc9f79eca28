"""Verify a cache: the boot check (stats and small manifests only), a full re-hash, or against the source.

    report    the records a check returns: State, Check, Problem, VerifyReport
    state     the recorded verified state (.state/verified.json): stats, hash speed, recorded damage
    boot      boot_check / boot_view: stats, small files' digests, coverage, the source's staleness
    full      full_verify: every listed byte re-hashed; the outcome recorded for the boot check
    against   verify_against: the cache's planes, scales, tables and dense tensors against the source
Layered in that order: report imports none of the others, against imports report and boot. report, state
and boot sit in the cache layer (a commit records the verified state and proves a restore with the boot
check); full and against are commands.
"""

from __future__ import annotations

from ..cache.cacheview import read_committed_manifest
from .against import cache_read_errors, verify_against
from .boot import SMALL_ROLES, CacheFiles, boot_check, boot_view, load_cache_files
from .full import UNREADABLE, full_verify
from .report import (CORRUPT, INCOMPLETE, STALE, STATE_TEXT, UNVERIFIED, VERIFIED, Check, Problem, ProblemKind,
                     State, VerifiedBy, VerifyReport)
from .state import MIN_SPEED_SAMPLE, record_verified_state, speed_sample

__all__ = [
    "CORRUPT", "INCOMPLETE", "MIN_SPEED_SAMPLE", "SMALL_ROLES", "STALE", "STATE_TEXT", "UNREADABLE", "UNVERIFIED",
    "VERIFIED", "CacheFiles", "Check", "Problem", "ProblemKind", "State", "VerifiedBy", "VerifyReport",
    "boot_check", "boot_view", "cache_read_errors", "full_verify", "load_cache_files", "read_committed_manifest",
    "record_verified_state", "speed_sample", "verify_against",
]
