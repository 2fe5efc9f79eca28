"""A changed source shard (same size, new bytes) makes the boot check say stale while the source is there."""

from __future__ import annotations

import json
import os
from pathlib import Path

from moet_cache import BuildOptions, boot_check, build_cache, verify_against

from .campaign import make_tiny, run_main


def _flip_data_byte(shard: Path) -> None:
    blob = bytearray(shard.read_bytes())
    n = int.from_bytes(blob[:8], "little")
    pos = 8 + n + (len(blob) - 8 - n) // 2  # in the tensor data, not the header
    blob[pos] ^= 0x5A
    shard.write_bytes(bytes(blob))


def test_same_size_new_bytes_is_stale(work: Path) -> None:
    src = make_tiny(work / "src")
    cache = work / "cache"
    build_cache(src, cache, BuildOptions(delta_budget="30%"))
    assert boot_check(cache).state == "verified"
    shard = sorted(src.glob("*.safetensors"))[0]
    size = shard.stat().st_size
    _flip_data_byte(shard)
    assert shard.stat().st_size == size
    rep = boot_check(cache)
    assert rep.state == "stale" and rep.source_present, rep
    assert any(p.kind == "stale" and p.path == shard.name for p in rep.problems)
    rc, out, err = run_main(["verify", cache])
    assert rc == 1 and "stale" in out
    # Without the source (moved away), the boot check cannot tell and says so.
    src.rename(work / "moved")
    rep = boot_check(cache)
    assert rep.source_present is False and rep.state == "verified"


def test_changed_config_is_stale(work: Path) -> None:
    src = make_tiny(work / "src")
    cache = work / "cache"
    build_cache(src, cache, BuildOptions(delta_budget="30%"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["torch_dtype"] = "float16"
    (src / "config.json").write_text(json.dumps(cfg))
    assert boot_check(cache).state == "stale"


def test_same_mtime_rewrite_needs_verify_against(work: Path) -> None:
    """A rewrite that keeps size AND mtime is invisible to the boot check (it reads no source bytes);
    verify --against reads them and finds it. docs/GUARANTEES.md states this limit."""
    src = make_tiny(work / "src")
    cache = work / "cache"
    build_cache(src, cache, BuildOptions(delta_budget="30%", lossless=True))
    shard = sorted(src.glob("*.safetensors"))[0]
    st = shard.stat()
    _flip_data_byte(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert boot_check(cache).state == "verified"
    assert verify_against(cache, src).state == "corrupt"
