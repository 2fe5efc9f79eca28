"""Layer and expert numbers in tensor names are ASCII digits: str.isdigit() and the regex \\d also take
'²' or '٣', which int() then refuses (an internal error, exit 70) or reads as another layer's number."""

from __future__ import annotations

from moet_cache.format.families import DeepseekV3, DeepseekV4
from moet_cache.plan.measure import _layer_of

V3 = DeepseekV3("deepseek_v3", 4, (1, 2, 3), ())
V4 = DeepseekV4("deepseek_v4", 4, (0, 1, 2, 3), (4,))


def test_other_digits_name_no_layer_or_expert() -> None:
    for digit in ("²", "٣", "３"):
        assert V3.layer_of(f"model.layers.{digit}.mlp.gate.weight") is None
        assert V3.parse_expert(f"model.layers.3.mlp.experts.{digit}.gate_proj.weight") is None
        assert V4.layer_of(f"layers.{digit}.ffn.gate.weight") is None
        assert V4.layer_of(f"mtp.{digit}.ffn.gate.weight") is None
        assert V4.parse_expert(f"layers.3.ffn.experts.{digit}.w1.weight") is None
        assert _layer_of(f"model.layers.{digit}.mlp.gate.weight") is None


def test_ascii_digits_still_name_them() -> None:
    assert V3.layer_of("model.layers.3.mlp.gate.weight") == 3
    assert V3.parse_expert("model.layers.3.mlp.experts.17.gate_proj.weight") == (3, 17, "gate_proj", "weight")
    assert V4.layer_of("mtp.0.ffn.gate.weight") == 4
    assert V4.parse_expert("layers.3.ffn.experts.5.w2.weight") == (3, 5, "down_proj", "weight")
    assert _layer_of("model.layers.12.mlp.gate.weight") == 12
