import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from moet_cache import BuildOptions, build_cache, export_checkpoint, full_verify, retier_cache, verify_against
from moet_cache.build.dense import chunks
from moet_cache.build.layers import multiply_convention
from moet_cache.build.options import read_window
from moet_cache.build.plan import make_plan
from moet_cache.build.tier import tier_candidates
from moet_cache.source.checkpoint import PROJECTIONS, SourceReader, open_checkpoint
from moet_cache.errors import DiskFullError, InputError, LockHeldError
from moet_cache.fsutil import CacheLock
from moet_cache.codec.planes import join_planes
from moet_cache.verify import boot_check, load_cache_files


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def test_lossless_round_trip_bit_for_bit(ckpt: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    r = build_cache(ckpt, cache, BuildOptions(lossless=True, delta_budget="10%"))
    assert r.layers == (1, 2, 3) and r.layers_built == (1, 2, 3)
    ck = open_checkpoint(ckpt)
    I = ck.model.moe_intermediate_size
    # base + delta gives every routed expert's FP4 codes back, read straight from the cache files
    for layer in r.layers:
        with safe_open(str(cache / f"layers/layer-{layer:03d}.base.safetensors"), "pt") as b, \
                safe_open(str(cache / f"layers/layer-{layer:03d}.delta.safetensors"), "pt") as d:
            w13 = join_planes(b.get_tensor("w13_base").numpy(), d.get_tensor("w13_delta").numpy())
            w2 = join_planes(b.get_tensor("w2_base").numpy(), d.get_tensor("w2_delta").numpy())
            for e in range(ck.model.n_routed_experts):
                assert np.array_equal(w13[e, :I], ck.read_expert(layer, e, "gate_proj").codes)
                assert np.array_equal(w13[e, I:], ck.read_expert(layer, e, "up_proj").codes)
                assert np.array_equal(w2[e], ck.read_expert(layer, e, "down_proj").codes)
    # export gives every source tensor back, bit for bit, in the source's shards
    out = tmp_path / "export"
    export_checkpoint(cache, out)
    for shard in sorted(ckpt.glob("*.safetensors")):
        a, b = load_file(str(shard)), load_file(str(out / shard.name))
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape
            assert np.array_equal(_raw(a[name]), _raw(b[name])), name
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == \
        json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert (out / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()
    open_checkpoint(out).validate_experts([1, 2, 3, 4])


def test_tier_pack_holds_the_source_deltas_of_the_chosen_experts(ckpt: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    build_cache(ckpt, cache, BuildOptions(delta_budget="30%"))
    index = json.loads((cache / "delta/tier.json").read_text())
    assert [x["layer"] for x in index["layers"]] == [1, 2, 3]  # full layer coverage
    assert 0 < index["used_bytes"] <= index["budget_bytes"]
    assert not (cache / "staging").exists() and not list(cache.glob("layers/*.delta.safetensors"))
    rep = verify_against(cache, ckpt)
    assert rep.ok and rep.details["delta_planes"] == 3 * sum(len(x["experts"]) for x in index["layers"])


def test_greedy_tier_takes_the_largest_errors(built_cache: Path) -> None:
    cf = load_cache_files(built_cache)
    index = json.loads((built_cache / "delta/tier.json").read_text())
    chosen = {(x["layer"], e) for x in index["layers"] for e in x["experts"]}
    cands = tier_candidates(cf.layers, None)
    worst_left = max(c.sq_error for c in cands if (c.layer, c.expert) not in chosen)
    least_taken = min(c.sq_error for c in cands if (c.layer, c.expert) in chosen)
    assert least_taken >= worst_left


def test_routing_profile_weights_the_choice(ckpt_modelopt: Path, tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    counts = [0] * 16
    counts[5] = 1000
    profile.write_text(json.dumps({"format": "moet-cache-routing-profile", "format_version": 1,
                                   "layers": [{"layer": 2, "counts": counts}]}))
    one_expert = (3 * 128 * 256) // 4
    r = build_cache(ckpt_modelopt, tmp_path / "c", BuildOptions(delta_budget=str(one_expert), profile=str(profile)))
    index = json.loads((tmp_path / "c/delta/tier.json").read_text())
    assert r.tier_experts == 1 and index["weighted_by_profile"]
    assert {x["layer"]: x["experts"] for x in index["layers"]} == {1: [], 2: [5], 3: []}


@pytest.mark.parametrize("doc,match", [
    ({"format": "x"}, "format must be"),
    ({"format": "moet-cache-routing-profile", "format_version": 1, "layers": [{"layer": 9, "counts": [1] * 16}]}, "layer 9, which this cache does not serve"),
    ({"format": "moet-cache-routing-profile", "format_version": 1, "layers": [{"layer": 1, "counts": [1] * 3}]}, "3 counts for layer 1"),
    ({"format": "moet-cache-routing-profile", "format_version": 1, "layers": [{"layer": 1, "counts": [-1] * 16}]}, "non-negative"),
])
def test_bad_profiles(ckpt_modelopt: Path, tmp_path: Path, doc: dict, match: str) -> None:
    p = tmp_path / "p.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=match):
        build_cache(ckpt_modelopt, tmp_path / "c", BuildOptions(profile=str(p)))


def test_resume_rebuilds_only_damaged_layers(ckpt_modelopt: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="25%"))
    (cache / "COMMIT.json").unlink()
    with open(cache / "layers/layer-002.base.safetensors", "r+b") as f:
        f.seek(4000)
        b = f.read(1)
        f.seek(4000)
        f.write(bytes([b[0] ^ 0x10]))
    r = build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="25%"))
    assert r.layers_built == (2,) and set(r.layers_reused) == {1, 3}
    assert full_verify(cache).ok


def test_complete_cache_is_confirmed_not_rebuilt(ckpt_modelopt: Path, cache: Path) -> None:
    r = build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="25%"))
    assert r.already_complete and r.layers_built == ()
    # a new budget needs the delta planes again: without --lossless the pack splits them from the
    # source, and the layers' base files are kept
    r2 = build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="50%"))
    assert not r2.already_complete and r2.layers_built == () and set(r2.layers_reused) == {1, 2, 3}
    assert r2.tier_experts == 24 and verify_against(cache, ckpt_modelopt).ok
    assert json.loads((cache / "cache.json").read_text())["build"]["delta_budget_bytes"] == r2.budget_bytes
    assert boot_check(cache).ok


