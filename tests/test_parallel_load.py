"""A rank's share of the routed experts (tensor and expert parallelism), loaded from a real cache: the
tensors equal the matching slices of the whole layer, only the share's bytes are read (counted at the
loader's read seam, os.preadv), and the ranks' layer outputs (the CPU reference path) sum to the whole
layer's. The caches are the session's (tests/conftest.py): E 16, H 256, I 128."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from moet_cache.errors import InputError
from moet_cache.load import Shard, Tuning, open_cache
from moet_cache.load import reads as load_reads
from moet_cache.runtime import fused_moe
from moet_cache.runtime.padding import to_local
from parallel_ref import expert_map, linear, reference_share, round_robin

E, H, I, TOP_K = 16, 256, 128, 4


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dim() else t


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(_bytes(got[name]), _bytes(want[name])), name


SHARDS = {
    "tp2-r0": Shard(None, 0, 2), "tp2-r1": Shard(None, 1, 2), "tp4-r3": Shard(None, 3, 4),
    "ep2-r0": Shard(linear(2, 0, E)), "ep2-r1": Shard(linear(2, 1, E)), "ep3-r2": Shard(linear(3, 2, E)),
    "ep3-r0": Shard(linear(3, 0, E)), "ep4-rr1": Shard(round_robin(4, 1, E)), "tp2-ep2": Shard(linear(2, 1, E), 1, 2),
}


def _load(cache: Path, delta: str, shard: Shard | None = None, chunk: int | None = None) -> dict[int, dict[str, torch.Tensor]]:
    tuning = Tuning(cpu_chunk=chunk) if chunk else None
    return {x.index: x.tensors for x in open_cache(cache).load(delta=delta, verify="none", workers=2, shard=shard,
                                                               tuning=tuning)}


@pytest.mark.parametrize("name", sorted(SHARDS))
def test_a_shard_is_the_matching_slice_of_the_whole_layer(built_cache: Path, lossless: tuple[Path, Path],
                                                          name: str, reader: str) -> None:
    shard = SHARDS[name]
    for cache, delta in ((built_cache, "tier"), (built_cache, "none"), (lossless[1], "all")):
        # reads of 777 bytes: windows that begin and end inside pieces
        full, part = _load(cache, delta), _load(cache, delta, shard, chunk=777)
        assert sorted(part) == sorted(full)
        for layer in full:
            _assert_same(part[layer], reference_share(full[layer], shard, E, I))
    # the tier actually reaches this test: some rank's share holds tier rows
    assert any(t["delta_experts"].numel() for t in _load(built_cache, "tier", shard).values()) or shard.experts


class _Counter:
    """The loader's read seams, counting the bytes they return: os.preadv (whole ranges, and a share's pieces
    where the C extension is not built) and moet_cache._preads.pread_runs (a share's pieces)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        self.real_preadv, self.real_c = os.preadv, load_reads._preads
        self.monkeypatch = monkeypatch

    def preadv(self, fd: int, buffers: Any, offset: int) -> int:
        got = self.real_preadv(fd, buffers, offset)
        self.bytes += got
        return got

    def pread_runs(self, *args: Any) -> int:
        got = self.real_c.pread_runs(*args)
        self.bytes += got
        return got

    def __enter__(self) -> _Counter:
        self.monkeypatch.setattr(load_reads.os, "preadv", self.preadv)
        if self.real_c is not None:
            self.monkeypatch.setattr(load_reads, "_preads", self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.monkeypatch.setattr(load_reads.os, "preadv", self.real_preadv)
        self.monkeypatch.setattr(load_reads, "_preads", self.real_c)


@pytest.fixture(params=["c", "python"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A share's pieces read by the C extension, or by the Python loop it replaces where it is not built."""
    if request.param == "python":
        monkeypatch.setattr(load_reads, "_preads", None)
    elif load_reads._preads is None:
        if os.environ.get("MOET_CACHE_REQUIRE_KERNELS") == "1" or os.environ.get("CI") == "true":
            pytest.fail("moet_cache._preads did not build")
        pytest.skip("moet_cache._preads is not built")
    return str(request.param)


def _counted(monkeypatch: pytest.MonkeyPatch, cache: Path, delta: str,
             shard: Shard | None) -> tuple[int, dict[int, dict[str, torch.Tensor]]]:
    opened = open_cache(cache)  # the boot check of open_cache is not the load's reads
    with _Counter(monkeypatch) as counter:
        layers = {x.index: x.tensors for x in opened.load(delta=delta, verify="none", workers=2, shard=shard)}
    return counter.bytes, layers


def _held(layers: dict[int, dict[str, torch.Tensor]]) -> int:
    """Bytes of the tensors handed out that come from the cache (delta_experts is made, not read)."""
    return sum(t.numel() * t.element_size() for ts in layers.values() for n, t in ts.items() if n != "delta_experts")


@pytest.mark.parametrize("delta,shards", [
    ("none", [Shard(None, r, 2) for r in range(2)]), ("tier", [Shard(None, r, 2) for r in range(2)]),
    ("tier", [Shard(None, r, 4) for r in range(4)]), ("none", [Shard(linear(2, r, E)) for r in range(2)]),
    ("none", [Shard(round_robin(4, r, E)) for r in range(4)])])
def test_a_rank_reads_only_its_share_of_the_bytes(built_cache: Path, monkeypatch: pytest.MonkeyPatch, delta: str,
                                                  shards: list[Shard], reader: str) -> None:
    """Each rank reads exactly the bytes it holds, and at most 1/N of the whole layer's bytes plus 1% (the
    per-expert scale_2, tables and input scales are read whole by every tensor-parallel rank)."""
    whole, full = _counted(monkeypatch, built_cache, delta, None)
    assert whole == _held(full) > 0
    for shard in shards:
        got, layers = _counted(monkeypatch, built_cache, delta, shard)
        assert got == _held(layers)
        assert got <= whole / len(shards) * 1.01, (shard, got, whole)


def test_expert_parallel_ranks_read_every_byte_once(built_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the tier, expert-parallel ranks hold unequal numbers of tier rows; together they read the whole
    layer's bytes exactly once."""
    whole, full = _counted(monkeypatch, built_cache, "tier", None)
    ranks = [_counted(monkeypatch, built_cache, "tier", Shard(linear(3, r, E))) for r in range(3)]
    assert sum(got for got, _ in ranks) == whole
    assert sum(int(ts["delta_experts"].numel()) for _, ls in ranks for ts in ls.values()) == \
        sum(int(ts["delta_experts"].numel()) for ts in full.values()) > 0


def _routing(tier: torch.Tensor, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, topk_weights, topk_ids of 7 tokens: the first takes two tier experts, the last is vLLM's padding
    (every slot -1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(7)])
    ids[0, :2] = tier[:2]
    ids[6] = -1
    return x, torch.rand(7, TOP_K, generator=g), ids


@pytest.mark.parametrize("shards", [[Shard(None, r, 2) for r in range(2)], [Shard(linear(2, r, E)) for r in range(2)],
                                    [Shard(round_robin(4, r, E)) for r in range(4)],
                                    [Shard(linear(2, e, E), t, 2) for e in range(2) for t in range(2)]],
                         ids=["tp2", "ep2", "ep4-round-robin", "tp2xep2"])
def test_the_ranks_outputs_sum_to_the_whole_layers(built_cache: Path, shards: list[Shard]) -> None:
    """What vLLM's all-reduce adds up: each rank's fused_moe on its share, its expert ids mapped through its
    expert map (another rank's experts -1, skipped), summed over the ranks, is the whole layer's output
    (float32: equal to float rounding; the sums are added in another order)."""
    full = _load(built_cache, "tier")
    parts = [_load(built_cache, "tier", s) for s in shards]
    for layer, tensors in full.items():
        x, w, ids = _routing(tensors["delta_experts"], layer, torch.float32)
        want = fused_moe(x, tensors, w, ids, swiglu_limit=0.5)
        got = torch.zeros_like(want)
        for shard, part in zip(shards, parts):
            local = ids if shard.experts is None else to_local(ids, expert_map(shard.experts, E))
            got += fused_moe(x, part[layer], w, local, swiglu_limit=0.5)
        assert want.abs().sum() > 0 and bool((want[6] == 0).all())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_to_local_maps_global_ids_and_keeps_padding() -> None:
    m = expert_map(linear(2, 1, E), E)  # experts 8..15 are local 0..7
    ids = torch.tensor([[8, 3, 15, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    assert to_local(ids, m).tolist() == [[0, -1, 7, -1], [-1, -1, -1, -1]]
    assert to_local(ids, m).dtype == ids.dtype


def test_what_a_shard_cannot_be_is_refused(built_cache: Path) -> None:
    cache = open_cache(built_cache)
    with pytest.raises(InputError, match="not a multiple of 32"):  # 128 / 8 = 16 columns: half a scale group
        next(cache.load(verify="none", shard=Shard(None, 0, 8)))
    with pytest.raises(InputError, match="verify='hash'"):  # a digest covers the whole tensor
        cache.load(verify="hash", shard=Shard(None, 0, 2))
    with pytest.raises(InputError, match="expand"):
        cache.load(verify="none", expand=True, shard=Shard(linear(2, 0, E)))
    with pytest.raises(InputError, match="expert 16"):
        next(cache.load(verify="none", shard=Shard((0, 16))))
    with pytest.raises(InputError, match="rank"):
        Shard(None, 2, 2)
    with pytest.raises(InputError, match="twice"):
        Shard((1, 1))


def test_global_ids_on_a_ranks_layer_are_refused_with_the_way_out(built_cache: Path) -> None:
    """fused_moe on a rank's experts with the router's global ids (not mapped): one line naming to_local."""
    part = _load(built_cache, "tier", Shard(linear(2, 0, E)))[1]
    x, w, ids = _routing(part["delta_experts"], 0, torch.float32)
    ids[0, 0] = E - 1  # another rank's expert, as the router numbers it
    with pytest.raises(InputError, match="to_local"):
        fused_moe(x, part, w, ids)
