"""Each model vLLM builds from one cache reads only its dense tensors: the target everything but the drafter's,
the draft model the drafter's (load/dense_select.py). A tiny DeepSeek-V4 with the DSpark drafter (mtp.0-2 and
its head stack) is built into a cache; the moet loader fills a target and a draft model (vLLM's parameter names
for the routed experts, a recording load_weights for the dense tensors) while the loader's read seam
(os.preadv) counts the bytes read from each cache file.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from moet_cache import BuildOptions, build_cache
from moet_cache.cache import layout as L
from moet_cache.errors import VerificationError
from moet_cache.format.families import DeepseekV3, DeepseekV4
from moet_cache.load import open_cache
from moet_cache.load import reads as load_reads
from moet_cache.load.dense_select import DensePart, in_part, is_drafter_tensor, part_of_layers
from moet_cache.source.synthetic import dspark_v4_spec, make_v4_checkpoint

vllm = pytest.importorskip("vllm.model_executor.model_loader", reason="vLLM is not installed")
from moet_cache.integrations.vllm.loader import PluginOptions, load_into_model  # noqa: E402 (imports vLLM)

E = 16
_TIER_SHAPED = ("w13_delta", "w2_delta", "delta_experts")  # the loader makes these buffers itself


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dense-filter")
    src = make_v4_checkpoint(root / "src", dspark_v4_spec(n_routed_experts=E, seed=7))
    build_cache(src, root / "cache", BuildOptions(include_mtp=True, delta_budget="40%"))
    return root / "cache"


class _Model(nn.Module):
    """A vLLM model's routed-expert parameters (zeros, the cache's shapes) at vLLM's places for the layers
    it holds, and a load_weights that records every dense tensor it is handed."""

    def __init__(self, layers: dict[int, dict[str, torch.Tensor]], prefix: Any) -> None:
        super().__init__()
        self.handed: dict[str, torch.Tensor] = {}
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict()
        for x, tensors in layers.items():
            experts = nn.Module()
            for name, t in tensors.items():
                if name not in _TIER_SHAPED:
                    experts.register_parameter(name, nn.Parameter(torch.zeros_like(t), requires_grad=False))
            block = nn.Module()
            block.ffn = nn.Module()
            block.ffn.experts = nn.Module()
            block.ffn.experts.routed_experts = experts
            self.model.layers[str(x)] = prefix(block)

    def load_weights(self, weights: Any) -> set[str]:
        for name, t in weights:
            self.handed[name] = t.clone()
        return set(self.handed)


def _mtp_block(block: nn.Module) -> nn.Module:
    """vLLM 0.34's MTP draft model nests each block's decoder layer as `layers.{N + K}.mtp_block`."""
    outer = nn.Module()
    outer.mtp_block = block
    return outer


class _Counter:
    """Bytes returned by the loader's read seam (os.preadv), per cache file (relative path)."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = os.path.realpath(root)
        self.by_file: dict[str, int] = {}
        self.real = os.preadv
        monkeypatch.setattr(load_reads.os, "preadv", self.preadv)

    def preadv(self, fd: int, buffers: Any, offset: int) -> int:
        got = self.real(fd, buffers, offset)
        rel = os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), self.root)
        self.by_file[rel] = self.by_file.get(rel, 0) + got
        return got


def _dense_bytes(counted: dict[str, int], dense_files: set[str]) -> int:
    return sum(n for f, n in counted.items() if f in dense_files)


@pytest.fixture
def parts(cache: Path) -> Iterator[Any]:
    opened = open_cache(cache)
    entries = opened.dense_entries()
    dense_files = {f.path for f in opened.view.manifest.files if f.role == L.Role.DENSE}
    layers = {x.index: x.tensors for x in opened.load(verify="none")}
    yield opened, entries, dense_files, layers


def test_the_parts_split_the_dense_set_at_the_drafter(parts: Any) -> None:
    """On the built cache: the drafter's part is exactly the mtp.* tensors (the blocks and DSpark's head
    stack), the main part every other one; both are non-empty and together are every dense tensor."""
    opened, entries, _, _ = parts
    fam = opened.view.family
    names = [t.name for t in entries]
    drafter = {n for n in names if in_part(DensePart.DRAFTER, fam, n)}
    main = {n for n in names if in_part(DensePart.MAIN, fam, n)}
    assert drafter == {n for n in names if n.startswith("mtp.")}
    assert any(".main_proj." in n for n in drafter) and any(n.startswith("mtp.0.attn.") for n in drafter)
    assert main and drafter and not (main & drafter) and main | drafter == set(names)
    assert {n for n in names if in_part(DensePart.ALL, fam, n)} == set(names)


def test_drafter_tensor_names_by_family() -> None:
    v4, v3 = DeepseekV4("deepseek_v4", 4, (0, 1, 2, 3), (4,)), DeepseekV3("deepseek_v3", 61, (3,), (61,))
    assert is_drafter_tensor(v4, "mtp.0.attn.wkv.weight") and is_drafter_tensor(v4, "context_wkv_proj.weight")
    assert not is_drafter_tensor(v4, "layers.3.attn.wkv.weight") and not is_drafter_tensor(v4, "embed.weight")
    assert not is_drafter_tensor(v4, "head.weight") and not is_drafter_tensor(v4, "hc_head_fn")
    assert is_drafter_tensor(v3, "model.layers.61.shared_head.head.weight")
    assert not is_drafter_tensor(v3, "model.layers.60.self_attn.q_a_proj.weight")
    assert not is_drafter_tensor(v3, "context_wkv_proj.weight") and not is_drafter_tensor(v3, "lm_head.weight")
    assert part_of_layers(v4, [4]) == DensePart.DRAFTER and part_of_layers(v4, [0, 3]) == DensePart.MAIN
    assert part_of_layers(v4, [3, 4]) == DensePart.ALL and part_of_layers(v4, []) == DensePart.ALL