def test_confirming_a_complete_cache_clears_what_a_killed_build_left(ckpt_modelopt: Path, cache: Path) -> None:
    """A build killed after its commit, while it wrote .state/verified.json, leaves that write's temp
    file; the next build finds the cache complete and, holding the lock, clears it (the kill campaign
    found one such file)."""
    temp = cache / ".state" / ".verified.json.tmp-killed01"
    temp.write_text("{")
    (cache / ".cache.json.tmp-killed02").write_text("{")
    r = build_cache(ckpt_modelopt, cache, BuildOptions(delta_budget="25%"))
    assert r.already_complete
    assert not temp.exists() and not (cache / ".cache.json.tmp-killed02").exists()
    assert boot_check(cache).ok and full_verify(cache).ok


def test_layer_selection_and_mtp(ckpt_modelopt: Path, tmp_path: Path) -> None:
    r = build_cache(ckpt_modelopt, tmp_path / "a", BuildOptions(layers="0-2"))
    assert r.layers == (1, 2)
    # layer 3's experts are carried unchanged as dense tensors
    cf = load_cache_files(tmp_path / "a")
    dense_names = set()
    for f, _ in cf.files:
        if f.role == "dense":
            with safe_open(str(tmp_path / "a" / f.path), "pt") as h:
                dense_names.update(h.keys())
    assert "model.layers.3.mlp.experts.0.gate_proj.weight" in dense_names
    assert not any(n.startswith("model.layers.4.") for n in dense_names)  # MTP left out
    r = build_cache(ckpt_modelopt, tmp_path / "b", BuildOptions(include_mtp=True))
    assert r.layers == (1, 2, 3, 4) and load_cache_files(tmp_path / "b").layers[4].kind == "mtp"
    with pytest.raises(InputError, match="the model has layers 0-4"):
        build_cache(ckpt_modelopt, tmp_path / "c", BuildOptions(layers="9"))
    with pytest.raises(InputError, match="add --include-drafter"):
        build_cache(ckpt_modelopt, tmp_path / "c", BuildOptions(layers="4"))
    with pytest.raises(InputError, match="selects no MoE layer"):
        build_cache(ckpt_modelopt, tmp_path / "c", BuildOptions(layers="0"))


