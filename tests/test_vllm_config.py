"""The quantization_config block that the cache's model folder hands vLLM (no vLLM needed)."""

from __future__ import annotations

import json

import pytest

from moet_cache.errors import InputError
from moet_cache.cache.quant_block import (E4M3_16, E8M0_32, LayerForm, parse_block, served_config,
                                    served_config_bytes)

SOURCE = {"model_type": "deepseek_v4", "hidden_size": 256,
          "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["*attn*"]}}


def test_served_config_names_moet_and_keeps_the_source_block_and_every_other_key() -> None:
    forms = {0: LayerForm(E8M0_32, E8M0_32, False), 43: LayerForm(E4M3_16, E8M0_32, True)}
    cfg = served_config(SOURCE, forms)
    block = cfg.pop("quantization_config")
    assert cfg == {k: v for k, v in SOURCE.items() if k != "quantization_config"}
    assert block["quant_method"] == "moet" and block["source"] == SOURCE["quantization_config"]
    parsed = parse_block(block)
    assert parsed.layers == forms and parsed.model_type == "deepseek_v4"
    assert parsed.layer(43, "model.layers.43.ffn.experts").scale_form("w13_weight_scale") == E4M3_16
    assert json.loads(served_config_bytes(json.dumps(SOURCE).encode(), forms))["quantization_config"] == block
    no_source = parse_block(served_config({"model_type": "x"}, forms)["quantization_config"])
    assert no_source.source is None


def test_a_layer_the_cache_lacks_and_malformed_blocks_are_refused() -> None:
    block = served_config(SOURCE, {1: LayerForm()})["quantization_config"]
    with pytest.raises(InputError, match=r"mtp.*layer 44\).*cache layers: 1.*--include-drafter"):
        parse_block(block).layer(44, "model.layers.44.mtp")
    for bad, msg in (({**block, "quant_method": "fp8"}, "not a moet block"),
                     ({**block, "format_version": 2}, "format_version 2"),
                     ({**block, "layers": {}}, "non-empty"),
                     ({**block, "layers": {"x": {}}}, "layer 'x'"),
                     ({**block, "layers": {"1": {"w13_weight_scale": "e5m2"}}}, "scale forms"),
                     ({**block, "source": [1]}, "source must be")):
        with pytest.raises(InputError, match=msg):
            parse_block(bad)
    with pytest.raises(InputError, match="not JSON"):
        served_config_bytes(b"{", {})
