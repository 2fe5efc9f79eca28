"""Read a Hugging Face style NVFP4 MoE checkpoint (ModelOpt or compressed-tensors) through safetensors."""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from .errors import InputError, UnsupportedCheckpointError
from .fsutil import read_json_file
from .hashing import xxh3_file_hex, xxh3_hex
from .modelconfig import ModelConfig

MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# Per layout, the suffix of each expert tensor kind.
TENSOR_SUFFIXES = {
    MODELOPT: {"codes": "weight", "block_scale": "weight_scale", "global_scale": "weight_scale_2",
               "input_scale": "input_scale"},
    COMPRESSED_TENSORS: {"codes": "weight_packed", "block_scale": "weight_scale",
                         "global_scale": "weight_global_scale", "input_scale": "input_global_scale"},
}
_FP4_X2 = getattr(torch, "float4_e2m1fn_x2", None)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shard: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardFingerprint:
    name: str
    size: int
    mtime_ns: int
    header_xxh3: str


@dataclass(frozen=True)
class SourceFingerprint:
    """What identifies a source checkpoint: its shards' sizes, times and header digests, its config."""

    shards: tuple[ShardFingerprint, ...]
    config_xxh3: str
    index_xxh3: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "config_xxh3": self.config_xxh3,
            "index_xxh3": self.index_xxh3,
            "shards": [s.__dict__ for s in self.shards],
        }


def expert_prefix(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}"


def expert_layer_of(name: str) -> tuple[int, int] | None:
    """(layer, expert) if `name` is a routed-expert tensor, else None."""
    parts = name.split(".")
    if len(parts) >= 6 and parts[0] == "model" and parts[1] == "layers" and parts[3] == "mlp" \
            and parts[4] == "experts" and parts[2].isdigit() and parts[5].isdigit():
        return int(parts[2]), int(parts[5])
    return None


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def detect_layout(config: dict[str, Any], root: Path, names: set[str]) -> str:
    """ModelOpt or compressed-tensors NVFP4, from config.json, hf_quant_config.json, then tensor names."""
    qc = config.get("quantization_config")
    if isinstance(qc, dict):
        method = str(qc.get("quant_method", "")).lower()
        if method == "modelopt":
            algo = str(qc.get("quant_algo", "")).upper()
            if algo not in ("NVFP4", ""):
                raise UnsupportedCheckpointError(
                    f"this is a ModelOpt checkpoint with quant_algo={algo}, not NVFP4",
                    "moet-cache reads NVFP4 checkpoints only")
            return MODELOPT
        if method == "compressed-tensors":
            formats = {str(qc.get("format", ""))}
            for group in (qc.get("config_groups") or {}).values():
                if isinstance(group, dict):
                    formats.add(str(group.get("format", "")))
            if "nvfp4-pack-quantized" in formats:
                return COMPRESSED_TENSORS
            raise UnsupportedCheckpointError(
                f"this is a compressed-tensors checkpoint in format {sorted(f for f in formats if f)}, "
                "not nvfp4-pack-quantized", "moet-cache reads NVFP4 checkpoints only")
        if method:
            raise UnsupportedCheckpointError(
                f"this checkpoint is quantized with {method!r}, not NVFP4",
                "moet-cache reads ModelOpt NVFP4 and compressed-tensors nvfp4-pack-quantized checkpoints")
    hf_quant = root / "hf_quant_config.json"
    if hf_quant.is_file():
        q = read_json_file(hf_quant).get("quantization", {})
        algo = str(q.get("quant_algo", "")) if isinstance(q, dict) else ""
        if algo.upper() == "NVFP4":
            return MODELOPT
        raise UnsupportedCheckpointError(f"hf_quant_config.json says quant_algo={algo!r}, not NVFP4")
    if any(n.endswith(".weight_packed") for n in names):
        return COMPRESSED_TENSORS
    if any(n.endswith(".weight_scale_2") for n in names):
        return MODELOPT
    raise UnsupportedCheckpointError(
        "found no NVFP4 quantization (no quantization_config, no hf_quant_config.json, no FP4 tensors)",
        "moet-cache reads ModelOpt NVFP4 and compressed-tensors nvfp4-pack-quantized checkpoints")


def _checked_shard_name(name: Any, root: Path) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") \
            or name.startswith(".") or "\x00" in name or len(name.encode("utf-8", "replace")) > 255:
        # (a 5000-character name made is_file() raise ENAMETOOLONG: exit 3 instead of 2)
        raise InputError(f"{INDEX_NAME} names an invalid shard file {name[:80] if isinstance(name, str) else name!r}",
                         "shard names must be plain file names in the checkpoint folder")
    if not (root / name).is_file():
        raise InputError(f"{INDEX_NAME} names the shard {name}, which does not exist in {root}",
                         "copy the missing shard or fix the index")
    return name


