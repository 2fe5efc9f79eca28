"""Fixtures of the fault campaign: a work folder on a RAM filesystem where there is one (fsync is free there)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    """A scratch folder; on /dev/shm when it is writable, because the campaign's cost is mostly fsync."""
    yield from _ram_dir(tmp_path)


@pytest.fixture(scope="module")
def lossless(module_work: Path) -> tuple[Path, Path]:
    """(checkpoint, a --lossless cache of it with a 30% tier), built once per module; copy it before changing it."""
    from moet_cache import BuildOptions, build_cache

    from .campaign import make_tiny
    src = make_tiny(module_work / "src", seed=31)
    cache = module_work / "cache"
    build_cache(src, cache, BuildOptions(delta_budget="30%", lossless=True))
    return src, cache


@pytest.fixture(scope="module")
def module_work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield from _ram_dir(tmp_path_factory.mktemp("faults"))


def _ram_dir(fallback: Path) -> Iterator[Path]:
    shm = Path("/dev/shm")
    if shm.is_dir():
        try:
            d = Path(tempfile.mkdtemp(prefix="moet-faults-", dir=shm))
        except OSError:
            d = None
        if d is not None:
            try:
                yield d
            finally:
                shutil.rmtree(d, ignore_errors=True)
            return
    yield fallback


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/faults/ carries the `faults` marker."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.faults)
