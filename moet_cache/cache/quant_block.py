"""The `quantization_config` block that the cache's model folder hands vLLM: `"quant_method": "moet"`.

vLLM reads `model/config.json` of the cache. Its `quantization_config` names our method and carries
what the method needs to declare a layer's parameters before the loader fills them:

    {"quant_method": "moet", "format_version": 1,
     "source": {...the source's own quantization_config, as it was, or null...},
     "model_type": "deepseek_v4",
     "layers": {"0": {"w13_weight_scale": "e8m0-32", "w2_weight_scale": "e8m0-32", "input_scales": false}, ...}}

`source` is what every layer but the routed experts is built with (the source's own method: ModelOpt
NVFP4, DeepSeek-V4's FP8 config, ...). `layers` lists every cache layer (docs/FORMAT.md numbering:
V4 drafter block K is layer num_hidden_layers + K, which is where vLLM builds it too) with the form of
each block-scale tensor (CONTRACT fact 2) and whether the cache holds input scales. The source's
config.json itself is kept byte for byte beside it (`model/config.source.json`) for `export`.
No vLLM import here: the builder writes the block, the vLLM method (integrations/vllm) reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import InputError
from ..format.formats import E4M3_16, E8M0_32, SCALE_FORMS  # noqa: F401 (E8M0_32 re-exported)

QUANT_METHOD = "moet"
BLOCK_VERSION = 1
SERVED_CONFIG = "config.json"              # in the model folder: what vLLM reads
SOURCE_CONFIG = "config.source.json"       # in the model folder: the source's config.json, byte for byte
SCALE_TENSORS = ("w13_weight_scale", "w2_weight_scale")


@dataclass(frozen=True)
class LayerForm:
    """What one cache layer's routed-expert parameters look like (beyond E, H, I from the model)."""

    w13_scale: str = E4M3_16
    w2_scale: str = E4M3_16
    input_scales: bool = False

    def scale_form(self, tensor: str) -> str:
        return self.w13_scale if tensor.startswith("w13_") else self.w2_scale

    def to_dict(self) -> dict[str, Any]:
        return {"w13_weight_scale": self.w13_scale, "w2_weight_scale": self.w2_scale,
                "input_scales": self.input_scales}


@dataclass(frozen=True)
class MoetBlock:
    """The parsed `quantization_config` of a moet model folder."""

    source: dict[str, Any] | None
    model_type: str | None
    layers: dict[int, LayerForm]

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": QUANT_METHOD, "format_version": BLOCK_VERSION, "source": self.source,
                "model_type": self.model_type,
                "layers": {str(k): v.to_dict() for k, v in sorted(self.layers.items())}}

    def layer(self, index: int, prefix: str) -> LayerForm:
        form = self.layers.get(index)
        if form is None:
            served = ", ".join(str(k) for k in sorted(self.layers)) or "none"
            raise InputError(f"vLLM builds routed experts at {prefix} (layer {index}), the cache holds no planes "
                             f"for that layer (cache layers: {served})",
                             "rebuild the cache with that layer (--include-drafter for drafter blocks), or turn off "
                             "speculative decoding")
        return form


def parse_block(d: Any) -> MoetBlock:
    """Read a `quant_method: moet` block (config.json's quantization_config); InputError when malformed."""
    where = "config.json quantization_config"
    if not isinstance(d, Mapping) or d.get("quant_method") != QUANT_METHOD:
        raise InputError(f"{where} is not a moet block", "the cache's model/config.json is damaged; rebuild the cache")
    if d.get("format_version") != BLOCK_VERSION:
        raise InputError(f"{where}: format_version {d.get('format_version')!r} is not supported "
                         f"(this moet-cache reads {BLOCK_VERSION})", "rebuild the cache with this moet-cache")
    source = d.get("source")
    if source is not None and not isinstance(source, Mapping):
        raise InputError(f"{where}: source must be an object or null")
    layers_in = d.get("layers")
    if not isinstance(layers_in, Mapping) or not layers_in:
        raise InputError(f"{where}: layers must be a non-empty object")
    layers: dict[int, LayerForm] = {}
    for key, v in layers_in.items():
        if not (isinstance(key, str) and key.isdecimal()) or not isinstance(v, Mapping):
            raise InputError(f"{where}: layer {key!r} is malformed")
        forms = [v.get(t, E4M3_16) for t in SCALE_TENSORS]
        if any(f not in SCALE_FORMS for f in forms) or not isinstance(v.get("input_scales", False), bool):
            raise InputError(f"{where}: layer {key}: scale forms must be one of {SCALE_FORMS}, "
                             "input_scales true or false")
        layers[int(key)] = LayerForm(forms[0], forms[1], bool(v.get("input_scales", False)))
    model_type = d.get("model_type")
    return MoetBlock(dict(source) if source is not None else None,
                     model_type if isinstance(model_type, str) else None, layers)


def served_config(source_config: Mapping[str, Any], layers: Mapping[int, LayerForm]) -> dict[str, Any]:
    """The source's config.json with its quantization_config replaced by the moet block (which keeps it)."""
    cfg = dict(source_config)
    source = cfg.get("quantization_config")
    model_type = cfg.get("model_type")
    cfg["quantization_config"] = MoetBlock(dict(source) if isinstance(source, Mapping) else None,
                                           model_type if isinstance(model_type, str) else None,
                                           dict(layers)).to_dict()
    return cfg


def served_config_bytes(source_config_bytes: bytes, layers: Mapping[int, LayerForm]) -> bytes:
    """served_config of a config.json's bytes, as the bytes to write (InputError if it is not a JSON object)."""
    try:
        src = json.loads(source_config_bytes)
    except ValueError as e:
        raise InputError(f"the source's config.json is not JSON: {e}") from None
    if not isinstance(src, dict):
        raise InputError("the source's config.json must hold a JSON object")
    return (json.dumps(served_config(src, layers), indent=1) + "\n").encode()


__all__ = ["QUANT_METHOD", "BLOCK_VERSION", "SERVED_CONFIG", "SOURCE_CONFIG", "E4M3_16", "E8M0_32",
           "LayerForm", "MoetBlock", "parse_block", "served_config", "served_config_bytes"]
