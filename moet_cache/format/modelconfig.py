"""The DeepSeek-V3-family config.json keys that decide which layers are MoE and the tensor shapes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import InputError

_REQUIRED_INT = (
    "num_hidden_layers", "hidden_size", "moe_intermediate_size", "n_routed_experts",
)


def _int_key(cfg: dict[str, Any], key: str, default: int | None = None, lo: int = 0,
             hi: int = 1 << 24) -> int:
    val = cfg.get(key, default)
    if isinstance(val, bool) or not isinstance(val, int):
        raise InputError(
            f"config.json: {key} must be an integer, found {val!r}",
            "check that this is a DeepSeek-V3-family config.json",
        )
    if not lo <= val <= hi:
        raise InputError(f"config.json: {key}={val} is out of range [{lo}, {hi}]")
    return val


@dataclass(frozen=True)
class ModelConfig:
    """The MoE layout of a DeepSeek-V3-family model."""

    num_hidden_layers: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    hidden_size: int
    moe_intermediate_size: int
    num_nextn_predict_layers: int
    model_type: str

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read and range-check the keys; a missing or malformed key is an InputError naming it."""
        if not isinstance(cfg, dict):
            raise InputError("config.json must hold a JSON object")
        for key in _REQUIRED_INT:
            if key not in cfg:
                raise InputError(
                    f"config.json has no {key}",
                    "moet-cache reads DeepSeek-V3-family MoE checkpoints (n_routed_experts, moe_intermediate_size, ...)",
                )
        model_type = cfg.get("model_type", "")
        mc = cls(
            num_hidden_layers=_int_key(cfg, "num_hidden_layers", lo=1, hi=4096),
            first_k_dense_replace=_int_key(cfg, "first_k_dense_replace", 0, hi=4096),
            moe_layer_freq=_int_key(cfg, "moe_layer_freq", 1, lo=1, hi=4096),
            n_routed_experts=_int_key(cfg, "n_routed_experts", lo=1, hi=65536),
            n_shared_experts=_int_key(cfg, "n_shared_experts", 0, hi=65536),
            num_experts_per_tok=_int_key(cfg, "num_experts_per_tok", 8, lo=1, hi=65536),
            hidden_size=_int_key(cfg, "hidden_size", lo=16, hi=1 << 20),
            moe_intermediate_size=_int_key(cfg, "moe_intermediate_size", lo=16, hi=1 << 20),
            num_nextn_predict_layers=_int_key(cfg, "num_nextn_predict_layers", 0, hi=64),
            model_type=model_type if isinstance(model_type, str) else "",
        )
        for key in ("hidden_size", "moe_intermediate_size"):
            if getattr(mc, key) % 16:
                raise InputError(f"config.json: {key}={getattr(mc, key)} is not a multiple of 16 (the NVFP4 block)")
        return mc

    def is_moe_layer(self, idx: int) -> bool:
        """MoE when past the dense prefix and on the MoE frequency; MTP layers are MoE too."""
        return idx >= self.first_k_dense_replace and idx % self.moe_layer_freq == 0

    def main_moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def mtp_layers(self) -> list[int]:
        n = self.num_hidden_layers
        return list(range(n, n + self.num_nextn_predict_layers))

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_LAYER_NUMBER = re.compile(r"[0-9]{1,6}")


def parse_layer_selection(text: str) -> set[int]:
    """'3-60', '3,5,7-9' -> a set of layer numbers."""
    out: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        # ASCII digits only: str.isdigit() takes '²' and '٣', which int() then refuses (an internal error)
        if not _LAYER_NUMBER.fullmatch(lo) or (sep and not _LAYER_NUMBER.fullmatch(hi)):
            raise InputError(f"cannot read the layer selection {text!r}", "write e.g. 3-60 or 3,5,7-9")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a or b - a > 1 << 16:
            raise InputError(f"the layer range {part!r} is empty or too large")
        out.update(range(a, b + 1))
    if not out:
        raise InputError(f"the layer selection {text!r} names no layer")
    return out
