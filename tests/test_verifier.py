import json
import os
import shutil
from pathlib import Path

import pytest

from moet_cache import boot_check, build_cache, full_verify, make_checkpoint, small_spec, verify_against


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


def test_fresh_cache_is_verified_and_full_records(cache: Path) -> None:
    r = boot_check(cache)
    assert r.ok and r.verified_by == "build" and r.problems == () and r.source_present
    f = full_verify(cache)
    assert f.ok and f.bytes_hashed > 0
    assert boot_check(cache).verified_by == "full"


def test_bit_flip_caught_by_full_naming_layer_and_tensor(cache: Path) -> None:
    lm = json.loads((cache / "layers/layer-002.json").read_text())
    t = next(t for t in lm["tensors"] if t["name"] == "w2_base")
    flip_bit(cache / "layers/layer-002.base.safetensors", (t["begin"] + t["end"]) // 2, 5)
    boot = boot_check(cache)
    assert boot.state == "unverified" and not boot.ok  # the boot check sees the change, not the damage
    r = full_verify(cache)
    assert r.state == "corrupt"
    (p,) = r.problems
    assert p.kind == "digest" and p.layer == 2 and p.tensor == "w2_base" and p.path == "layers/layer-002.base.safetensors"
    after = boot_check(cache)  # a failed full verify is remembered: the file is corrupt, not merely changed
    assert after.state == "corrupt" and [(q.kind, q.path) for q in after.problems] == [("digest", p.path)]


def test_flip_in_header_padding_is_caught(cache: Path) -> None:
    flip_bit(cache / "layers/layer-001.base.safetensors", 20, 1)  # inside the JSON header
    r = full_verify(cache)
    assert r.state == "corrupt" and r.problems[0].layer == 1


def test_truncation_and_extension_caught_by_boot_check(cache: Path) -> None:
    p = cache / "delta/tier.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[:-100])
    r = boot_check(cache)
    assert r.state == "corrupt" and r.problems[0].kind == "size" and r.problems[0].path == "delta/tier.safetensors"
    p.write_bytes(data + b"\0")
    assert boot_check(cache).state == "corrupt"


def test_missing_file_and_missing_commit(cache: Path) -> None:
    (cache / "dense/model-00002-of-00002.safetensors").unlink()
    r = boot_check(cache)
    assert r.state == "incomplete" and any(p.kind == "missing" for p in r.problems)
    (cache / "COMMIT.json").unlink()
    r = boot_check(cache)
    assert r.state == "incomplete" and "did not finish" in r.problems[0].detail


def test_edited_manifests_are_corrupt(cache: Path) -> None:
    doc = json.loads((cache / "cache.json").read_text())
    doc["build"]["lossless"] = True
    (cache / "cache.json").write_text(json.dumps(doc))
    r = boot_check(cache)
    assert r.state == "corrupt" and "does not match the commit record" in r.problems[0].detail


def test_edited_layer_manifest_is_corrupt(cache: Path) -> None:
    p = cache / "layers/layer-003.json"
    p.write_text(p.read_text().replace('"kind": "moe"', '"kind": "mtp"'))
    r = boot_check(cache)
    assert r.state == "corrupt" and "layer-003.json" in r.problems[0].detail


def test_renamed_and_swapped_files(cache: Path) -> None:
    a, b = cache / "layers/layer-001.base.safetensors", cache / "layers/layer-002.base.safetensors"
    tmp = cache / "swap"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    assert boot_check(cache).state == "unverified"  # same sizes: only a re-hash tells
    r = full_verify(cache)
    assert r.state == "corrupt" and {p.layer for p in r.problems} == {1, 2}


def test_symlink_instead_of_file(cache: Path, tmp_path: Path) -> None:
    p = cache / "layers/layer-001.base.safetensors"
    outside = tmp_path / "outside.bin"
    shutil.move(p, outside)
    os.symlink(outside, p)
    r = boot_check(cache)
    assert r.state == "corrupt" and r.problems[0].kind == "link"


def test_changed_source_shard_is_stale(src_copy: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    build_cache(src_copy, cache)
    shard = src_copy / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # same size, new bytes
    shard.write_bytes(bytes(data))
    r = boot_check(cache)
    assert r.state == "stale" and r.problems[0].path == shard.name
    shutil.rmtree(src_copy)
    r = boot_check(cache)
    assert r.ok and r.source_present is False  # a deleted source is not stale


def test_against_a_different_source_names_the_first_mismatch(cache: Path, tmp_path: Path) -> None:
    other = make_checkpoint(tmp_path / "other", small_spec(seed=7))
    r = verify_against(cache, other)
    assert r.state == "corrupt"
    (p,) = r.problems
    assert p.layer == 1 and p.tensor == "w13_base" and "expert 0 gate_proj" in p.detail


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_boot_check_reads_manifests_not_tensor_data(cache: Path) -> None:
    boot_check(cache, check_source=False)  # warm imports
    json_bytes = sum(p.stat().st_size for p in cache.rglob("*.json"))
    tensor_bytes = sum(p.stat().st_size for p in cache.rglob("*.safetensors"))
    before = _rchar()
    assert boot_check(cache, check_source=False).ok
    read = _rchar() - before
    assert read < 2 * json_bytes + 65536 and read < tensor_bytes / 10, (read, json_bytes, tensor_bytes)