class Checkpoint:
    """An open NVFP4 checkpoint: config, layout, tensor map; reads tensors through safe_open."""

    def __init__(self, root: Path, config: dict[str, Any], model: ModelConfig, layout: str,
                 tensors: dict[str, TensorInfo], index: dict[str, Any] | None,
                 shard_metadata: dict[str, dict[str, str] | None]) -> None:
        self.root = root
        self.config = config
        self.model = model
        self.layout = layout
        self.tensors = tensors
        self.index = index
        self.shard_metadata = shard_metadata
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}

    # --- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def shards(self) -> list[str]:
        return sorted({t.shard for t in self.tensors.values()})

    def _handle(self, shard: str) -> Any:
        h = self._handles.get(shard)
        if h is None:
            h = self._stack.enter_context(safe_open(str(self.root / shard), framework="pt"))
            self._handles[shard] = h
        return h

    # --- reading ---------------------------------------------------------------------------
    def get(self, name: str) -> torch.Tensor:
        info = self.tensors.get(name)
        if info is None:
            raise InputError(f"the checkpoint has no tensor {name}")
        try:
            return self._handle(info.shard).get_tensor(name)
        except Exception as e:  # safetensors raises its own errors for truncated data
            raise InputError(f"cannot read tensor {name} from {info.shard}: {e}",
                             "the shard may be truncated or corrupt") from None

    def get_raw(self, name: str) -> np.ndarray:
        """A tensor's bytes as uint8 with the tensor's shape (last dim scaled by the item size)."""
        t = self.get(name)
        return tensor_bytes(t)

    def expert_names(self, layer: int, expert: int, proj: str) -> dict[str, str]:
        prefix = expert_prefix(layer, expert, proj)
        return {k: f"{prefix}.{s}" for k, s in TENSOR_SUFFIXES[self.layout].items()}

    def read_expert(self, layer: int, expert: int, proj: str) -> ExpertTensors:
        """The codes, block scales and scalars of one projection of one routed expert."""
        names = self.expert_names(layer, expert, proj)
        codes = self.get(names["codes"])
        if _FP4_X2 is not None and codes.dtype == _FP4_X2:
            codes = codes.view(torch.uint8)
        scale = self.get(names["block_scale"])
        gscale = self.get(names["global_scale"])
        iscale = self.get(names["input_scale"]) if names["input_scale"] in self.tensors else None
        return ExpertTensors(codes=codes.numpy(), block_scale=scale, global_scale=gscale,
                             input_scale=iscale)

    def multiply_global_scale(self, t: torch.Tensor) -> float:
        """The source's global scale in the cache's convention: W = E2M1 * block_scale * global."""
        v = float(t.reshape(-1)[0].to(torch.float64))
        if self.layout == COMPRESSED_TENSORS:
            return float(np.float32(1.0 / v)) if v != 0 else 0.0
        return v

    # --- identity --------------------------------------------------------------------------
    def fingerprint(self) -> SourceFingerprint:
        shards = []
        for name in self.shards:
            p = self.root / name
            st = p.stat()
            shards.append(ShardFingerprint(name, st.st_size, st.st_mtime_ns, header_digest(p)))
        idx = self.root / INDEX_NAME
        return SourceFingerprint(
            shards=tuple(shards),
            config_xxh3=xxh3_file_hex(self.root / "config.json"),
            index_xxh3=xxh3_file_hex(idx) if idx.is_file() else None,
        )

    def expert_tensor_names(self, layers: list[int]) -> set[str]:
        out: set[str] = set()
        for layer in layers:
            for e in range(self.model.n_routed_experts):
                for proj in PROJECTIONS:
                    out.update(n for n in self.expert_names(layer, e, proj).values() if n in self.tensors)
        return out

    def validate_experts(self, layers: list[int]) -> None:
        """Every routed expert tensor of these layers exists with the dtype and shape NVFP4 needs."""
        m = self.model
        H, I = m.hidden_size, m.moe_intermediate_size
        for layer in layers:
            for e in range(m.n_routed_experts):
                for proj in PROJECTIONS:
                    out_dim, in_dim = (H, I) if proj == "down_proj" else (I, H)
                    names = self.expert_names(layer, e, proj)
                    self._expect(names["codes"], ("U8", "F4"), (out_dim, in_dim // 2), layer, e)
                    self._expect(names["block_scale"], ("F8_E4M3",), (out_dim, in_dim // 16), layer, e)
                    self._expect(names["global_scale"], ("F32",), None, layer, e)
                    if names["input_scale"] in self.tensors:
                        self._expect(names["input_scale"], ("F32",), None, layer, e)

    def _expect(self, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None,
                layer: int, expert: int) -> None:
        info = self.tensors.get(name)
        where = f"(layer {layer}, expert {expert})"
        if info is None:
            raise InputError(f"the checkpoint lacks {name} {where}",
                             "the checkpoint is incomplete or not a DeepSeek-style NVFP4 MoE")
        if info.dtype not in dtypes:
            raise InputError(f"{name} {where} has dtype {info.dtype}, expected {' or '.join(dtypes)}")
        got = info.shape
        if info.dtype == "F4" and shape is not None and got[:-1] == shape[:-1] and got[-1] == 2 * shape[-1]:
            got = shape  # safetensors' F4 header shape counts elements, not packed bytes
        if shape is None:
            if int(np.prod(got, dtype=np.int64)) != 1:
                raise InputError(f"{name} {where} should hold one scalar, has shape {list(got)}")
        elif tuple(got) != shape:
            raise InputError(f"{name} {where} has shape {list(got)}, expected {list(shape)}",
                             "check hidden_size and moe_intermediate_size in config.json")


@dataclass
class ExpertTensors:
    codes: np.ndarray            # uint8 [out, in/2]
    block_scale: torch.Tensor    # float8_e4m3fn [out, in/16]
    global_scale: torch.Tensor   # float32 scalar, in the source's convention
    input_scale: torch.Tensor | None


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's raw bytes as a uint8 numpy array (no copy where the tensor is contiguous)."""
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8).numpy()


def header_digest(path: Path) -> str:
    """xxh3-128 of a safetensors file's length prefix and JSON header (identifies its layout cheaply)."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        return xxh3_hex(head + f.read(min(n, 100 << 20)))


def _require_plain_file(p: Path) -> None:
    """A source file must be a regular file (a link to one is fine: Hugging Face snapshots are links)."""
    import stat
    try:
        mode = os.stat(p).st_mode
    except OSError as e:
        raise InputError(f"{p.name} cannot be read: {e.strerror}", "copy the checkpoint again") from None
    if not stat.S_ISREG(mode):
        raise InputError(f"{p.name} is not a plain file (a FIFO, device or folder)",
                         "give a checkpoint folder of plain files")


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a checkpoint folder: config.json, the index or model.safetensors, every shard's header."""
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"{root} is not a folder", "give the checkpoint folder that holds config.json")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise InputError(f"{root} has no config.json", "give a Hugging Face style checkpoint folder")
    config = read_json_file(cfg_path)
    model = ModelConfig.from_dict(config)
    index = None
    if (root / INDEX_NAME).is_file():
        index = read_json_file(root / INDEX_NAME)
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise InputError(f"{INDEX_NAME} has no weight_map object", "regenerate the index")
        # each distinct name checked once: an index names a few shards for tens of thousands of tensors
        checked: set[str] = set()
        shard_of = {}
        for k, v in wm.items():
            if not (isinstance(v, str) and v in checked):
                checked.add(_checked_shard_name(v, root))
            shard_of[str(k)] = v
        shard_names = sorted(checked)
    elif (root / SINGLE_NAME).is_file():
        shard_of, shard_names = None, [SINGLE_NAME]
    else:
        raise InputError(f"{root} has neither {INDEX_NAME} nor {SINGLE_NAME}",
                         "give a Hugging Face style checkpoint folder")
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, dict[str, str] | None] = {}
    for shard in shard_names:
        _require_plain_file(root / shard)  # a FIFO would block safe_open forever
        try:
            with safe_open(str(root / shard), framework="pt") as f:
                metadata[shard] = f.metadata()
                for name in f.keys():
                    if name in tensors:
                        raise InputError(f"{name} is in two shards, {tensors[name].shard} and {shard}",
                                         "a tensor must be in exactly one shard; remove the duplicate")
                    sl = f.get_slice(name)
                    tensors[name] = TensorInfo(name, shard, sl.get_dtype(),
                                               tuple(int(x) for x in sl.get_shape()))
        except InputError:
            raise
        except Exception as e:
            raise InputError(f"{shard} is not a readable safetensors file: {e}",
                             "the shard may be truncated or corrupt; copy it again") from None
    if shard_of is not None:
        for name, shard in shard_of.items():
            if name not in tensors or tensors[name].shard != shard:
                raise InputError(f"{INDEX_NAME} puts {name} in {shard}, but that shard does not hold it",
                                 "regenerate the index or copy the right shard")
    from .stwriter import DTYPE_SIZES
    odd = next((t for t in tensors.values() if t.dtype not in DTYPE_SIZES and t.dtype != "F4"), None)
    if odd is not None:  # found by the fault campaign: e.g. F8_E8M0 crashed the dense copy
        raise UnsupportedCheckpointError(f"{odd.name} in {odd.shard} has dtype {odd.dtype}, which moet-cache cannot carry",
                                         f"supported dtypes: {', '.join(sorted(DTYPE_SIZES))}, F4")
    layout = detect_layout(config, root, set(tensors))
    return Checkpoint(root, config, model, layout, tensors, index, metadata)
