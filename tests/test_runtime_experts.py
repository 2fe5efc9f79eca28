"""The runtime's one experts interface (runtime/experts.py) and the layout record (runtime/plane_layout.py), on
the CPU: every path implements the interface, says why it does not run a layer here, and launch picks the
path the config names where it runs and the next one where it does not. The CUDA paths' outputs are
tests/test_runtime_gpu.py's; the Triton one under the interpreter is tests/test_runtime_triton.py's."""

from __future__ import annotations

import pytest
import torch

from moet_cache.enums import BaseTable
from moet_cache.errors import InputError
from moet_cache.codec.planes import X4_PATTERN
from moet_cache.runtime import fused_moe, layout, mma_moe, mma_prefill
from moet_cache.runtime.dequant import LayerPlanes
from moet_cache.runtime.experts import Experts
from moet_cache.runtime.launch import DEFAULT, SPLIT, Config, cuda_experts, layer_form
from moet_cache.runtime.mma_moe import DecodeExperts, Mma
from moet_cache.runtime.mma_prefill import Prefill, PrefillExperts
from moet_cache.runtime.plane_layout import LAYOUTS, NATURAL, TILED, X4, PlaneLayout
from moet_cache.runtime.reference import ReferenceExperts, fused_moe_reference
from moet_cache.runtime.synthetic_layer import random_layer
from moet_cache.runtime.triton_experts import Grouped, Pairs, TritonExperts

E, H, I = 8, 512, 256  # planes that split into tiles


@pytest.fixture
def layer() -> dict[str, torch.Tensor]:
    return random_layer(E, H, I, n_tier=3, e8m0=True, device="cpu", seed=4)


def _routed(T: int, top_k: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(T)
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)])
    return x, torch.rand((T, top_k), generator=g), ids


def test_every_path_implements_the_interface() -> None:
    paths = (ReferenceExperts(), DecodeExperts(SPLIT), PrefillExperts(Prefill()), TritonExperts(Pairs(32, 16, 2)))
    for path in paths:
        assert isinstance(path, Experts) and not type(path).__abstractmethods__
        assert path.devices and path.layouts <= set(LAYOUTS)
    assert TritonExperts.layouts == {NATURAL}  # the others read every layout as it is
    assert all(type(p).layouts == set(LAYOUTS) for p in paths if not isinstance(p, TritonExperts))
    with pytest.raises(TypeError):
        Experts()  # type: ignore[abstract]


def test_the_plane_kernels_do_not_run_on_the_cpu_and_say_why(layer: dict) -> None:
    planes = LayerPlanes.from_tensors(layer)
    x, w, ids = _routed(5)
    for path in (DecodeExperts(SPLIT), PrefillExperts(Prefill())):
        assert not path.supports(planes, x, 15)
        assert path.unsupported(planes, x, 15) == f"{type(path).__name__} does not run on cpu"
    reference = ReferenceExperts()
    assert reference.supports(planes, x, 15)
    got = reference.apply(x, planes, w, ids, 7.0)
    want = fused_moe_reference(x, planes, w, ids, 7.0)
    assert got.dtype == x.dtype and torch.equal(got, want.to(x.dtype)) and got.abs().sum() > 0
    assert torch.equal(fused_moe(x, layer, w, ids, swiglu_limit=7.0), got)  # the CPU runs the reference


@pytest.mark.parametrize("pairs", [3, 60, 600, 6000])
def test_where_the_plane_kernels_do_not_run_launch_picks_the_triton_block_for_the_pairs(layer: dict,
                                                                                        pairs: int) -> None:
    """DEFAULT names the prefill kernels from 1536 pairs and the decode kernels below; neither runs on a CPU,
    so launch hands the pairs to the Triton kernels with the block DEFAULT gives them without either."""
    planes = LayerPlanes.from_tensors(layer)
    x, _, _ = _routed(2)
    named = DEFAULT.pick(pairs, **layer_form(planes))
    assert isinstance(named, Prefill if pairs >= DEFAULT.prefill[0][0] else Mma)
    got = cuda_experts(x, planes, pairs, DEFAULT)
    want = DEFAULT.pick(pairs, mma_runs=False, prefill_runs=False)
    assert got == TritonExperts(want) and isinstance(want, Pairs if pairs <= DEFAULT.pairs_max else Grouped)
    assert cuda_experts(x, planes, pairs, Config.only(Grouped(16, 16, 2, 4, 2, True))).block == Grouped(
        16, 16, 2, 4, 2, True)


def test_the_layout_is_a_record_read_from_the_tensors_names(layer: dict) -> None:
    assert (NATURAL.x4, NATURAL.tiled, TILED.x4, TILED.tiled, X4.x4, X4.tiled) == (False, False, False, True,
                                                                                  True, True)
    with pytest.raises(ValueError, match="tiled"):
        PlaneLayout(BaseTable.X4, tiled=False)
    assert NATURAL.names["w13_base"] == "w13_base" and TILED.names["w2_delta"] == "w2_delta_tiled"
    assert X4.names["w13_weight_scale"] == "w13_weight_scale_x4"
    pattern = torch.as_tensor(X4_PATTERN)
    x4_layer = dict(layer, w13_table=layer["w13_table"][..., :1].abs() * pattern,
                    w2_table=layer["w2_table"][..., :1].abs() * pattern)
    for tensors, want in ((layer, NATURAL), (layout.prepare(layer), TILED), (layout.prepare(x4_layer), X4)):
        assert layout.layout_for(layer if want != X4 else x4_layer) == (want if want != NATURAL else TILED)
        assert PlaneLayout.of(tensors) == want and LayerPlanes.from_tensors(tensors).layout == want
        assert LayerPlanes.from_tensors(tensors).natural().layout == NATURAL
    both = {**layout.prepare(layer), "w13_base_x4": layer["w13_base"]}
    with pytest.raises(InputError, match="2 layouts"):
        PlaneLayout.of(both)


def test_the_kernels_instantiations_take_the_layouts_flags() -> None:
    """The record gives the kernel templates' x4 and tiled flags (mma_moe.cu moe_mma, mma_prefill.cu
    moe_prefill): X4 both, TILED tiled only, NATURAL neither; the two accumulator sets of the one-column
    blocks follow the layout (x4, or tiled with e8m0 scales)."""
    assert mma_moe.kernel_name(SPLIT, 2, True, X4) == "moe_mma<2, 1, 2, true, false, true, true, true>"
    assert mma_moe.kernel_name(SPLIT, 1, True, TILED) == "moe_mma<1, 1, 2, true, false, false, true, true>"
    assert mma_moe.kernel_name(SPLIT, 2, False, TILED) == "moe_mma<2, 1, 2, false, false, false, true, false>"
    assert mma_moe.kernel_name(SPLIT, 2, True, NATURAL) == "moe_mma<2, 1, 2, true, false, false, false, false>"
    assert mma_prefill.kernel_name(Prefill(), 1, True, X4) == "moe_prefill<1, 8, 8, 3, true, false, 2, true, true>"
    assert mma_prefill.kernel_name(Prefill(), 2, False, NATURAL) == (
        "moe_prefill<2, 8, 8, 3, false, false, 2, false, false>")
