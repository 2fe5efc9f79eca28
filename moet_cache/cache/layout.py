"""Where each file lives inside a cache folder, and the tensor names inside them (docs/FORMAT.md)."""

from __future__ import annotations

from ..enums import StrEnum

LAYERS_DIR = "layers"
DENSE_DIR = "dense"
STAGING_DIR = "staging"
AUX_DIR = "model"
PACK = "delta/tier.safetensors"
DELTA_INDEX = "delta/tier.json"
SOURCE_MAP = "source-map.json"
# The paths the builds of this folder wrote, the sweep's proof (build/written.py); not part of the format.
WRITTEN_RECORD = ".written.json"
# Every folder the library writes into (must never be a link out of the cache).
WRITTEN_DIRS = (LAYERS_DIR, DENSE_DIR, STAGING_DIR, AUX_DIR, "delta", ".state")


class Role(StrEnum):
    """What a file listed in a manifest is for (the `role` of a FileEntry; manifests/*.schema.json)."""

    BASE = "base"                    # a layer's base planes
    DELTA_ALL = "delta-all"          # a layer's every delta plane (--lossless)
    DENSE = "dense"                  # a dense shard
    PACK = "delta-pack"              # the delta tier's planes
    DELTA_INDEX = "delta-index"      # which experts the tier holds
    SOURCE_MAP = "source-map"
    AUX = "aux"                      # the model folder's files
    # The model folder's config.json is the one vLLM reads (quant_method moet, quant_block.py); the source's
    # own config.json is kept byte for byte beside it for export.
    SOURCE_CONFIG = "source-config"
    PART = "part-manifest"           # a finished piece of a build (dense shard, tier), for resume
    LAYER_MANIFEST = "layer-manifest"  # a layer manifest (the cache manifest lists these as layer refs)


# Base-plane file of a layer (vLLM's fused-MoE names; w13 = gate and up stacked, w2 = down).
W13_BASE, W2_BASE = "w13_base", "w2_base"
W13_SCALE, W2_SCALE = "w13_weight_scale", "w2_weight_scale"
W13_SCALE_2, W2_SCALE_2 = "w13_weight_scale_2", "w2_weight_scale_2"
W13_INPUT_SCALE, W2_INPUT_SCALE = "w13_input_scale", "w2_input_scale"
W13_TABLE, W2_TABLE = "w13_table", "w2_table"
# Delta planes (per-layer lossless file, and per layer inside the tier pack).
W13_DELTA, W2_DELTA = "w13_delta", "w2_delta"
# The mid tier (inside the tier pack): each chosen expert's mid plane (the delta's high bit, one bit a weight)
# and its 8-entry tables by 3-bit code (code >> 1), w13 (gate, up) and w2.
W13_MID, W2_MID = "w13_mid", "w2_mid"
W13_MID_TABLE, W2_MID_TABLE = "w13_mid_table", "w2_mid_table"


def layer_manifest(layer: int) -> str:
    return f"{LAYERS_DIR}/layer-{layer:03d}.json"


def base_file(layer: int) -> str:
    return f"{LAYERS_DIR}/layer-{layer:03d}.base.safetensors"


def delta_file(layer: int) -> str:
    return f"{LAYERS_DIR}/layer-{layer:03d}.delta.safetensors"


def dense_file(shard: str) -> str:
    return f"{DENSE_DIR}/{shard}"


def dense_record(shard: str) -> str:
    return f"{DENSE_DIR}/{shard}.json"


def pack_tensor(layer: int, which: str) -> str:
    return f"layers.{layer}.{which}"


def source_scalar(proj: str, kind: str) -> str:
    """In the delta-all file: the source's own scalar tensors, stacked over experts, for a bit-exact export."""
    return f"source.{proj}.{kind}"
