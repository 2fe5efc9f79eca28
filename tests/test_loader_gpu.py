"""The loader into a CUDA device (pinned staging, worker streams): skipped without CUDA (CI has none)."""

from __future__ import annotations

import pytest
import torch

from moet_cache import BuildOptions, build_cache, make_checkpoint, small_spec
from moet_cache.errors import VerificationError
from moet_cache.load import open_cache

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("gpu")
    src = make_checkpoint(work / "src", small_spec())
    build_cache(src, work / "cache", BuildOptions(lossless=True, delta_budget="30%"))
    return src, work / "cache"


@pytest.mark.parametrize("verify", ["hash", "boot"])  # one thread a layer, in order / windows on all workers
@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("delta", ["tier", "all", "none"])
def test_gpu_load_equals_cpu_load(built, delta: str, expand: bool, verify: str) -> None:
    cache = open_cache(built[1])
    cpu = {x.index: x.tensors for x in cache.load(device="cpu", delta=delta, expand=expand)}
    # A tiny in-flight budget forces the staging slots to be reused many times.
    got = list(cache.load(device="cuda:0", delta=delta, expand=expand, verify=verify, workers=3,
                          max_inflight="1MiB"))
    assert sorted(x.index for x in got) == sorted(cpu)
    for x in got:
        assert set(x.tensors) == set(cpu[x.index])
        for name, t in x.tensors.items():
            assert t.device.type == "cuda"
            assert torch.equal(t.cpu().view(torch.uint8), cpu[x.index][name].view(torch.uint8)), (x.index, name)


def test_gpu_dense_equals_cpu(built) -> None:
    cache = open_cache(built[1])
    cpu = dict(cache.load_dense(device="cpu"))
    gpu = dict(cache.load_dense(device="cuda:0", verify="hash"))
    assert set(cpu) == set(gpu)
    for k in cpu:
        assert gpu[k].device.type == "cuda" and gpu[k].dtype == cpu[k].dtype and gpu[k].shape == cpu[k].shape
        assert torch.equal(gpu[k].cpu().reshape(-1).view(torch.uint8), cpu[k].reshape(-1).view(torch.uint8)), k


def test_gpu_hash_names_flipped_tensor(built, tmp_path) -> None:
    import shutil
    root = tmp_path / "c"
    shutil.copytree(built[1], root)
    cache = open_cache(root)
    lm = cache.files.layers[cache.layers[0]]
    t = next(t for t in lm.tensors if t.name == "w2_base")
    p = root / t.file
    data = bytearray(p.read_bytes())
    data[t.begin + 5] ^= 0x40
    p.write_bytes(bytes(data))
    with pytest.raises(VerificationError, match="w2_base"):
        for _ in open_cache(root).load(device="cuda:0", verify="hash", max_inflight="1MiB"):
            pass


def test_gpu_abandoned_load_stops_its_workers(built) -> None:
    import threading
    cache = open_cache(built[1])
    it = cache.load(device="cuda:0", verify="boot", workers=3, max_inflight="1MiB")
    next(it)
    it.close()  # the generator's finally: stop, shut both pools down, drain the staging
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("moet-load", "moet-window"))]
    assert len(list(cache.load(device="cuda:0", verify="boot"))) == len(cache.layers)


def test_gpu_staging_shape_from_the_tuning(built) -> None:
    """Another staging shape (small slots, three a worker) through the options gives the same tensors."""
    from moet_cache.load import Tuning
    cache = open_cache(built[1])
    cpu = {x.index: x.tensors for x in cache.load(device="cpu")}
    small = Tuning(gpu_slot=1 << 20, gpu_slots_per_worker=3, gpu_jobs_in_flight=1)
    for verify in ("none", "hash"):
        for x in cache.load(device="cuda:0", verify=verify, workers=2, tuning=small):
            for name, t in x.tensors.items():
                assert torch.equal(t.cpu().view(torch.uint8), cpu[x.index][name].view(torch.uint8)), (x.index, name)
    cache.release()
