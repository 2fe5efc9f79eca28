"""The one safetensors header reader and the one dtype table (checkpoint, builder, loader, exporter, manifests).

A safetensors file is a little-endian u64 header length, a JSON header, then a flat byte buffer.
`read_header` checks everything a reader relies on before any byte is read: the length, the JSON
object, every entry's dtype (known), shape (non-negative integers), offsets (ordered integers whose
span is exactly dtype x shape) and that the data lies inside the file. The error class is the
caller's: a bad source shard is an InputError (exit 2), a bad cache file a VerificationError (exit 1).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InputError, MoetError, UnsupportedCheckpointError

MAX_HEADER = 100 << 20  # the safetensors library's own limit


@dataclass(frozen=True)
class DType:
    """A safetensors dtype: its bytes an element and the torch dtype it maps to (by attribute name)."""

    name: str
    itemsize: int            # bytes an element; 0 for F4 (two elements a byte, see nbytes)
    torch_name: str


#: Every safetensors dtype moet-cache carries. F4 is the packed FP4 dtype whose header shape counts
#: elements (two a byte); F4_X2 is torch's float4_e2m1fn_x2 written by some exporters (one byte a pair).
DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("BOOL", 1, "bool"), DType("U8", 1, "uint8"), DType("I8", 1, "int8"),
    DType("F8_E4M3", 1, "float8_e4m3fn"), DType("F8_E5M2", 1, "float8_e5m2"),
    DType("F8_E8M0", 1, "float8_e8m0fnu"), DType("F4_X2", 1, "uint8"), DType("F4", 0, "uint8"),
    DType("I16", 2, "int16"), DType("U16", 2, "uint16"), DType("F16", 2, "float16"), DType("BF16", 2, "bfloat16"),
    DType("I32", 4, "int32"), DType("U32", 4, "uint32"), DType("F32", 4, "float32"),
    DType("I64", 8, "int64"), DType("U64", 8, "uint64"), DType("F64", 8, "float64"),
)}


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of this safetensors dtype and header shape (ValueError for an unknown dtype)."""
    d = DTYPES.get(dtype)
    if d is None:
        raise ValueError(f"unknown safetensors dtype {dtype}")
    n = math.prod(shape)  # exact ints (np.prod costs ~7 us a call; a build asks ~100k times)
    return (n + 1) // 2 if d.itemsize == 0 else d.itemsize * n


def storage_shape(dtype: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the stored bytes' elements: F4's header counts elements, its storage packed pairs."""
    if dtype == "F4":
        if not shape or shape[-1] % 2:
            raise ValueError(f"an F4 tensor needs an even last dimension, found {list(shape)}")
        return (*shape[:-1], shape[-1] // 2)
    return tuple(shape)


def torch_dtype(dtype: str) -> Any:
    """The torch dtype of a safetensors dtype's storage (torch imported here, on demand)."""
    import torch
    d = DTYPES.get(dtype)
    tdt = getattr(torch, d.torch_name, None) if d else None
    if tdt is None:
        raise InputError(f"this torch has no dtype for safetensors {dtype}")
    return tdt


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: dtype, header shape, absolute byte range in the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    size: int                          # the file's size in bytes
    data_start: int                    # 8 + header length
    tensors: dict[str, Entry]
    metadata: dict[str, str] | None
    raw: bytes                         # length prefix + JSON header, as in the file (for digests)


def parse_header_bytes(raw: bytes, size: int, where: str, error: type[MoetError] = InputError,
                       unsupported: type[MoetError] | None = UnsupportedCheckpointError) -> Header:
    """Check and parse `raw` (the 8-byte prefix and the JSON header) of a file of `size` bytes."""
    n = int.from_bytes(raw[:8], "little") if len(raw) >= 8 else -1
    if n < 2 or n > MAX_HEADER or 8 + n > size or len(raw) < 8 + n:
        raise error(f"{where}: not a valid safetensors file (header length {n}, file {size} bytes)",
                    "the file may be truncated or corrupt")
    try:
        doc = json.loads(raw[8:8 + n])
    except (ValueError, RecursionError):
        raise error(f"{where}: the safetensors header is not valid JSON", "the file may be corrupt") from None
    if not isinstance(doc, dict):
        raise error(f"{where}: the safetensors header is not a JSON object", "the file may be corrupt")
    meta = doc.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise error(f"{where}: the safetensors __metadata__ must map strings to strings")
    out: dict[str, Entry] = {}
    for name, spec in doc.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, offs = spec["dtype"], spec["shape"], spec["data_offsets"]
            if not (isinstance(dtype, str) and isinstance(shape, list) and len(shape) <= 16
                    and all(type(x) is int and x >= 0 for x in shape)
                    and isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs)
                    and 0 <= offs[0] <= offs[1]):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise error(f"{where}: tensor {str(name)[:200]} has a malformed header entry",
                        "the file may be corrupt") from None
        if dtype not in DTYPES:
            raise (unsupported or error)(
                f"{where}: {str(name)[:200]} has dtype {dtype[:40]}, which moet-cache cannot carry",
                f"supported dtypes: {', '.join(sorted(DTYPES))}")
        shape_t = tuple(shape)
        need = nbytes(dtype, shape_t)
        if offs[1] - offs[0] != need:
            raise error(f"{where}: tensor {str(name)[:200]} spans {offs[1] - offs[0]} bytes, its dtype {dtype} "
                        f"and shape {shape} need {need}", "the file may be corrupt")
        if 8 + n + offs[1] > size:
            raise error(f"{where}: tensor {str(name)[:200]} ends at byte {8 + n + offs[1]}, the file has {size}",
                        "the file is truncated")
        out[str(name)] = Entry(dtype, shape_t, 8 + n + offs[0], 8 + n + offs[1])
    return Header(size, 8 + n, out, meta, bytes(raw[:8 + n]))


def read_header(path: str | os.PathLike[str], where: str | None = None, error: type[MoetError] = InputError,
                unsupported: type[MoetError] | None = UnsupportedCheckpointError) -> Header:
    """Read and check the header of the safetensors file at `path` (follows links: a source may be a
    Hugging Face snapshot whose files are links into its blobs)."""
    where = where or Path(path).name
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise error(f"{where}: cannot open: {e.strerror}") from None
    try:
        return read_header_fd(fd, where, error, unsupported)
    finally:
        os.close(fd)


def read_header_fd(fd: int, where: str, error: type[MoetError] = InputError,
                   unsupported: type[MoetError] | None = UnsupportedCheckpointError) -> Header:
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    body = os.pread(fd, n, 8) if 0 <= n <= MAX_HEADER else b""
    return parse_header_bytes(head + body, size, where, error, unsupported)


__all__ = ["DTYPES", "DType", "Entry", "Header", "MAX_HEADER", "nbytes", "parse_header_bytes", "read_header",
           "read_header_fd", "storage_shape", "torch_dtype"]
