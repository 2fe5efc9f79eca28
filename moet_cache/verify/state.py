"""The recorded verified state (.state/verified.json): each file's (size, mtime_ns, inode) after a build or a
full verify, the hash speed this machine reached, and the damage a failed --full found. The boot check
trusts a file whose stats are the recorded ones."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Collection

from ..cache.cacheview import CacheView, open_view
from ..errors import InputError
from ..fsutil import atomic_write_json, file_id, read_json_file, refuse_links
from ..cache.manifest import CACHE_MANIFEST, COMMIT_RECORD, VERIFIED_STATE, CacheManifest, utc_now
from .report import VerifiedBy


def stat_key(st: os.stat_result) -> list[int]:
    return list(file_id(st))  # as JSON keeps it


def record_verified_state(root: Path, manifest: CacheManifest, manifest_xxh3: str, by: VerifiedBy,
                          bytes_per_second: float | None = None, view: CacheView | None = None,
                          damaged: dict[str, str] | None = None, unproven: Collection[str] = ()) -> None:
    """Remember each file's (size, mtime_ns, inode) after a build or a full verify, for the boot check,
    and the speed this machine hashed the cache at (kept from the previous record when none is given).
    `view`: the committed cache as the caller opened it (--full: the view it hashed); else opened here.
    `damaged`: what a failed --full found ({path: what}): those files get no stats, and the boot check
    reports them as corrupt until a build replaces them or a --full finds them whole; `unproven`: other
    files the --full did not hash (missing, a link, the wrong size), which get no stats either."""
    refuse_links(root, (".state",))
    cf = view if view is not None else open_view(root)
    damaged = damaged or {}
    stats = {f.path: stat_key((root / f.path).stat()) for f, _ in cf.files
             if f.path not in damaged and f.path not in unproven}
    for name in (CACHE_MANIFEST, COMMIT_RECORD):
        stats[name] = stat_key((root / name).stat())
    if bytes_per_second is None:
        bytes_per_second = recorded_speed(verified_state(root, None))
    doc = {"format": "moet-cache-verified", "format_version": 1, "manifest_xxh3": manifest_xxh3,
           "by": by, "at": utc_now(), "files": stats, "hash_bytes_per_second": bytes_per_second}
    if damaged:
        doc["damaged"] = dict(sorted(damaged.items()))
    atomic_write_json(root / VERIFIED_STATE, doc)


def recorded_damage(state: dict[str, Any] | None) -> dict[str, str]:
    """What the last --full of this manifest found damaged ({path: what}); empty when it found nothing."""
    damaged = state.get("damaged") if state else None
    if not isinstance(damaged, dict):
        return {}
    return {k: v if isinstance(v, str) else "damaged" for k, v in damaged.items() if isinstance(k, str)}


MIN_SPEED_SAMPLE = 256 << 10  # fewer bytes hashed than this say nothing about a disk's speed


def speed_sample(nbytes: int, seconds: float) -> float | None:
    """Bytes a second, from enough bytes hashed to mean something; else None (nothing recorded)."""
    return nbytes / seconds if nbytes >= MIN_SPEED_SAMPLE and seconds > 0 else None


def recorded_speed(state: dict[str, Any] | None) -> float | None:
    v = state.get("hash_bytes_per_second") if state else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 1e3 < v < 1e13 else None


def verified_state(root: Path, manifest_xxh3: str | None) -> dict[str, Any] | None:
    """The record of the last build or full verify (of this manifest; of any when `manifest_xxh3` is None)."""
    try:
        doc = read_json_file(root / VERIFIED_STATE)
    except InputError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict) or \
            manifest_xxh3 is not None and doc.get("manifest_xxh3") != manifest_xxh3:
        return None
    return doc