def test_retier_needs_lossless_and_works_without_source(ckpt_modelopt: Path, tmp_path: Path) -> None:
    src = Path(shutil.copytree(ckpt_modelopt, tmp_path / "src"))
    cache = tmp_path / "cache"
    build_cache(src, cache, BuildOptions(lossless=True, delta_budget="0%"))
    shutil.rmtree(src)
    r = retier_cache(cache, "50%")
    assert r.tier_experts == 24 and full_verify(cache).ok
    build_cache(ckpt_modelopt, tmp_path / "plain")
    with pytest.raises(InputError, match="only a --lossless cache"):
        retier_cache(tmp_path / "plain", "50%")
    with pytest.raises(InputError, match="build it with --lossless"):
        export_checkpoint(tmp_path / "plain", tmp_path / "x")


def test_lock_keeps_a_second_build_out(ckpt_modelopt: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with CacheLock(cache):
        with pytest.raises(LockHeldError, match="another process is building"):
            build_cache(ckpt_modelopt, cache)
    assert not (cache / "COMMIT.json").exists()


def test_a_boot_check_probing_the_lock_does_not_fail_a_build(tmp_path: Path) -> None:
    # verify's probe (fsutil.lock_is_held) takes a shared lock for an instant; a build starting in that
    # instant used to fail "another process is building" (tests/faults/test_concurrency.py, under load)
    import fcntl
    import threading
    from moet_cache.fsutil import lock_is_held
    cache = tmp_path / "cache"
    with CacheLock(cache):
        assert lock_is_held(cache)
    fd = os.open(cache / ".lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a probe caught in the act
    threading.Timer(0.03, lambda: (fcntl.flock(fd, fcntl.LOCK_UN), os.close(fd))).start()
    with CacheLock(cache):
        pass
    assert not lock_is_held(cache)


def test_free_space_is_checked_first(ckpt_modelopt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import collections
    import shutil as sh
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(DiskFullError, match="bytes free, the build needs"):
        build_cache(ckpt_modelopt, tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("layers/*"))


def test_cache_must_not_be_inside_the_source(src_copy: Path) -> None:
    with pytest.raises(InputError, match="overlap"):
        build_cache(src_copy, src_copy / "cache")


def test_aux_files_and_scales(built_cache: Path, ckpt_modelopt: Path) -> None:
    # The source's config.json is kept byte for byte; the one vLLM reads names the moet method and keeps
    # the source's block and every other key.
    assert (built_cache / "model/config.source.json").read_bytes() == (ckpt_modelopt / "config.json").read_bytes()
    served, source = (json.loads((p).read_text()) for p in (built_cache / "model/config.json", ckpt_modelopt / "config.json"))
    block = served.pop("quantization_config")
    assert block["quant_method"] == "moet" and block["source"] == source.pop("quantization_config")
    assert served == source and sorted(block["layers"]) == ["1", "2", "3"]
    assert block["layers"]["1"] == {"w13_weight_scale": "e4m3-16", "w2_weight_scale": "e4m3-16", "input_scales": True}
    ck = open_checkpoint(ckpt_modelopt)
    with safe_open(str(built_cache / "layers/layer-001.base.safetensors"), "pt") as b:
        s2 = b.get_tensor("w13_weight_scale_2")
        table = b.get_tensor("w2_table")
        assert s2.shape == (16, 2) and table.shape == (16, 4)
        for e in (0, 7):
            assert float(s2[e, 1]) == float(ck.read_expert(1, e, "up_proj").global_scale)
        assert (table[:, 0] > 0).all() and (table[:, 1] > table[:, 0]).all() and (table[:, 3] < table[:, 2]).all()
    assert PROJECTIONS == ("gate_proj", "up_proj", "down_proj")


def test_source_reader_reads_what_safetensors_reads(ckpt: Path) -> None:
    # the build reads experts and dense tensors with pread at the header offsets: the same bytes as safe_open
    rng = np.random.default_rng(7)
    with open_checkpoint(ckpt) as ck:
        reader = SourceReader(ck)
        try:
            layers = ck.model.main_moe_layers()
            for _ in range(12):
                layer, e = int(rng.choice(layers)), int(rng.integers(ck.model.n_routed_experts))
                proj = PROJECTIONS[int(rng.integers(3))]
                want, got = ck.read_expert(layer, e, proj), reader.read_expert(layer, e, proj)
                assert np.array_equal(want.codes, got.codes) and want.codes.shape == got.codes.shape
                assert got.scale_bytes.dtype == np.uint8 and got.scale_bytes.shape == tuple(want.block_scale.shape)
                assert np.array_equal(_raw(want.block_scale), got.scale_bytes.reshape(-1))
                for a, b in ((want.global_scale, got.global_scale), (want.input_scale, got.input_scale)):
                    assert (a is None) == (b is None)
                    if a is not None:
                        assert b.dtype == np.float32 and tuple(a.shape) == b.shape
                        assert np.array_equal(_raw(a), b.reshape(-1).view(np.uint8))
                        assert multiply_convention(ck.layout, b) == ck.multiply_global_scale(a)
            for name in rng.choice(sorted(ck.tensors), 20, replace=False):
                assert np.array_equal(reader.read(str(name)), ck.get_raw(str(name)).reshape(-1))
        finally:
            reader.close()


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_multiply_convention_is_the_checkpoints(layout: str) -> None:
    # the build's torch-free copy of Checkpoint.multiply_global_scale, on awkward float32 values
    from moet_cache.source.checkpoint import COMPRESSED_TENSORS, MODELOPT, Checkpoint
    ck = Checkpoint.__new__(Checkpoint)
    ck.layout = MODELOPT if layout == "modelopt" else COMPRESSED_TENSORS
    rng = np.random.default_rng(3)
    vals = np.concatenate([rng.standard_normal(200) * 10.0 ** rng.integers(-30, 30, 200),
                           [0.0, -0.0, 1e-45, 3.4e38, np.inf, -np.inf, np.nan]]).astype(np.float32)
    with np.errstate(over="ignore"):  # 1 / 1e-45 overflows float32 on both sides
        for v in vals:
            want = ck.multiply_global_scale(torch.tensor([v]))
            got = multiply_convention(ck.layout, np.array([v], dtype=np.float32))
            assert (np.isnan(want) and np.isnan(got)) or got == want, v


def test_dense_chunks_reassemble_the_tensors(ckpt_modelopt: Path) -> None:
    # tiny chunks: many reads in flight through the three reused buffers, tensors split across chunks
    with open_checkpoint(ckpt_modelopt) as ck:
        plan = make_plan(ck, BuildOptions())
        reader = SourceReader(ck)
        try:
            names = sorted(n for ns in plan.dense_by_shard.values() for n in ns)
            got: dict[str, list[bytes]] = {}
            for n, chunk in chunks(plan, reader, names, 4096 + 8):
                got.setdefault(n, []).append(chunk.tobytes())
            assert list(got) == names
            for n in names:
                assert b"".join(got[n]) == ck.get_raw(n).tobytes(), n
        finally:
            reader.close()


def test_truncated_shard_is_bad_input_not_a_crash(src_copy: Path) -> None:
    shard = max(src_copy.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    with open_checkpoint(src_copy) as ck:
        reader = SourceReader(ck)
        try:
            os.truncate(shard, shard.stat().st_size - 1)  # the last tensor of the shard loses a byte
            with pytest.raises(InputError, match="ends early"):
                for n, t in ck.tensors.items():
                    if t.shard == shard.name:
                        reader.read(n)
        finally:
            reader.close()


def test_read_window_is_bounded_by_bytes_and_workers() -> None:
    assert read_window(2, 3 << 20) == 8                       # small experts: 4 a worker
    assert read_window(8, 64 << 20) == 4                      # 256 MiB of big experts
    assert read_window(2, 1 << 30) == 2                       # never fewer than two in flight
    assert read_window(1, 0) == 4


@pytest.mark.parametrize("read_threads", [1, 3])
def test_reads_ahead_build_the_same_planes(ckpt_modelopt: Path, tmp_path: Path, read_threads: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # another read-thread count and a one-expert window: the same files, byte for byte
    from moet_cache import BuildTuning
    build_cache(ckpt_modelopt, tmp_path / "ref", BuildOptions(delta_budget="30%"))
    build_cache(ckpt_modelopt, tmp_path / "c", BuildOptions(delta_budget="30%", tuning=BuildTuning(
        read_threads=read_threads, read_ahead_bytes=1)))
    ref = {f.path: f.xxh3 for f, _ in load_cache_files(tmp_path / "ref").files}
    got = {f.path: f.xxh3 for f, _ in load_cache_files(tmp_path / "c").files}
    assert got == ref and full_verify(tmp_path / "c").ok
