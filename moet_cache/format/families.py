"""Naming families: where a checkpoint keeps its routed experts, which layers are MoE, where the drafters are.

A family is a small object; the builder, verifier, exporter, loader and plan ask it, never a name
pattern of their own. Adding a family (V3.2, Kimi, GLM) is a new class here and an entry in FAMILIES.

Cache layer numbers (docs/FORMAT.md): main layers keep their number; a drafter (MTP) block is
`num_hidden_layers + K`. Inside the cache the three projections keep one set of names whatever the
family: gate_proj, up_proj, down_proj (PROJECTIONS); the family maps them to its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from ..errors import UnsupportedCheckpointError
from .modelconfig import ModelConfig

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    """A naming family bound to one checkpoint (its model config and its drafter blocks)."""

    name: str
    num_hidden_layers: int
    moe_layers: tuple[int, ...]          # main MoE layers (cache numbers)
    mtp_layers: tuple[int, ...]          # drafter blocks present in the checkpoint (cache numbers)

    # --- what each family defines ------------------------------------------------------------
    def layer_prefix(self, layer: int) -> str:
        raise NotImplementedError

    def proj_name(self, proj: str) -> str:
        raise NotImplementedError

    def layer_of(self, name: str) -> int | None:
        """The cache layer number a tensor belongs to (None for top-level tensors)."""
        raise NotImplementedError

    experts_infix = ""

    # --- shared -------------------------------------------------------------------------------
    def expert_prefix(self, layer: int, expert: int, proj: str) -> str:
        return f"{self.layer_prefix(layer)}.{self.experts_infix}.{expert}.{self.proj_name(proj)}"

    def parse_expert(self, name: str) -> tuple[int, int, str, str] | None:
        """(cache layer, expert, projection, suffix) of a routed-expert tensor name, else None."""
        layer = self.layer_of(name)
        if layer is None:
            return None
        head = self.layer_prefix(layer) + "." + self.experts_infix + "."
        if not name.startswith(head):
            return None
        parts = name[len(head):].split(".")
        if len(parts) != 3 or not (parts[0].isascii() and parts[0].isdigit()) or str(int(parts[0])) != parts[0]:
            return None
        proj = {self.proj_name(p): p for p in PROJECTIONS}.get(parts[1])
        return (layer, int(parts[0]), proj, parts[2]) if proj else None

    def is_mtp(self, layer: int) -> bool:
        return layer >= self.num_hidden_layers

    def drafter_layout(self, names: Iterable[str]) -> str:
        """The drafter's layout from its tensor names: MTP (one output head a block) unless a family says else."""
        return DRAFTER_MTP

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "moe_layers": list(self.moe_layers), "mtp_layers": list(self.mtp_layers)}


DRAFTER_MTP = "mtp"          # multi-token prediction: each block e/h_proj and its own head (V4-Flash, V3)
DRAFTER_DSPARK = "dspark"    # DSpark: blocks mtp.0 .. mtp.K under one head stack (DeepSeek-V4-Flash-0731)
DRAFTER_LAYOUTS = (DRAFTER_MTP, DRAFTER_DSPARK)

_V3_LAYER = re.compile(r"^model\.layers\.([0-9]+)\.")
_V4_LAYER = re.compile(r"^layers\.([0-9]+)\.")
_V4_MTP = re.compile(r"^mtp\.([0-9]+)\.")
# DSpark's head stack (vLLM 0.34 vllm/models/deepseek_v4/nvidia/dspark.py, _remap_dspark_name): the target's
# hidden states in (main_proj), the Markov and confidence heads out; an MTP drafter has none of them.
_V4_DSPARK_HEAD = re.compile(r"^mtp\.[0-9]+\.(main_proj|main_norm|markov_head|confidence_head)\.")


@dataclass(frozen=True)
class DeepseekV3(Family):
    """`model.layers.L.mlp.experts.E.{gate,up,down}_proj`; dense layers first; MTP at num_hidden_layers."""

    experts_infix = "mlp.experts"

    def layer_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}"

    def proj_name(self, proj: str) -> str:
        return proj

    def layer_of(self, name: str) -> int | None:
        m = _V3_LAYER.match(name)
        return int(m.group(1)) if m else None


_V4_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@dataclass(frozen=True)
class DeepseekV4(Family):
    """`layers.L.ffn.experts.E.{w1,w3,w2}`; every main layer MoE (the first num_hash_layers routed by
    token id, `ffn.gate.tid2eid`); drafter blocks `mtp.K.*` are cache layers num_hidden_layers + K."""

    experts_infix = "ffn.experts"

    def layer_prefix(self, layer: int) -> str:
        if layer >= self.num_hidden_layers:
            return f"mtp.{layer - self.num_hidden_layers}"
        return f"layers.{layer}"

    def proj_name(self, proj: str) -> str:
        return _V4_PROJ[proj]

    def layer_of(self, name: str) -> int | None:
        m = _V4_LAYER.match(name)
        if m:
            return int(m.group(1))
        m = _V4_MTP.match(name)
        return self.num_hidden_layers + int(m.group(1)) if m else None

    def drafter_layout(self, names: Iterable[str]) -> str:
        return DRAFTER_DSPARK if any(_V4_DSPARK_HEAD.match(n) for n in names) else DRAFTER_MTP


