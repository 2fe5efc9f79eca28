"""Which dense tensors a model reads: vLLM builds the target and the draft model from one cache, and each
drops the other's dense tensors in its own `load_weights`; reading only a model's own part saves reading
the whole dense set twice at every start.

The parts follow vLLM 0.34's models:
- the drafter's part: the tensors of the drafter blocks (the family's layers from num_hidden_layers on:
  V4 `mtp.K.*`, V3 `model.layers.{N+K}.*`) and DSpark's `context_wkv_proj.*` when a checkpoint ships it.
  The draft models load nothing else: DSpark's `_remap_dspark_name` and MTP's spec-layer test return None
  for every other name, and both alias the embedding (and DSpark the head) from the target
  (`has_own_embed_tokens = False`; vllm/models/deepseek_v4/nvidia/dspark.py, mtp.py; V3's DeepSeekMTP
  the same, vllm/models/deepseek_v32/nvidia/mtp.py);
- the main part: every other dense tensor. vLLM's main V4 model drops every `mtp.` name
  (`orig_to_new_substr={"mtp.": None}`, vllm/models/deepseek_v4/nvidia/model.py), V3's every spec layer.
Pure: names in, a yes or no out.
"""

from __future__ import annotations

from ..plan.drafter_vram import CONTEXT_WKV
from ..enums import StrEnum
from ..format.families import DeepseekV4, Family


class DensePart(StrEnum):
    ALL = "all"              # every dense tensor (a model that holds main layers and drafter blocks, or neither)
    MAIN = "main"            # the target model's: all but the drafter's
    DRAFTER = "drafter"      # the draft model's: the drafter blocks' and DSpark's shipped context_wkv_proj


def is_drafter_tensor(family: Family, name: str) -> bool:
    """A dense tensor of the drafter: under a drafter block, or DSpark's top-level context_wkv_proj (V4)."""
    layer = family.layer_of(name)
    if layer is not None:
        return family.is_mtp(layer)
    return isinstance(family, DeepseekV4) and CONTEXT_WKV.match(name) is not None


def in_part(part: DensePart, family: Family, name: str) -> bool:
    """Whether the dense tensor `name` belongs to `part`."""
    if part == DensePart.ALL:
        return True
    return is_drafter_tensor(family, name) == (part == DensePart.DRAFTER)


def part_of_layers(family: Family, layers: list[int]) -> DensePart:
    """The dense part of a model that holds these routed-expert layers: the drafter's when it holds only
    drafter blocks, the main part when it holds only main layers, else all."""
    drafter = [family.is_mtp(x) for x in layers]
    if drafter and all(drafter):
        return DensePart.DRAFTER
    if drafter and not any(drafter):
        return DensePart.MAIN
    return DensePart.ALL


__all__ = ["DensePart", "is_drafter_tensor", "in_part", "part_of_layers"]
