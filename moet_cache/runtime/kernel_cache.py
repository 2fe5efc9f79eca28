"""The plane kernels' compiled images kept on disk, so that a start loads them instead of compiling them.

torch 2.13 and up (vLLM 0.34 pins 2.14) have NVRTC compile to a cubin, which the driver's JIT cache does
not keep, so every process start compiled a layer form's kernels again: 3.5 s at load for an x4 layer's
14 kernels on 16 cores in threads (warm_up.py), 3.9 s on 4 (the device machine's torch 2.11, its JIT
cache off). Loaded from their kept images: 0.02 s (docs/RUNTIME.md, session 22). Each image is a file
named by the digest of everything that decides its bytes: the source, the instantiation, the
architecture, the options and the toolchain (torch's and NVRTC's versions). The file carries the digest
of the image, so an image that does not match it (a torn or corrupted file) is compiled again and
replaced, never loaded.

The digest is an integrity check, not a signature: an image is code the GPU runs. So a folder or an image
file that another user owns, or that its group or everyone may write, is refused as ssh refuses such a
key file: its images are neither loaded nor kept, the kernels are compiled, and one line says why.

The folder: $MOET_CACHE_KERNEL_IMAGES, else $XDG_CACHE_HOME/moet-cache/kernels, else
~/.cache/moet-cache/kernels; MOET_CACHE_KERNEL_IMAGES=off keeps nothing. It can be deleted at any time;
where it cannot be read or written, the kernels are compiled as before: slower to start, never wrong.
The one variable the library reads itself: the runtime runs inside vLLM's process, where no CLI hands it
options (as Triton reads TRITON_CACHE_DIR).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import MoetError
from ..fsutil import atomic_write_bytes, read_all
from ..hashing import xxh3_hex

_log = logging.getLogger(__name__)

ENV = "MOET_CACHE_KERNEL_IMAGES"
_MAGIC = b"moet-cache kernel image 1\n"
_MAX_FILE = 64 << 20  # an image is a few hundred KB


@dataclass(frozen=True)
class Image:
    """A compiled kernel file (a cubin, or PTX from an older torch) and its kernel's mangled name."""

    mangled: str
    data: bytes


def folder(env: Mapping[str, str] = os.environ) -> Path | None:
    """Where images are kept, or None (MOET_CACHE_KERNEL_IMAGES empty or off)."""
    if ENV in env:
        value = env[ENV].strip()
        return None if value.lower() in ("", "0", "off", "none") else Path(value)
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moet-cache" / "kernels"


def image_path(where: Path, source: str, name: str, arch: str, options: tuple[str, ...],
               toolchain: str) -> Path:
    """The file of one image: every input of the compile in its name's digest."""
    key = json.dumps([source, name, arch, list(options), toolchain])
    return where / f"{xxh3_hex(key.encode())}.kernel"


def read_image(path: Path) -> Image | None:
    """The image in `path`, or None: missing, unreadable, or not what was written (its digest)."""
    try:
        raw = read_all(path, limit=_MAX_FILE)
    except (OSError, MoetError):  # missing, not a plain file, unreadable, over the limit
        return None
    if not raw.startswith(_MAGIC):
        return None
    head, sep, data = raw[len(_MAGIC):].partition(b"\n")
    if not sep:
        return None
    try:
        meta = json.loads(head)
        mangled, size, digest = meta["mangled"], meta["bytes"], meta["xxh3_128"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(mangled, str) or size != len(data) or digest != xxh3_hex(data):
        return None
    return Image(mangled, data)


def write_image(path: Path, image: Image) -> bool:
    """Keep `image` at `path` (atomically: a reader finds the old file, the new one or none); False where
    the folder cannot be written."""
    meta = json.dumps({"mangled": image.mangled, "bytes": len(image.data), "xxh3_128": xxh3_hex(image.data)})
    try:
        atomic_write_bytes(path, _MAGIC + meta.encode() + b"\n" + image.data)
    except (OSError, MoetError):  # not writable, or full (DiskFullError)
        return False
    return True


def not_ours_alone(st: os.stat_result) -> str | None:
    """Why a folder or file of this stat could hold another user's bytes, or None: owned by another
    user, or writable by its group or by everyone."""
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):03o})"
    return None


def folder_problem(where: Path) -> str | None:
    """Why images in `where` must not be used, or None; creates it (mode 0700) where it is missing. The
    folder the path names now, links followed: the one the images would be read from."""
    try:
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.stat(where)
    except OSError as e:
        return f"cannot be created or read ({e.strerror or e})"
    return not_ours_alone(st) if stat.S_ISDIR(st.st_mode) else "is not a folder"


def file_problem(path: Path) -> str | None:
    """Why the image file at `path` must be neither loaded nor replaced, or None (also where there is
    none). In a folder that passed folder_problem only this user (or root) can change it after the check."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return not_ours_alone(st)


@lru_cache(maxsize=None)
def _say_once(where: str, problem: str) -> None:
    _log.warning("moet-cache: kernel images in %s not used: it %s; the kernels are compiled at every start "
                 "(make it yours alone with chown and chmod go-w, or point %s at a folder of your own)",
                 where, problem, ENV)


def cached_image(source: str, name: str, arch: str, options: tuple[str, ...], toolchain: str,
                 compile_image: Callable[[], Image], where: Path | None) -> Image:
    """The image from `where` if it holds a sound one for these inputs, else compile_image()'s, then kept.
    A folder or file that is not this user's alone is not used (`folder_problem`, `file_problem`): the
    image is compiled, and another user's file is left where it is."""
    if where is None:
        return compile_image()
    path = image_path(where, source, name, arch, options, toolchain)
    problem = folder_problem(where)
    if problem is None:
        problem = file_problem(path)
        if problem is not None:
            problem = f"holds {path.name}, which {problem}"
    if problem is not None:
        _say_once(str(where), problem)
        return compile_image()
    if (image := read_image(path)) is not None:
        return image
    image = compile_image()
    write_image(path, image)
    return image


@lru_cache(maxsize=1)
def toolchain() -> str:
    """torch's version and CUDA, and the NVRTC library's own version: what else decides an image's bytes."""
    import torch

    version = "unknown"
    try:
        from torch.cuda._utils import _get_gpu_rtc_library

        major, minor = ctypes.c_int(), ctypes.c_int()
        if _get_gpu_rtc_library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0:
            version = f"{major.value}.{minor.value}"
    except (ImportError, AttributeError, OSError, RuntimeError):  # no NVRTC here: the name says unknown
        pass
    return f"torch {torch.__version__} cuda {torch.version.cuda} nvrtc {version}"


def load_kernel(source: str, name: str, arch: str, options: tuple[str, ...]) -> Any:
    """The kernel `name` (an instantiation of `source`) for compute capability `arch` ("90"), loaded into the
    current device's context from its kept image, or compiled by NVRTC (through torch) and kept. A torch
    without its compile and load helpers takes torch.cuda._compile_kernel, with nothing kept."""
    import torch

    try:
        from torch.cuda._utils import _cuda_load_module, _nvrtc_compile
    except ImportError:
        return torch.cuda._compile_kernel(source, name, compute_capability=arch, nvcc_options=list(options))

    def compile_image() -> Image:
        # by keyword: an earlier torch has a header_code parameter where later ones take cuda_include_dirs
        data, mangled = _nvrtc_compile(source, name, compute_capability=arch, nvcc_options=list(options))
        return Image(mangled, bytes(data))

    image = cached_image(source, name, arch, options, toolchain(), compile_image, folder())
    return _cuda_load_module(image.data, [image.mangled])[image.mangled]