@dataclass(frozen=True)
class _Kind:
    cls: type[Family]
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    expert_name: re.Pattern[str]        # a routed-expert tensor of this family


FAMILIES = (
    _Kind(DeepseekV3, ("deepseek_v3", "deepseek_v2", "kimi_k2"), ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
          re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.")),
    _Kind(DeepseekV4, ("deepseek_v4",), ("DeepseekV4ForCausalLM",),
          re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.")),
)


def _claims(kind: _Kind, config: dict[str, Any]) -> bool | None:
    """True when config.json names this family, False when it names another, None when it names none."""
    mt = config.get("model_type")
    arch = config.get("architectures")
    arch = [a for a in arch if isinstance(a, str)] if isinstance(arch, list) else []
    if not (isinstance(mt, str) and mt) and not arch:
        return None
    names_it = (isinstance(mt, str) and mt in kind.model_types) or any(a in kind.architectures for a in arch)
    names_other = any((isinstance(mt, str) and mt in k.model_types) or any(a in k.architectures for a in arch)
                      for k in FAMILIES if k is not kind)
    return names_it and not names_other


def detect_family(config: dict[str, Any], model: ModelConfig, names: Iterable[str]) -> Family:
    """The family of a checkpoint, from config.json (model_type, architectures) and its tensor names.

    Both must agree; a checkpoint that matches no family (or two) is refused (exit 2) with what was found.
    """
    names = list(names)
    found = []
    for kind in FAMILIES:
        hits = [n for n in names if kind.expert_name.match(n)]
        claim = _claims(kind, config)
        if hits and claim is not False:
            found.append((kind, hits))
    mt, arch = config.get("model_type"), config.get("architectures")
    what = f"model_type {mt!r}, architectures {arch!r}"
    if len(found) != 1:
        sample = next((n for n in sorted(names) if ".experts." in n), None) or (sorted(names)[0] if names else "none")
        if not found:
            raise UnsupportedCheckpointError(
                f"this checkpoint is not a MoE family moet-cache knows ({what}; a tensor: {sample[:120]})",
                "supported: DeepSeek-V3 family (model.layers.L.mlp.experts.E.gate_proj) and DeepSeek-V4 "
                "(layers.L.ffn.experts.E.w1)")
        raise UnsupportedCheckpointError(f"this checkpoint mixes the expert names of two families ({what})",
                                         "one naming family a checkpoint")
    kind, hits = found[0]
    probe = kind.cls(kind.cls.__name__, model.num_hidden_layers, (), ())
    layers = {probe.layer_of(n) for n in hits}
    n = model.num_hidden_layers
    _check_layer_count(kind.cls, model, names)
    if kind.cls is DeepseekV4:
        moe = tuple(range(n))
        mtp = tuple(sorted(x for x in layers if x is not None and x >= n))
        name = "deepseek_v4"
    else:
        moe = tuple(model.main_moe_layers())
        mtp = tuple(i for i in model.mtp_layers() if model.is_moe_layer(i) and i in layers)
        name = "deepseek_v3"
    return kind.cls(name, n, moe, mtp)


def _check_layer_count(cls: type[Family], model: ModelConfig, names: list[str]) -> None:
    """config.json's num_hidden_layers must cover every main layer the tensors name. V4 numbers its drafter
    blocks after the main layers (`mtp.K` is cache layer num_hidden_layers + K): a count one short makes
    the last main layer and `mtp.0` one cache layer, and one of them would silently be left out. V3 keeps
    its MTP layers in the main numbering, so a tensor past num_hidden_layers + num_nextn_predict_layers
    belongs to no layer the config knows."""
    n = model.num_hidden_layers
    if cls is DeepseekV4:
        pattern, limit = _V4_LAYER, n
    else:
        pattern, limit = _V3_LAYER, n + model.num_nextn_predict_layers
    beyond = max((int(m.group(1)) for name in names if (m := pattern.match(name))), default=-1)
    if beyond >= limit:
        what = "" if cls is DeepseekV4 else f" and num_nextn_predict_layers={model.num_nextn_predict_layers}"
        raise UnsupportedCheckpointError(
            f"config.json says num_hidden_layers={n}{what}, but the checkpoint has tensors of layer {beyond}",
            "config.json and the shards must describe the same model: fix num_hidden_layers or use the "
            "checkpoint's own config.json")


# The families a cache manifest may name (its model.family.name), by name.
FAMILY_CLASSES: dict[str, type[Family]] = {"deepseek_v3": DeepseekV3, "deepseek_v4": DeepseekV4}


__all__ = ["DeepseekV3", "DeepseekV4", "FAMILIES", "Family", "PROJECTIONS", "FAMILY_CLASSES", "detect_family",
           "DRAFTER_MTP", "DRAFTER_DSPARK", "DRAFTER_LAYOUTS"]
