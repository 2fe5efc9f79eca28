"""Read a Hugging Face style FP4 MoE checkpoint: the one source reader every command uses.

A checkpoint is a folder with config.json and safetensors shards (an index, or model.safetensors).
Its naming family (families.py) says where the routed experts are; each expert projection's format
(formats.py: ModelOpt NVFP4, compressed-tensors NVFP4, MXFP4) is read from the tensors present, so
one checkpoint may mix them (DeepSeek-V4-Flash-0731-NVFP4: NVFP4 main layers, MXFP4 drafters).
Headers are read by stheader.read_header; bytes with os.pread at the header offsets (no memory maps,
thread-safe, the GIL released while the disk reads). A source may be a Hugging Face hub snapshot
whose files are links into its blobs: links are followed inside the source.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, UnsupportedCheckpointError
from ..format.families import PROJECTIONS, Family, detect_family
from ..format.formats import (CT_NVFP4, E4M3_16, E8M0_32, LAYOUT_FORMAT, MODELOPT_NVFP4, ExpertFormat, SourceLayout,
                      TensorKind, compact_e8m0, format_of)
from ..fsutil import read_json_file
from ..hashing import xxh3_file_hex, xxh3_hex
from ..cache.manifest import ShardFingerprint, SourceFingerprint
from ..format.modelconfig import ModelConfig
from ..stheader import Entry, nbytes, read_header, storage_shape, torch_dtype

# Checkpoint-level layouts (formats.SourceLayout), by the short names the code and tests use.
MODELOPT, COMPRESSED_TENSORS, MXFP4_LAYOUT = SourceLayout.MODELOPT, SourceLayout.COMPRESSED_TENSORS, SourceLayout.MXFP4
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# Per layout, the suffix of each expert tensor kind (the layout's own expert format).
TENSOR_SUFFIXES = {layout: fmt.suffixes() for layout, fmt in LAYOUT_FORMAT.items()}
__all_projections__ = PROJECTIONS


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shard: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


def _fp8_is_mxfp4(qc: dict[str, Any], names: set[str]) -> bool:
    """DeepSeek-V4's official release: quant_method fp8 for the dense part, expert_dtype fp4 (MXFP4)."""
    if str(qc.get("expert_dtype", "")).lower() in ("fp4", "mxfp4"):
        return True
    return any(n.endswith(".scale") and ".experts." in n for n in names)


def detect_layout(config: dict[str, Any], root: Path, names: set[str]) -> SourceLayout:
    """ModelOpt NVFP4, compressed-tensors NVFP4 or MXFP4, from config.json, hf_quant_config.json, then names."""
    qc = config.get("quantization_config")
    if isinstance(qc, dict):
        method = str(qc.get("quant_method", "")).lower()
        if method == "modelopt":
            algo = str(qc.get("quant_algo", "")).upper()
            if algo not in ("NVFP4", ""):
                raise UnsupportedCheckpointError(
                    f"this is a ModelOpt checkpoint with quant_algo={algo}, not NVFP4",
                    "moet-cache reads NVFP4 and MXFP4 checkpoints only")
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
                "not nvfp4-pack-quantized", "moet-cache reads NVFP4 and MXFP4 checkpoints only")
        if method == "fp8" and _fp8_is_mxfp4(qc, names):
            return MXFP4_LAYOUT
        if method:
            raise UnsupportedCheckpointError(
                f"this checkpoint is quantized with {method!r}, not NVFP4 or MXFP4 experts",
                "moet-cache reads ModelOpt NVFP4, compressed-tensors nvfp4-pack-quantized and MXFP4-expert checkpoints")
    hf_quant = root / "hf_quant_config.json"
    if hf_quant.is_file():
        q = read_json_file(hf_quant, follow=True).get("quantization", {})
        algo = str(q.get("quant_algo", "")) if isinstance(q, dict) else ""
        if algo.upper() == "NVFP4":
            return MODELOPT
        raise UnsupportedCheckpointError(f"hf_quant_config.json says quant_algo={algo!r}, not NVFP4")
    if any(n.endswith(".weight_packed") for n in names):
        return COMPRESSED_TENSORS
    if any(n.endswith(".weight_scale_2") for n in names):
        return MODELOPT
    raise UnsupportedCheckpointError(
        "found no NVFP4 or MXFP4 quantization (no quantization_config, no hf_quant_config.json, no FP4 tensors)",
        "moet-cache reads ModelOpt NVFP4, compressed-tensors nvfp4-pack-quantized and MXFP4-expert checkpoints")


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


