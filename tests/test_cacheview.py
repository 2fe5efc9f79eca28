"""The opened-cache view (moet_cache/cache/cacheview.py): one checked read of each small listed file, typed
accessors, one "does this big file still match" test; and every reader refusing a damaged small file.

Real caches built from the synthetic generator; damage is real bytes changed on disk, with the file's
mtime put back, so that only a digest check (not the boot check's stats) can see it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from moet_cache.cache import layout as L
from moet_cache.cache.cacheview import (CacheView, ListedFileError, entry_digest, file_matches, open_view, read_listed,
                                  read_listed_record)
from moet_cache.cli.app import main
from moet_cache.errors import VerificationError
from moet_cache.cache.inspection import inspect_cache
from moet_cache.load import open_cache
from moet_cache.cache.manifest import DeltaIndex, FileEntry, ManifestError, PartManifest
from moet_cache.serve import build_serve_command
from moet_cache.plan import footprint_from_cache
from moet_cache.verify import CORRUPT, boot_check, full_verify, load_cache_files


def _copy(built: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "cache"))


def _rewrite_same_size(path: Path, data: bytes) -> None:
    """Write `data` (same length) over `path` in place and put its mtime back: the stats do not change."""
    st = path.stat()
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _change_number(path: Path, key: str) -> None:
    """Change the last digit of a JSON number field: still valid JSON that parses, but not the listed bytes."""
    data = bytearray(path.read_bytes())
    at = data.index(f'"{key}": '.encode()) + len(key) + 4
    while chr(data[at + 1]).isdigit():
        at += 1
    data[at] = ord("1") if data[at] != ord("1") else ord("2")
    _rewrite_same_size(path, bytes(data))


def _main(*argv: object) -> int:
    return main([str(a) for a in argv])


# --- the view ---------------------------------------------------------------------------------------
def test_view_gives_typed_records_each_read_once(built_cache: Path) -> None:
    view = open_view(built_cache)
    assert isinstance(view, CacheView) and view.root == built_cache
    assert load_cache_files is open_view  # the verifier's name for it
    assert sorted(view.layers) == list(view.manifest.build.layers)
    index = view.delta_index
    assert isinstance(index, DeltaIndex) and view.delta_index is index  # read once, kept
    assert index.to_dict() == json.loads((built_cache / L.DELTA_INDEX).read_text())
    assert sum(len(view.tier_experts(x)) for x in view.layers) == sum(len(ex) for _, ex in index.layers) > 0
    parts = view.dense_parts
    assert parts and all(isinstance(p, PartManifest) for p in parts) and view.dense_parts is parts
    assert {t.file for p in parts for t in p.tensors} == {f.path for f, _ in view.files if f.role == L.Role.DENSE}
    cfg = view.served_config
    assert cfg == json.loads((built_cache / L.AUX_DIR / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "moet"
    assert isinstance(view.source_map, dict) and view.source_map["shards"]
    assert view.family.name == "deepseek_v3"
    assert view.bytes_of() == sum(f.size for f, _ in view.files)
    assert view.bytes_of(L.Role.BASE) == sum(f.size for lm in view.layers.values() for f in lm.files
                                             if f.role == L.Role.BASE)


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "delete", "link"])
def test_read_listed_refuses_any_other_bytes(built_cache: Path, tmp_path: Path, damage: str) -> None:
    root = _copy(built_cache, tmp_path)
    entry = open_view(root).manifest.file(L.Role.DELTA_INDEX)
    assert entry is not None and read_listed(root, entry) == (root / entry.path).read_bytes()
    p = root / entry.path
    data = p.read_bytes()
    if damage == "flip":
        _rewrite_same_size(p, data[:10] + bytes([data[10] ^ 0x01]) + data[11:])
    elif damage == "truncate":
        p.write_bytes(data[:-1])
    elif damage == "extend":
        p.write_bytes(data + b" ")
    elif damage == "delete":
        p.unlink()
    else:
        (tmp_path / "outside.json").write_bytes(data)  # the same bytes, but through a link out of the cache
        p.unlink()
        p.symlink_to(tmp_path / "outside.json")
    with pytest.raises(ListedFileError) as ei:
        read_listed(root, entry)
    assert ei.value.path == entry.path
    with pytest.raises(ListedFileError):
        read_listed_record(root, entry, DeltaIndex.parse)


def test_file_matches_rehashes_big_files(built_cache: Path, tmp_path: Path) -> None:
    root = _copy(built_cache, tmp_path)
    view = open_view(root)
    base = next(f for f in view.layers[1].files if f.role == L.Role.BASE)
    assert file_matches(root, base) and entry_digest(root, base) == base.xxh3
    p = root / base.path
    data = p.read_bytes()
    _rewrite_same_size(p, data[:-5] + bytes([data[-5] ^ 0x80]) + data[-4:])  # same size and mtime: only a hash sees it
    assert not file_matches(root, base) and entry_digest(root, base) not in (None, base.xxh3)
    p.write_bytes(data[:-1])
    assert not file_matches(root, base) and entry_digest(root, base) is None  # wrong size: not even hashed
    p.unlink()
    assert not file_matches(root, base) and entry_digest(root, base) is None
    assert not file_matches(root, FileEntry("layers/none.safetensors", 1, base.xxh3, L.Role.BASE))


# --- a damaged delta index is refused by every reader, never trusted ---------------------------------
@pytest.fixture
def bad_index(built_cache: Path, tmp_path: Path) -> Path:
    """A copy whose delta/tier.json still parses (a number changed) but is not the bytes cache.json lists."""
    root = _copy(built_cache, tmp_path)
    assert full_verify(root).ok  # the copy's stats recorded: the boot check now says verified
    _change_number(root / L.DELTA_INDEX, "used_bytes")  # in place, mtime put back: the stats stay the same
    DeltaIndex.parse(json.loads((root / L.DELTA_INDEX).read_text()))  # what an unchecked reader would trust
    return root


def test_damaged_delta_index_is_refused_by_the_view(bad_index: Path) -> None:
    view = open_view(bad_index)  # cache.json and the layer manifests are fine
    with pytest.raises(ListedFileError, match="tier.json does not match cache.json"):
        view.delta_index


def test_damaged_delta_index_makes_the_boot_check_say_corrupt(bad_index: Path) -> None:
    r = boot_check(bad_index)
    assert r.state == CORRUPT
    assert [(p.kind, p.path) for p in r.problems if p.kind == "digest"] == [("digest", L.DELTA_INDEX)]
    f = full_verify(bad_index)  # the same damage, found once by the re-hash
    assert f.state == CORRUPT and [p.path for p in f.problems if p.kind == "digest"] == [L.DELTA_INDEX]


def test_damaged_delta_index_is_refused_by_inspect_plan_serve_and_load(bad_index: Path) -> None:
    with pytest.raises(ManifestError, match="tier.json"):
        inspect_cache(bad_index)
    with pytest.raises(ManifestError, match="tier.json"):
        footprint_from_cache(bad_index)
    with pytest.raises(VerificationError, match="tier.json"):
        build_serve_command(bad_index, require_vllm=False, skip_flag_check=True)
    with pytest.raises(VerificationError, match="tier.json"):
        open_cache(bad_index)
    assert _main("inspect", bad_index, "--quiet") == 1  # a damaged cache file: exit 1, never bad input (2)
    assert _main("plan", bad_index, "--quiet") == 1
    assert _main("serve", bad_index, "--dry-run", "--skip-flag-check", "--quiet") == 1
    assert _main("verify", bad_index, "--quiet") == 1


# --- the other small files --------------------------------------------------------------------------
def test_damaged_dense_part_is_refused_by_plan_and_load_dense(built_cache: Path, tmp_path: Path) -> None:
    root = _copy(built_cache, tmp_path)
    part = next(f for f in open_view(root).manifest.files if f.role == L.Role.PART and f.path.startswith(L.DENSE_DIR))
    cache = open_cache(root)  # opened before the damage: load_dense must still read the part checked
    _change_number(root / part.path, "begin")
    with pytest.raises(ListedFileError, match=part.path):
        footprint_from_cache(root)
    with pytest.raises(VerificationError, match=part.path):
        list(cache.load_dense(verify="none"))


def test_damaged_served_config_is_refused_by_plan_and_serve(built_cache: Path, tmp_path: Path) -> None:
    root = _copy(built_cache, tmp_path)
    _change_number(root / L.AUX_DIR / "config.json", "hidden_size")
    with pytest.raises(ListedFileError, match="config.json"):
        footprint_from_cache(root)
    with pytest.raises(VerificationError, match="model/config.json: contents differ"):
        build_serve_command(root, require_vllm=False, skip_flag_check=True)  # the boot check hashes model/


def test_damaged_source_map_is_refused_by_export(lossless: tuple[Path, Path], tmp_path: Path) -> None:
    from moet_cache.source.exporter import export_checkpoint
    root = _copy(lossless[1], tmp_path)
    smap = root / L.SOURCE_MAP
    data = smap.read_bytes()
    at = data.index(b'"shards"')
    _rewrite_same_size(smap, data[:at + 1] + b"S" + data[at + 2:])  # "Shards": valid JSON, another document
    with pytest.raises(VerificationError, match="source-map.json does not match"):
        export_checkpoint(root, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_serve_reads_the_cache_once_through_the_view(built_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """serve goes straight down: one boot check opens the view; name, config and plan come from it."""
    from moet_cache.cache import cacheview
    from moet_cache.serve import preflight_plan
    opened: list[Path] = []
    real = cacheview.read_commit
    monkeypatch.setattr(cacheview, "read_commit", lambda root: (opened.append(root), real(root))[1])
    reads: list[str] = []
    real_read = cacheview.read_listed
    monkeypatch.setattr(cacheview, "read_listed", lambda root, e, *a: (reads.append(e.path), real_read(root, e, *a))[1])
    cmd = build_serve_command(built_cache, require_vllm=False, skip_flag_check=True)
    preflight_plan(cmd)
    assert opened == [built_cache]  # COMMIT.json and cache.json read once, by the boot check
    assert len(reads) == len(set(reads))  # and every small listed file at most once
    assert isinstance(cmd.view, CacheView) and cmd.view.root == built_cache
    assert cmd.model_type == cmd.view.served_config["model_type"]
    assert L.DELTA_INDEX in reads and f"{L.AUX_DIR}/config.json" in reads
