"""The file digest used by the build and verify --full: pread in chunks, the same xxh3-128 as the bytes, no map."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import xxhash

from moet_cache import hashing

MIB = 1 << 20  # the size from which files were once hashed through a map (now never)


@pytest.mark.parametrize("size", [0, 1, 4095, MIB - 1, MIB, 3 * MIB + 17])
@pytest.mark.parametrize("chunk", [1 << 12, 1 << 20, hashing.CHUNK])
def test_file_digest_equals_the_digest_of_the_bytes(tmp_path: Path, size: int, chunk: int) -> None:
    data = os.urandom(size)
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    assert hashing.xxh3_file_hex(p, chunk=chunk) == xxhash.xxh3_128_hexdigest(data)


def test_a_file_that_cannot_be_mapped_is_read_and_none_is_ever_mapped(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A map would turn an unreadable page into a SIGBUS that kills verify --full: files are read with
    pread, and no map is made."""
    data = os.urandom(2 * MIB + 3)
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    calls = []

    def refuse(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise OSError(19, "No such device")  # what mmap says on a file system without maps
    monkeypatch.setattr(mmap, "mmap", refuse)
    assert hashing.xxh3_file_hex(p) == xxhash.xxh3_128_hexdigest(data)
    assert calls == [], "a file was mapped"


def test_one_flipped_byte_changes_the_mapped_digest(tmp_path: Path) -> None:
    data = bytearray(os.urandom(MIB + 100))
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    before = hashing.xxh3_file_hex(p)
    with open(p, "r+b") as f:
        f.seek(MIB + 50)
        f.write(bytes([data[MIB + 50] ^ 0x01]))
    assert hashing.xxh3_file_hex(p) != before
