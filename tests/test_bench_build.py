"""The build's plane pipeline: the torch kernels (the GPU path) write the same planes as the numpy kernels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moet_cache import BuildOptions, BuildTuning, build_cache, full_verify, verify_against


def _build(src: Path, dest: Path, device: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    build_cache(src, dest, BuildOptions(delta_budget="25%", tuning=BuildTuning(split_device=device)))
    return dest


def _same_planes(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*.safetensors"))
    assert files and files == sorted(p.relative_to(b) for p in b.rglob("*.safetensors"))
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    for lm_path in sorted((a / "layers").glob("layer-*.json")):
        la, lb = json.loads(lm_path.read_text()), json.loads((b / "layers" / lm_path.name).read_text())
        assert la["sq_error"] == pytest.approx(lb["sq_error"], rel=1e-6)
        assert la["energy"] == pytest.approx(lb["energy"], rel=1e-6)


def test_torch_kernels_build_the_same_cache(tmp_path: Path, ckpt_modelopt: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _build(ckpt_modelopt, tmp_path / "numpy", "cpu", monkeypatch)
    got = _build(ckpt_modelopt, tmp_path / "torch", "torch-cpu", monkeypatch)
    _same_planes(ref, got)
    assert full_verify(got).ok and verify_against(got, ckpt_modelopt).ok


@pytest.mark.gpu
def test_gpu_build_writes_the_cpu_planes(tmp_path: Path, ckpt_modelopt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ref = _build(ckpt_modelopt, tmp_path / "numpy", "cpu", monkeypatch)
    got = _build(ckpt_modelopt, tmp_path / "gpu", "cuda", monkeypatch)
    _same_planes(ref, got)
    assert full_verify(got).ok and verify_against(got, ckpt_modelopt).ok


def test_the_split_stays_on_the_host_kernels_when_they_are_built(monkeypatch: pytest.MonkeyPatch) -> None:
    # measured: the C kernels on 8 threads built 4 GiB in 5.4 s, the GPU split in 10.0 s (benchmarks/NOTES.md)
    import torch

    from moet_cache.build import options as B
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    assert B.plane_device("auto", B.HostKernel.C) is None
    assert B.plane_device("auto", B.HostKernel.NUMPY) == "cuda"  # no C compiler at install: the GPU, as before
    assert B.plane_device("cuda", B.HostKernel.C) == "cuda"
    # BuildTuning takes the C kernels where they are built; numpy when asked for (MOET_CACHE_KERNELS=numpy)
    assert B.BuildTuning().device() == (None if B.KERNEL == "c" else "cuda")
    assert B.BuildTuning(host_kernel="numpy").device() == "cuda"
    assert B.BuildTuning(split_device="cuda").device() == "cuda"
