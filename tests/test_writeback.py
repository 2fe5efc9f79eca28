"""fsutil.start_writeback: a hint to the kernel that the build gives every 16 MiB it writes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from moet_cache import fsutil, stwriter
from moet_cache.stwriter import SafetensorsWriter, TensorSpec


def test_start_writeback_keeps_the_bytes_and_is_a_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if sys.platform.startswith("linux"):
        assert fsutil._sync_file_range() is not None  # Linux has it: the hint is really given
    calls: list[int] = []
    real = fsutil.start_writeback
    monkeypatch.setattr(stwriter, "start_writeback", lambda fd: (calls.append(fd), real(fd)))
    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)
    w = SafetensorsWriter(tmp_path / "a.safetensors", [TensorSpec("x", "U8", (10_000,))], writeback_bytes=1000)
    for i in range(0, 10_000, 500):
        w.write("x", data[i:i + 500])
    w.commit()
    assert len(calls) == 10
    assert np.array_equal(load_file(str(tmp_path / "a.safetensors"))["x"], data)
    monkeypatch.setattr(fsutil, "_sync_file_range", lambda: None)  # where libc has none: nothing happens
    fd = os.open(tmp_path / "a.safetensors", os.O_RDONLY)
    try:
        fsutil.start_writeback(fd)
    finally:
        os.close(fd)
