"""The vLLM plugin and model loader: the loader's weight mapping against a fake model with vLLM's parameter
names and shapes, the entry point importing without vLLM (and naming a vLLM that fails part-way), and
(marker vllm) vLLM's real registries. The loader module imports vLLM: skipped without it."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import numpy as np
import pytest
import torch
from torch import nn

from moet_cache.source.checkpoint import open_checkpoint
from moet_cache.errors import InputError
from moet_cache.load import open_cache
from moet_cache.integrations.vllm.plugin import register

pytest.importorskip("vllm.model_executor.model_loader", reason="vLLM is not installed")
from moet_cache.integrations.vllm.loader import LOAD_FORMAT, PluginOptions, load_into_model  # noqa: E402

E, H, I = 16, 256, 128  # small_spec


def _p(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)


class _Experts(nn.Module):
    """The parameters vLLM's ModelOpt NVFP4 fused-MoE method registers (modelopt.py), or the planes."""

    def __init__(self, planes: bool) -> None:
        super().__init__()
        if planes:
            self.w13_base = _p(E, 2 * I, H // 4, dtype=torch.uint8)
            self.w2_base = _p(E, H, I // 4, dtype=torch.uint8)
            self.w13_table = _p(E, 2, 4, dtype=torch.float32)
            self.w2_table = _p(E, 4, dtype=torch.float32)
        else:
            self.w13_weight = _p(E, 2 * I, H // 2, dtype=torch.uint8)
            self.w2_weight = _p(E, H, I // 2, dtype=torch.uint8)
        self.w13_weight_scale = _p(E, 2 * I, H // 16, dtype=torch.float8_e4m3fn)
        self.w2_weight_scale = _p(E, H, I // 16, dtype=torch.float8_e4m3fn)
        self.w13_weight_scale_2 = _p(E, 2, dtype=torch.float32)
        self.w2_weight_scale_2 = _p(E, dtype=torch.float32)
        self.w13_input_scale = _p(E, 2, dtype=torch.float32)
        self.w2_input_scale = _p(E, dtype=torch.float32)


class _Layer(nn.Module):
    def __init__(self, moe: bool, planes: bool) -> None:
        super().__init__()
        self.mlp = nn.Module()
        if moe:
            self.mlp.experts = _Experts(planes)


class _FakeModel(nn.Module):
    """model.layers.{i}.mlp.experts.* as in vLLM's DeepSeek models; load_weights records the rest."""

    def __init__(self, planes: bool = False, layers: int = 4) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([_Layer(i >= 1, planes) for i in range(layers)])
        self.dense: dict[str, torch.Tensor] = {}

    def load_weights(self, weights) -> set[str]:  # type: ignore[no-untyped-def]
        for name, t in weights:
            self.dense[name] = t
        return set(self.dense)


def test_expand_into_a_stock_model(lossless) -> None:
    src, root = lossless
    model = _FakeModel()
    summary = load_into_model(model, PluginOptions(cache=str(root), delta="all", verify="hash", workers=2))
    assert summary.expanded and summary.layers == (1, 2, 3) and summary.dense_tensors == len(model.dense) > 0
    with open_checkpoint(src) as ck:
        for layer in (1, 2, 3):
            ex = model.model.layers[layer].mlp.experts
            for e in range(E):
                g, u, d = (ck.read_expert(layer, e, p) for p in ("gate_proj", "up_proj", "down_proj"))
                assert np.array_equal(ex.w13_weight[e].numpy(), np.concatenate([g.codes, u.codes]))
                assert np.array_equal(ex.w2_weight[e].numpy(), d.codes)
                assert torch.equal(ex.w2_weight_scale[e].view(torch.uint8), d.block_scale.view(torch.uint8))
                assert ex.w13_weight_scale_2[e, 1].item() == pytest.approx(ck.multiply_global_scale(u.global_scale))
                assert ex.w2_input_scale[e].item() == pytest.approx(ck.multiply_global_scale(d.input_scale))
        for name, t in model.dense.items():
            assert np.array_equal(t.reshape(-1).view(torch.uint8).numpy(), ck.get_raw(name).reshape(-1))
        assert "model.embed_tokens.weight" in model.dense
        assert not any(".mlp.experts." in n and n.split(".")[2] in ("1", "2", "3") for n in model.dense)


def test_planes_into_a_plane_aware_model(lossless) -> None:
    _, root = lossless
    model = _FakeModel(planes=True)
    summary = load_into_model(model, PluginOptions(cache=str(root)))
    assert not summary.expanded
    want = {x.index: x.tensors for x in open_cache(root).load()}
    for layer, tensors in want.items():
        ex = model.model.layers[layer].mlp.experts
        for name, t in tensors.items():
            got = getattr(ex, name)  # parameters, and the tier-shaped planes as buffers
            assert torch.equal(got.view(torch.uint8) if got.dim() else got, t.view(torch.uint8) if t.dim() else t), name
        assert dict(ex.named_buffers())["delta_experts"].numel() == len(open_cache(root).delta_index.experts_of(layer))


def test_wrong_shapes_are_refused(lossless) -> None:
    model = _FakeModel()
    model.model.layers[2].mlp.experts.w2_weight = _p(E // 2, H, I // 2, dtype=torch.uint8)  # as with expert parallelism
    with pytest.raises(InputError, match=r"model.layers.2.mlp.experts.w2_weight: the model wants"):
        load_into_model(model, PluginOptions(cache=str(lossless[1])))


@pytest.mark.parametrize("suffix", ["_x4", "_tiled"])
def test_a_reload_into_repacked_planes_is_refused(lossless, suffix: str) -> None:
    """After the quant method has moved the planes into the kernels' layout (runtime/layout.py: its parameters
    renamed w13_base_x4 / w2_base_x4, or w13_base_tiled / w2_base_tiled), loading again would put
    natural-layout planes where the kernels read another: refused with what to do."""
    model = _FakeModel(planes=True)
    for layer in model.model.layers[1:]:
        ex = layer.mlp.experts
        for natural in ("w13_base", "w2_base"):
            param = getattr(ex, natural)
            delattr(ex, natural)
            ex.register_parameter(natural + suffix, param)
    with pytest.raises(InputError, match="moved into the plane kernels' layout") as err:
        load_into_model(model, PluginOptions(cache=str(lossless[1])))
    assert "restart vLLM" in str(err.value.hint)


def test_a_model_without_fused_moe_is_refused(lossless) -> None:
    with pytest.raises(InputError, match="no fused-MoE parameters"):
        load_into_model(nn.Linear(2, 2), PluginOptions(cache=str(lossless[1])))


def test_a_model_without_load_weights_needs_every_dense_name(lossless) -> None:
    model = _FakeModel()
    model.load_weights = None  # type: ignore[assignment, method-assign]
    with pytest.raises(InputError, match="has no parameter model"):
        load_into_model(model, PluginOptions(cache=str(lossless[1])))


def test_options_from_extra_config() -> None:
    assert PluginOptions.from_extra({"cache": "/c", "workers": 8}).workers == 8
    for bad, msg in (({}, "needs the cache"), ({"cache": ""}, "needs the cache"), ("x", "needs the cache"),
                     ({"cache": "/c", "cahce": 1}, "unknown moet loader option 'cahce'"),
                     ({"cache": "/c", "delta": "half"}, "delta must be"),
                     ({"cache": "/c", "workers": 0}, "workers"), ({"cache": "/c", "expand": "yes"}, "expand"),
                     ({"cache": "/c", "verify": "maybe"}, "verify must be"), ({"cache": "/c", "max_inflight": "1KiB"}, "max_inflight")):
        with pytest.raises(InputError, match=msg):
            PluginOptions.from_extra(bad)


def test_imports_and_registers_nothing_without_vllm() -> None:
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import moet_cache.integrations.vllm.plugin as p\n"
            "print('registered:', p.register())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "registered: None"
    assert "moet-cache" not in out.stderr  # no vLLM at all: nothing to say


# vLLM installed but failing part-way: its package imports, its model loader does not
_BROKEN_LOADERS = {
    "missing compiled extension": ("import vllm._C  # noqa: F401\n", "ModuleNotFoundError: No module named 'vllm._C'"),
    "missing shared library": ("raise ImportError('libcudart.so.12: cannot open shared object file: No such file "
                               "or directory')\n", "ImportError: libcudart.so.12: cannot open shared object file"),
}


@pytest.mark.parametrize("case", list(_BROKEN_LOADERS))
def test_vllm_that_fails_part_way_is_named_at_registration(tmp_path, case: str) -> None:
    body, failure = _BROKEN_LOADERS[case]
    loader = tmp_path / "vllm" / "model_executor" / "model_loader"
    loader.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "model_executor" / "__init__.py").write_text("")
    (loader / "__init__.py").write_text(body)
    code = "import moet_cache.integrations.vllm.plugin as p\nprint('registered:', p.register())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "registered: None"
    lines = [x for x in out.stderr.splitlines() if "moet-cache" in x]
    assert len(lines) == 1, out.stderr  # Python's last-resort handler: no logging set up, still printed
    assert failure in lines[0]
    assert "--quantization moet" in lines[0] and "reinstall" in lines[0]


def test_entry_point_declared() -> None:
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "moet_cache"]
    assert len(eps) == 1 and eps[0].load() is register


@pytest.mark.vllm
def test_registers_with_vllms_real_loader_registry(lossless) -> None:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import BaseModelLoader, get_model_loader

    cls = register()
    assert cls is not None and issubclass(cls, BaseModelLoader) and register() is cls  # once
    loader = get_model_loader(LoadConfig(load_format=LOAD_FORMAT,
                                         model_loader_extra_config={"cache": str(lossless[1]), "workers": 2}))
    assert type(loader) is cls
    loader.download_model(None)
    model = _FakeModel()
    loader.load_weights(model, None)
    assert model.model.layers[3].mlp.experts.w2_weight.abs().sum() > 0 and model.dense
    with pytest.raises(InputError, match="needs the cache"):
        get_model_loader(LoadConfig(load_format=LOAD_FORMAT))


@pytest.mark.vllm
def test_the_entry_point_registers_the_integrations_module_level_classes() -> None:
    """In a fresh process (nothing registered yet): the entry point alone makes vLLM's registries name the
    method's config, the loader and both parsers, each the class defined at the top of its module."""
    code = ("from importlib.metadata import entry_points\n"
            "[ep] = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'moet_cache']\n"
            "from vllm.model_executor.layers.quantization import get_quantization_config\n"
            "from vllm.reasoning.abs_reasoning_parsers import ReasoningParserManager\n"
            "from vllm.tool_parsers.abstract_tool_parser import ToolParserManager\n"
            "from moet_cache.integrations.vllm import config, loader, parsers\n"
            "assert ReasoningParserManager.reasoning_parsers.pop('moet_deepseek')  # registered on import\n"
            "assert ToolParserManager.tool_parsers.pop('moet_deepseek')\n"
            "cls = ep.load()()\n"
            "print(cls is loader.MoetModelLoader, get_quantization_config('moet') is config.MoetConfig,\n"
            "      ReasoningParserManager.get_reasoning_parser('moet_deepseek') is parsers.MoetDeepSeekReasoningParser,\n"
            "      ToolParserManager.get_tool_parser('moet_deepseek') is parsers.MoetDeepSeekToolParser)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True"] * 4