@dataclass(frozen=True)
class ExpertTensors:
    codes: np.ndarray            # uint8 [out, in/2]
    block_scale: Any             # torch: float8_e4m3fn [out, in/16] or float8_e8m0fnu [out, in/32]
    global_scale: Any            # torch float32 scalar in the source's convention, None for MXFP4
    input_scale: Any


@dataclass(frozen=True)
class RawExpert:
    """One projection of one routed expert as the source's bytes (no torch: the build's hot loop)."""
    codes: np.ndarray                 # uint8 [out, in/2], packed FP4
    scale_bytes: np.ndarray           # uint8 [out, in/group], the source's block scales
    global_scale: np.ndarray | None   # float32, the source's shape and convention (None: MXFP4)
    input_scale: np.ndarray | None
    fmt: ExpertFormat = MODELOPT_NVFP4

    @property
    def scale_2(self) -> float:
        """The per-tensor scale in the cache's convention (1.0 for MXFP4)."""
        return self.fmt.multiply(self.global_scale) if self.global_scale is not None else 1.0


class Checkpoint:
    """An open FP4 MoE checkpoint: config, family, layout, tensor map; reads bytes with pread."""

    def __init__(self, root: Path, config: dict[str, Any], model: ModelConfig, layout: SourceLayout,
                 tensors: dict[str, TensorInfo], index: dict[str, Any] | None,
                 shard_metadata: dict[str, dict[str, str] | None], family: Family | None = None,
                 offsets: dict[str, Entry] | None = None, head_raw: dict[str, bytes] | None = None) -> None:
        self.root = root
        self.config = config
        self.model = model
        self.layout = layout
        self.tensors = tensors
        self.index = index
        self.shard_metadata = shard_metadata
        self.family = family or detect_family(config, model, tensors)
        self.offsets = offsets or {}
        self._head_raw = head_raw or {}
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._pool: dict[int, list[np.ndarray]] = {}

    # --- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def shards(self) -> list[str]:
        return sorted({t.shard for t in self.tensors.values()})

    # --- bytes ------------------------------------------------------------------------------
    def _fd(self, shard: str) -> int:
        with self._lock:
            fd = self._fds.get(shard)
            if fd is None:
                fd = os.open(self.root / shard, os.O_RDONLY)
                want = self._head_raw.get(shard)
                if want is None or os.pread(fd, len(want), 0) != want:
                    os.close(fd)
                    raise InputError(f"{shard} changed since it was opened: its header differs",
                                     "run the build again")
                self._fds[shard] = fd
            return fd

    def read_into(self, name: str, out: np.ndarray, start: int = 0) -> None:
        """Fill the uint8 array `out` with the bytes of tensor `name` from byte `start` of its data."""
        info = self.tensors.get(name)
        if info is None:
            raise InputError(f"the checkpoint has no tensor {name}")
        fd = self._fd(info.shard)
        ent = self.offsets[name]
        view = memoryview(out).cast("B")
        if start + view.nbytes > ent.end - ent.begin:
            raise InputError(f"{name} in {info.shard} changed since the checkpoint was opened", "run the build again")
        pos = ent.begin + start
        while view.nbytes:
            n = os.preadv(fd, [view], pos)
            if n <= 0:
                raise InputError(f"cannot read tensor {name} from {info.shard}: the file ends early",
                                 "the shard may be truncated or corrupt")
            view, pos = view[n:], pos + n

    def read(self, name: str, pooled: bool = False) -> np.ndarray:
        """A tensor's bytes as a 1-D uint8 array: a new one, or with pooled=True one given back by release().

        Reused buffers: touching fresh memory costs a page fault per 4 KiB, dear on a virtual machine.
        """
        info = self.tensors.get(name)
        if info is None:
            raise InputError(f"the checkpoint has no tensor {name}")
        n = info.nbytes
        out = None
        if pooled:
            with self._lock:
                free = self._pool.get(n)
                out = free.pop() if free else None
        if out is None:
            out = np.empty(n, dtype=np.uint8)
        self.read_into(name, out)
        return out

    def release(self, buf: np.ndarray) -> None:
        """Give back an array from read(pooled=True) once nothing uses it (at most a few kept per size)."""
        base = buf if buf.base is None else buf.base
        if isinstance(base, np.ndarray) and base.ndim == 1 and base.dtype == np.uint8:
            with self._lock:
                free = self._pool.setdefault(base.nbytes, [])
                if len(free) < 32:  # enough for the experts in flight (the build's window); more would only hold memory
                    free.append(base)

    def get_raw(self, name: str) -> np.ndarray:
        """A tensor's bytes as uint8 with the tensor's storage shape (last dim scaled by the item size)."""
        info = self.tensors.get(name)
        if info is None:
            raise InputError(f"the checkpoint has no tensor {name}")
        shape = storage_shape(info.dtype, info.shape) or (1,)
        raw = self.read(name)
        return raw.reshape(*shape[:-1], -1) if raw.size else raw.reshape(*shape[:-1], 0)

    def get(self, name: str) -> Any:
        """A tensor as torch (storage dtype: F4 as packed uint8)."""
        import torch
        info = self.tensors.get(name)
        if info is None:
            raise InputError(f"the checkpoint has no tensor {name}")
        raw = self.read(name)
        t = torch.from_numpy(raw).view(torch_dtype(info.dtype))
        return t.reshape(storage_shape(info.dtype, info.shape))

    # --- experts ----------------------------------------------------------------------------
    def expert_format(self, layer: int, expert: int, proj: str) -> ExpertFormat:
        # (a projection with none of a format's tensors: the layout's format, whose tensors validate_experts names)
        return format_of(self.family.expert_prefix(layer, expert, proj), self.tensors) or LAYOUT_FORMAT[self.layout]

    def layer_format(self, layer: int) -> ExpertFormat:
        """The one format of this layer's routed experts (expert 0's; validate_experts checks the rest)."""
        return self.expert_format(layer, 0, PROJECTIONS[0])

    def expert_names(self, layer: int, expert: int, proj: str,
                     fmt: ExpertFormat | None = None) -> dict[TensorKind, str]:
        prefix = self.family.expert_prefix(layer, expert, proj)
        if fmt is None:
            fmt = format_of(prefix, self.tensors) or LAYOUT_FORMAT[self.layout]
        return fmt.names(prefix)

    def read_raw_expert(self, layer: int, expert: int, proj: str, fmt: ExpertFormat | None = None) -> RawExpert:
        """The bytes of one projection of one expert (pooled code buffer: release() it when split)."""
        fmt = fmt or self.expert_format(layer, expert, proj)
        names = fmt.names(self.family.expert_prefix(layer, expert, proj))
        codes = self.read(names[TensorKind.CODES], pooled=True)
        rows = self.tensors[names[TensorKind.CODES]].shape[0]
        scale = self.read(names[TensorKind.BLOCK_SCALE]).reshape(self.tensors[names[TensorKind.BLOCK_SCALE]].shape)

        def scalar(kind: TensorKind) -> np.ndarray | None:  # F32 (validate_experts), little-endian in the file
            name = names.get(kind)
            if name is None or name not in self.tensors:
                return None
            return self.read(name).view("<f4").astype(np.float32, copy=False).reshape(self.tensors[name].shape)
        return RawExpert(codes.reshape(rows, -1), scale, scalar(TensorKind.GLOBAL_SCALE), scalar(TensorKind.INPUT_SCALE),
                         fmt)

    def read_expert(self, layer: int, expert: int, proj: str) -> ExpertTensors:
        """The codes, block scales and scalars of one projection of one routed expert, as torch."""
        import torch
        x = self.read_raw_expert(layer, expert, proj)
        codes = x.codes.copy()
        self.release(x.codes)
        scale = torch.from_numpy(x.scale_bytes).view(torch_dtype(x.fmt.scale_dtype))

        def t(a: np.ndarray | None) -> Any:
            return None if a is None else torch.from_numpy(a.copy())
        return ExpertTensors(codes=codes, block_scale=scale, global_scale=t(x.global_scale), input_scale=t(x.input_scale))

    def multiply_global_scale(self, t: Any) -> float:
        """The source's global scale in the cache's convention: W = E2M1 * block_scale * global."""
        import torch
        return LAYOUT_FORMAT[self.layout].multiply(t.reshape(-1)[:1].to(torch.float32).numpy())

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
            config_xxh3=xxh3_file_hex(self.root / "config.json", follow=True),
            index_xxh3=xxh3_file_hex(idx, follow=True) if idx.is_file() else None,
        )

    def scale_forms(self, layer: int, fmt: ExpertFormat | None = None) -> tuple[str, str]:
        """The block-scale form the base planes store for w13 and for w2: MXFP4's own e8m0; for NVFP4 e8m0 when
        every scale of the projection group (over all experts) is a non-zero power of two equal in pairs, else
        e4m3. Reads the scales of NVFP4 layers (stops at the first one that is not compact)."""
        fmt = fmt or self.layer_format(layer)
        if fmt.scale_form == E8M0_32:
            return E8M0_32, E8M0_32
        forms = []
        for projs in (PROJECTIONS[:2], PROJECTIONS[2:]):
            compact = True
            for e in range(self.model.n_routed_experts):
                for proj in projs:
                    name = self.expert_names(layer, e, proj, fmt)[TensorKind.BLOCK_SCALE]
                    if compact_e8m0(self.read(name).reshape(self.tensors[name].shape)) is None:
                        compact = False
                        break
                if not compact:
                    break
            forms.append(E8M0_32 if compact else E4M3_16)
        return forms[0], forms[1]

    def has_input_scales(self, layer: int, fmt: ExpertFormat | None = None) -> bool:
        names = self.expert_names(layer, 0, PROJECTIONS[0], fmt or self.layer_format(layer))
        return TensorKind.INPUT_SCALE in names and names[TensorKind.INPUT_SCALE] in self.tensors

    def expert_tensor_names(self, layers: list[int]) -> set[str]:
        out: set[str] = set()
        for layer in layers:
            for e in range(self.model.n_routed_experts):
                for proj in PROJECTIONS:
                    out.update(n for n in self.expert_names(layer, e, proj).values() if n in self.tensors)
        return out

    def validate_experts(self, layers: list[int]) -> None:
        """Every routed expert tensor of these layers exists with the dtype and shape its format needs,
        and a layer's experts share one format."""
        m = self.model
        H, I = m.hidden_size, m.moe_intermediate_size
        for layer in layers:
            fmt = self.layer_format(layer)
            for e in range(m.n_routed_experts):
                for proj in PROJECTIONS:
                    out_dim, in_dim = (H, I) if proj == "down_proj" else (I, H)
                    f = self.expert_format(layer, e, proj)
                    if f is not fmt:
                        raise InputError(f"layer {layer} mixes expert formats ({fmt.name} and {f.name} at expert {e} "
                                         f"{proj})", "moet-cache needs one format for a layer's routed experts")
                    names = f.names(self.family.expert_prefix(layer, e, proj))
                    self._expect(names[TensorKind.CODES], f.code_dtypes, (out_dim, in_dim // 2), layer, e)
                    self._expect(names[TensorKind.BLOCK_SCALE], (f.scale_dtype,), (out_dim, in_dim // f.group),
                                 layer, e)
                    if TensorKind.GLOBAL_SCALE in names:
                        self._expect(names[TensorKind.GLOBAL_SCALE], ("F32",), None, layer, e)
                    if TensorKind.INPUT_SCALE in names and names[TensorKind.INPUT_SCALE] in self.tensors:
                        self._expect(names[TensorKind.INPUT_SCALE], ("F32",), None, layer, e)

    def _expect(self, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None,
                layer: int, expert: int) -> None:
        info = self.tensors.get(name)
        where = f"(layer {layer}, expert {expert})"
        if info is None:
            raise InputError(f"the checkpoint lacks {name} {where}",
                             "the checkpoint is incomplete or not a DeepSeek-style FP4 MoE")
        if info.dtype not in dtypes:
            raise InputError(f"{name} {where} has dtype {info.dtype}, expected {' or '.join(dtypes)}")
        got = storage_shape(info.dtype, info.shape) if info.dtype == "F4" else info.shape
        if shape is None:
            if int(np.prod(got, dtype=np.int64)) != 1:
                raise InputError(f"{name} {where} should hold one scalar, has shape {list(got)}")
        elif tuple(got) != shape:
            raise InputError(f"{name} {where} has shape {list(got)}, expected {list(shape)}",
                             "check hidden_size and moe_intermediate_size in config.json")


class SourceReader:
    """The build's view of a checkpoint's bytes (kept for its callers; the Checkpoint itself reads)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt

    def read_into(self, name: str, out: np.ndarray, start: int = 0) -> None:
        self.ckpt.read_into(name, out, start)

    def read(self, name: str, pooled: bool = False) -> np.ndarray:
        return self.ckpt.read(name, pooled)

    def release(self, buf: np.ndarray) -> None:
        self.ckpt.release(buf)

    def read_expert(self, layer: int, expert: int, proj: str, fmt: ExpertFormat | None = None) -> RawExpert:
        return self.ckpt.read_raw_expert(layer, expert, proj, fmt)

    def close(self) -> None:
        self.ckpt.close()


def tensor_bytes(t: Any) -> np.ndarray:
    """A torch tensor's raw bytes as a uint8 numpy array (no copy where the tensor is contiguous)."""
    import torch
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


def link_root(root: Path) -> Path:
    """The folder the source's links may lead into (resolved): a Hugging Face hub snapshot's repo folder
    (`models--org--name/`, whose `snapshots/<rev>/` files are links into its `blobs/`), else the source
    folder itself."""
    try:
        real = root.resolve()
    except (OSError, RuntimeError):  # a link loop
        raise InputError(f"{root} cannot be resolved: a link loop", "give the checkpoint folder itself") from None
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


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


def _check_quantized_linears(tensors: dict[str, TensorInfo], family: Family) -> None:
    """Every NVFP4 linear the build copies (shared experts, dense MLPs: it has a per-tensor scale) holds packed
    codes (routed experts: validate_experts); any other tensor of a carried dtype (F8_E8M0 scales, I32
    tid2eid, BF16, ...) is copied unchanged."""
    for name in tensors:
        if family.parse_expert(name) is not None:
            continue
        for fmt in (MODELOPT_NVFP4, CT_NVFP4):
            if fmt.global_scale and name.endswith("." + fmt.global_scale):
                codes = tensors.get(name[: -len(fmt.global_scale)] + fmt.codes)
                if codes is not None and codes.dtype not in fmt.code_dtypes:
                    raise UnsupportedCheckpointError(
                        f"{codes.name} in {codes.shard} has dtype {codes.dtype}, but an NVFP4 linear's codes are "
                        f"{' or '.join(fmt.code_dtypes)}", "the checkpoint is damaged or not NVFP4 as it claims")


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a checkpoint folder: config.json, the index or model.safetensors, every shard's header."""
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"{root} is not a folder", "give the checkpoint folder that holds config.json")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise InputError(f"{root} has no config.json", "give a Hugging Face style checkpoint folder")
    config = read_json_file(cfg_path, follow=True)
    model = ModelConfig.from_dict(config)
    index = None
    if (root / INDEX_NAME).is_file():
        index = read_json_file(root / INDEX_NAME, follow=True)
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
    offsets: dict[str, Entry] = {}
    metadata: dict[str, dict[str, str] | None] = {}
    head_raw: dict[str, bytes] = {}
    for shard in shard_names:
        _require_plain_file(root / shard)  # a FIFO would block safe_open forever
        try:
            head = read_header(root / shard, shard)
        except UnsupportedCheckpointError:
            raise
        except InputError as e:
            raise InputError(f"{shard} is not a readable safetensors file: {e.message}",
                             "the shard may be truncated or corrupt; copy it again") from None
        metadata[shard] = head.metadata
        head_raw[shard] = head.raw
        for name, ent in head.tensors.items():
            if name in tensors:
                raise InputError(f"{name} is in two shards, {tensors[name].shard} and {shard}",
                                 "a tensor must be in exactly one shard; remove the duplicate")
            tensors[name] = TensorInfo(name, shard, ent.dtype, ent.shape)
            offsets[name] = ent
    if shard_of is not None:
        for name, shard in shard_of.items():
            if name not in tensors or tensors[name].shard != shard:
                raise InputError(f"{INDEX_NAME} puts {name} in {shard}, but that shard does not hold it",
                                 "regenerate the index or copy the right shard")
    layout = detect_layout(config, root, set(tensors))
    family = detect_family(config, model, tensors)
    _check_quantized_linears(tensors, family)
    return Checkpoint(root, config, model, layout, tensors, index, metadata, family, offsets, head_raw)