def test_each_model_reads_only_its_dense_tensors(cache: Path, parts: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The target reads the main part's bytes and the draft model the drafter's, each exactly (so together
    every dense byte once, where each model read the whole set before: twice); each is handed exactly its
    tensors, with the values the whole dense load gives."""
    opened, entries, dense_files, layers = parts
    n = opened.view.family.num_hidden_layers
    drafter_layers = [x for x in layers if x >= n]
    assert drafter_layers and len(drafter_layers) < len(layers)
    target = _Model({x: t for x, t in layers.items() if x < n}, lambda b: b)
    draft = _Model({x: t for x, t in layers.items() if x >= n}, _mtp_block)
    whole = dict(opened.load_dense(verify="none"))
    size = {t.name: t.end - t.begin for t in entries}
    main_names = {t.name for t in entries if not t.name.startswith("mtp.")}
    drafter_names = {t.name for t in entries if t.name.startswith("mtp.")}

    read = {}
    for what, model in (("target", target), ("draft", draft)):
        counter = _Counter(cache, monkeypatch)
        summary = load_into_model(model, PluginOptions(cache=str(cache), verify="none", workers=2))
        read[what] = _dense_bytes(counter.by_file, dense_files)
        assert summary.dense_tensors == len(model.handed)
    assert set(target.handed) == main_names and set(draft.handed) == drafter_names
    assert read["target"] == sum(size[x] for x in main_names) > 0
    assert read["draft"] == sum(size[x] for x in drafter_names) > 0
    assert read["target"] + read["draft"] == sum(size.values())
    for model in (target, draft):
        for name, t in model.handed.items():
            assert t.dtype == whole[name].dtype and torch.equal(t, whole[name]), name
    # the routed experts still arrive (the expert path is unchanged)
    x = drafter_layers[0]
    got = draft.model.layers[str(x)].mtp_block.ffn.experts.routed_experts.w13_base
    assert torch.equal(got, layers[x]["w13_base"])


def test_a_models_unused_checkpoint_weights_are_not_read(cache: Path, parts: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's `is_unused_checkpoint_weight` (its rule for the checkpoint names load_weights drops) narrows a
    model's part further: those tensors are neither handed nor read."""
    opened, entries, dense_files, layers = parts
    n = opened.view.family.num_hidden_layers
    target = _Model({x: t for x, t in layers.items() if x < n}, lambda b: b)
    unused = {t.name for t in entries if t.name.startswith("layers.0.")}
    assert unused
    target.is_unused_checkpoint_weight = lambda name: name in unused  # type: ignore[attr-defined]
    counter = _Counter(cache, monkeypatch)
    load_into_model(target, PluginOptions(cache=str(cache), verify="none", workers=2))
    kept = {t.name for t in entries if not t.name.startswith("mtp.") and t.name not in unused}
    assert set(target.handed) == kept
    assert _dense_bytes(counter.by_file, dense_files) == sum(t.end - t.begin for t in entries if t.name in kept)


def test_a_tensor_named_as_a_models_own_parameter_is_read(cache: Path, parts: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft model that declares a parameter under a main tensor's very name (vLLM's V3 MTP model loads a
    top-level embed_tokens it has) is handed that tensor too, beside the drafter's."""
    opened, entries, dense_files, layers = parts
    n = opened.view.family.num_hidden_layers
    draft = _Model({x: t for x, t in layers.items() if x >= n}, _mtp_block)
    embed = next(t for t in entries if t.name == "embed.weight")
    draft.embed = nn.Module()
    draft.embed.register_parameter("weight", nn.Parameter(torch.zeros(embed.shape), requires_grad=False))
    counter = _Counter(cache, monkeypatch)
    load_into_model(draft, PluginOptions(cache=str(cache), verify="none", workers=2))
    wanted = {t.name for t in entries if t.name.startswith("mtp.")} | {"embed.weight"}
    assert set(draft.handed) == wanted
    assert _dense_bytes(counter.by_file, dense_files) == sum(t.end - t.begin for t in entries if t.name in wanted)


def test_a_flipped_drafter_byte_fails_the_draft_models_hash_load_only(cache: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With verify="hash" each model checks the digests of what it reads: a byte flipped on disk in a drafter
    tensor fails the draft model's load, naming the tensor; the target never reads it. A selection that takes
    nothing reads nothing."""
    root = tmp_path / "cache"
    shutil.copytree(cache, root)
    opened = open_cache(root)
    entry = next(t for t in opened.dense_entries() if t.name.startswith("mtp.") and t.end - t.begin > 4)
    with open(root / entry.file, "r+b") as f:
        f.seek(entry.begin + 2)
        byte = f.read(1)[0]
        f.seek(entry.begin + 2)
        f.write(bytes([byte ^ 0x10]))
    layers = {x.index: x.tensors for x in opened.load(verify="none")}
    n = opened.view.family.num_hidden_layers
    target = _Model({x: t for x, t in layers.items() if x < n}, lambda b: b)
    load_into_model(target, PluginOptions(cache=str(root), verify="hash", workers=2))
    assert target.handed and entry.name not in target.handed
    draft = _Model({x: t for x, t in layers.items() if x >= n}, _mtp_block)
    with pytest.raises(VerificationError, match=rf"tensor {entry.name} \(dense\) does not match"):
        load_into_model(draft, PluginOptions(cache=str(root), verify="hash", workers=2))
    counter = _Counter(root, monkeypatch)
    assert list(opened.load_dense(verify="hash", only=lambda name: False)) == []
    assert counter.by_file == {}
