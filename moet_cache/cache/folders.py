"""What a folder the user named as a cache holds, so that a wrong folder is named as what it is.

`verify`, `inspect`, `plan` and `serve` all start with the boot check; a folder that holds no cache at all
(a typo, a file, a source checkpoint, an unrelated folder) is bad input, not "a cache whose build did not
finish". This module only looks at names in the folder (no file is read) and imports nothing above the seams.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import layout as L
from ..enums import StrEnum
from ..errors import InputError
from .manifest import CACHE_MANIFEST, COMMIT_RECORD

#: Names only a build writes into a cache folder (its lock, its manifests, the folders it fills).
CACHE_TRACES = (".lock", COMMIT_RECORD, CACHE_MANIFEST, *L.WRITTEN_DIRS)
#: The files that make a folder a Hugging Face style checkpoint (config.json and safetensors shards).
CHECKPOINT_CONFIG = "config.json"


class FolderKind(StrEnum):
    """What a path named as a cache turned out to be."""

    MISSING = "missing"          # nothing at that path
    NOT_A_FOLDER = "file"        # a file (or another non-folder)
    EMPTY = "empty"              # an empty folder: a build killed before its first write leaves this
    CHECKPOINT = "checkpoint"    # a source checkpoint: config.json and safetensors, no cache traces
    CACHE = "cache"              # a build wrote here (committed or not)
    OTHER = "other"              # a folder with files, none of them a cache's or a checkpoint's


def folder_kind(path: str | os.PathLike[str]) -> FolderKind:
    """Classify `path` by the names it holds; links to folders are followed as the commands follow them."""
    p = Path(path)
    if not os.path.lexists(p):
        return FolderKind.MISSING
    if not p.is_dir():
        return FolderKind.NOT_A_FOLDER
    names = set(os.listdir(p))
    if not names:
        return FolderKind.EMPTY
    if names.intersection(CACHE_TRACES):
        return FolderKind.CACHE
    if CHECKPOINT_CONFIG in names and any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json")
                                          for n in names):
        return FolderKind.CHECKPOINT
    return FolderKind.OTHER


def not_a_cache_error(path: str | os.PathLike[str], kind: FolderKind) -> InputError | None:
    """The one-line error for a path that holds no cache at all (exit 2), or None for a cache folder and an
    empty one (an empty folder is what a build killed at once leaves: the boot check calls it incomplete)."""
    p = str(path)
    if kind == FolderKind.MISSING:
        return InputError(f"{p}: no such folder", "check the path; `moet-cache build SRC CACHE` creates a cache")
    if kind == FolderKind.NOT_A_FOLDER:
        return InputError(f"{p} is a file, not a cache folder", "give the folder `moet-cache build` wrote")
    if kind == FolderKind.CHECKPOINT:
        return InputError(f"{p} is a checkpoint, not a cache",
                          f"build a cache from it first: moet-cache build {p} CACHE")
    if kind == FolderKind.OTHER:
        return InputError(f"{p} holds no cache (no {COMMIT_RECORD}, {CACHE_MANIFEST} or build folders) "
                          "and is not a checkpoint", "give the folder `moet-cache build` wrote")
    return None


def require_cache_folder(path: str | os.PathLike[str]) -> FolderKind:
    """Raise the InputError that names what `path` is when it holds no cache; else its kind (CACHE or EMPTY)."""
    kind = folder_kind(path)
    err = not_a_cache_error(path, kind)
    if err is not None:
        raise err
    return kind


EMPTY_DETAIL = "the folder is empty: nothing has been built here"
