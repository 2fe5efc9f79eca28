"""Everything of the cache that is a copy of the source, not planes: the model folder (aux files and the
served config.json), each shard's dense tensors (streamed through a ring of three reused buffers) and
the source map that lets export give the checkpoint back."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..cache import layout as L
from ..cancel import CancelToken
from ..source.checkpoint import INDEX_NAME, Checkpoint, SourceReader, link_root
from ..errors import InputError
from ..fsutil import read_all, refuse_links
from ..cache.manifest import FORMAT_VERSION, FileEntry, LayerManifest, PartManifest
from ..stwriter import SafetensorsWriter, TensorSpec
from ..cache.quant_block import SERVED_CONFIG, SOURCE_CONFIG, LayerForm, served_config_bytes
from ..window import bounded_window
from .parts import Counters, read_entry, reusable_part, write_bytes_entry, write_record_entry, \
    written_entries
from .plan import BuildPlan
from .tier import TIER_PART

AUX_MAX_BYTES = 64 << 20
AUX_MAX_FILES = 4096
AUX_MAX_DEPTH = 4


def aux_files(src: Path) -> list[tuple[str, Path]]:
    """(relative path, path) of the source's small non-weight files, folders included (V4's encoding/).

    Links to files are followed, but only inside the source (a Hugging Face hub snapshot's repo folder,
    `models--org--name/`, whose snapshot files link into its blobs: checkpoint.link_root). Hidden names,
    weights, linked folders and files over AUX_MAX_BYTES are not carried. A file a server would need and
    that cannot be carried is refused (exit 2), never left out: a dangling or looping link, a link out of
    the source, a FIFO, socket or device.
    """
    inside = link_root(src)
    out: list[tuple[str, Path]] = []

    def walk(d: Path, rel: str, depth: int) -> None:
        for p in sorted(d.iterdir()):
            if len(out) >= AUX_MAX_FILES or p.name.startswith(".") or p.name == INDEX_NAME \
                    or p.name.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf")):
                continue
            r = f"{rel}{p.name}"
            if p.is_symlink():
                try:
                    target = p.resolve(strict=True)
                except (OSError, RuntimeError):
                    raise InputError(f"{r} in the checkpoint is a link that leads nowhere (dangling or a loop)",
                                     "download the file again, or remove the link") from None
                if target != inside and inside not in target.parents:
                    raise InputError(f"{r} in the checkpoint is a link out of it (to {target})",
                                     f"copy the file into {src} instead of linking it")
            try:
                st = p.stat()
            except OSError as e:
                raise InputError(f"cannot read {r} in the checkpoint: {e.strerror}",
                                 "make it readable, or remove it") from None
            if stat.S_ISDIR(st.st_mode):
                if not p.is_symlink() and depth < AUX_MAX_DEPTH:
                    walk(p, r + "/", depth + 1)
            elif not stat.S_ISREG(st.st_mode):
                raise InputError(f"{r} in the checkpoint is not a plain file (a FIFO, socket or device)",
                                 "replace it by a plain file, or remove it")
            elif st.st_size <= AUX_MAX_BYTES:
                out.append((r, p))
    walk(src, "", 0)
    return out


def aux_dest(rel_src: str) -> str:
    """Where a source file lands in the cache: the model folder; the source's config.json as
    config.source.json (served_config writes the config.json vLLM reads)."""
    return f"{L.AUX_DIR}/{SOURCE_CONFIG if rel_src == SERVED_CONFIG else rel_src}"


def copy_aux(aux: list[tuple[str, Path]], root: Path) -> list[FileEntry]:
    """The model folder from `aux_files`: config.json, hf_quant_config.json, generation_config.json, the
    tokenizer files and folders such as V4's encoding/, so a server needs nothing from the source. Each
    keeps its source file's permissions (a 0600 file stays 0600). Links in the cache are never followed."""
    out = []
    for rel_src, p in aux:
        try:
            data = read_all(p, AUX_MAX_BYTES, follow=True)
            mode = stat.S_IMODE(os.stat(p).st_mode) & 0o777
        except (OSError, InputError) as e:
            why = e.strerror if isinstance(e, OSError) else e.message
            raise InputError(f"cannot read {rel_src} in the checkpoint: {why}",
                             "make it a readable plain file (of at most 64 MiB), or remove it") from None
        rel = aux_dest(rel_src)
        refuse_links(root, tuple(str(Path(rel).parents[i]) for i in range(len(Path(rel).parts) - 1)))
        role = L.Role.SOURCE_CONFIG if rel_src == SERVED_CONFIG else L.Role.AUX
        out.append(write_bytes_entry(root, rel, data, role, mode))
    if not any(f.role == L.Role.SOURCE_CONFIG for f in out):
        raise InputError("cannot copy config.json of the checkpoint into the cache's model folder",
                         "config.json must be a readable file (or a link to one) of at most 64 MiB")
    return out


def planned_paths(plan: BuildPlan, aux: list[tuple[str, Path]]) -> list[str]:
    """Every path in the cache's folders this build writes (for build/written.py's record)."""
    paths = [aux_dest(rel) for rel, _ in aux] + [f"{L.AUX_DIR}/{SERVED_CONFIG}", L.PACK, L.DELTA_INDEX, TIER_PART]
    for shard in plan.dense_by_shard:
        paths += [L.dense_file(shard), L.dense_record(shard)]
    for layer in plan.served:
        paths += [L.base_file(layer), L.layer_manifest(layer)] + ([L.delta_file(layer)] if plan.opts.lossless else [])
    return paths


def served_config(root: Path, files: list[FileEntry], layers: dict[int, LayerManifest]) -> list[FileEntry]:
    """model/config.json: what vLLM reads, the source's config.json with `quant_method: moet` and the
    source's block inside (quant_block.py); the source's own bytes stay in model/config.source.json."""
    entry = next((f for f in files if f.role == L.Role.SOURCE_CONFIG), None)
    if entry is None:
        return files
    forms = {layer: LayerForm(lm.scale_form(L.W13_SCALE), lm.scale_form(L.W2_SCALE),
                              any(t.name == L.W13_INPUT_SCALE for t in lm.tensors))
             for layer, lm in layers.items()}
    source = root / entry.path
    served = served_config_bytes(source.read_bytes(), forms)
    mode = stat.S_IMODE(source.stat().st_mode)  # the source config.json's permissions, as every model file
    return [*files, write_bytes_entry(root, f"{L.AUX_DIR}/{SERVED_CONFIG}", served, L.Role.AUX, mode)]


def source_map(ck: Checkpoint, root: Path, omitted: set[str]) -> FileEntry:
    """source-map.json: every carried tensor's shard, dtype and shape, and each shard's metadata."""
    shards = []
    for shard in ck.shards:
        names = sorted(n for n, t in ck.tensors.items() if t.shard == shard and n not in omitted)
        shards.append({"name": shard, "metadata": ck.shard_metadata.get(shard),
                       "tensors": [[n, ck.tensors[n].dtype, list(ck.tensors[n].shape)] for n in names]})
    doc = {"format": "moet-cache-source-map", "format_version": FORMAT_VERSION, "layout": ck.layout,
           "complete": not omitted, "index_metadata": (ck.index or {}).get("metadata"), "shards": shards}
    return write_bytes_entry(root, L.SOURCE_MAP, (json.dumps(doc, indent=None) + "\n").encode(), L.Role.SOURCE_MAP)


def copy_dense(plan: BuildPlan, root: Path, reader: SourceReader, counters: Counters, shard: str) -> list[FileEntry]:
    """Copy one shard's dense tensors (on the dense thread); returns the file's and its part record's
    entries. A part a killed build finished for the same key is kept."""
    ck, names = plan.ckpt, plan.dense_by_shard[shard]
    rel, rec = L.dense_file(shard), L.dense_record(shard)
    key = plan.dense_key(shard)
    part = reusable_part(root, rec, key)
    if part is not None:
        counters.advance(sum(plan.nbytes(n) for n in names), read=False)
        return [part.files[0], read_entry(root, rec, L.Role.PART)]
    specs = [TensorSpec(n, ck.tensors[n].dtype, ck.tensors[n].shape) for n in names]
    with SafetensorsWriter(root / rel, specs, ck.shard_metadata.get(shard)) as w:
        for n, chunk in chunks(plan, reader, names, plan.opts.tuning.dense_chunk_bytes, counters.cancel):
            w.write(n, chunk)
            counters.advance(chunk.nbytes)
        written = w.commit()
    fe, tensors = written_entries(rel, written, L.Role.DENSE)
    part = PartManifest(key, (fe,), tuple(tensors), ck.shard_metadata.get(shard))
    return [fe, write_record_entry(root, rec, part, L.Role.PART)]  # the record after its file


#: Buffers of the dense copy's ring: one being written while the next two are read.
RING = 3


def chunks(plan: BuildPlan, reader: SourceReader, names: list[str], chunk_bytes: int,
           cancel: CancelToken | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(name, bytes) chunks of these tensors in order; the next two are read on a thread while one is written.

    RING reused buffers: a yielded chunk is valid until the next one is asked for.
    """
    items = []
    for n in names:
        size = plan.nbytes(n)
        items += [(n, start, min(chunk_bytes, size - start)) for start in range(0, size, chunk_bytes)]
    bufs = [np.empty(min(chunk_bytes, max((k for _, _, k in items), default=1)), dtype=np.uint8)
            for _ in range(RING)]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="moet-read") as rd:
        def read_chunk(n: str, out: np.ndarray, start: int) -> tuple[str, np.ndarray]:
            reader.read_into(n, out, start)
            return n, out

        def read(i: int) -> Future[tuple[str, np.ndarray]]:
            n, start, k = items[i]
            return rd.submit(read_chunk, n, bufs[i % RING][:k], start)
        yield from bounded_window(read, range(len(items)), RING, cancel)
