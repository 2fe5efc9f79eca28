"""What a load reads: the checked manifests turned into jobs of byte ranges, before any tensor byte
is read. Pure: no thread, no device; the engine (engine.py) runs the jobs.

A job is one served layer (its base-plane tensors, and the delta planes the delta mode asks for) or a
group of dense tensors. Every range comes from a manifest and is checked against the layer's
geometry here, and against the file's size and dtype x shape when the engine opens the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..cache import layout as L
from ..enums import DeltaMode
from ..errors import InputError, VerificationError
from ..fsutil import FileId, file_id, resolve_inside
from ..cache.manifest import FileEntry, LayerManifest, TensorEntry
from ..stheader import DTYPES, Header, read_header
from ..stheader import nbytes as st_nbytes
from .shard import Run, Shard, share


@dataclass(frozen=True)
class Read:
    """One tensor's byte range in one cache file, and what it must be."""

    name: str
    path: str
    begin: int
    end: int
    dtype: str
    shape: tuple[int, ...]
    xxh3: str | None                 # None: no digest of these bytes (the tier pack's tensors, a shard's share)
    layer: int | None                # the served layer it belongs to; None: a dense tensor
    # a rank's share (shard.py): these byte runs of [begin, end), read one after another, make `shape`;
    # () reads the whole range
    runs: tuple[Run, ...] = ()

    @classmethod
    def of(cls, t: TensorEntry, layer: int | None) -> Read:
        return cls(t.name, t.file, t.begin, t.end, t.dtype, t.shape, t.xxh3, layer)

    @property
    def nbytes(self) -> int:
        """The bytes it reads: the whole range, or its runs'."""
        return sum(r.nbytes for r in self.runs) if self.runs else self.end - self.begin

    @property
    def where(self) -> str:
        """For messages: "layer 7" or "dense"."""
        return "dense" if self.layer is None else f"layer {self.layer}"


@dataclass(frozen=True)
class Job:
    """What one worker turns into one dict of tensors: a served layer, or a group of dense tensors."""

    reads: tuple[Read, ...]
    layer: int | None = None         # the served layer; None: dense tensors
    uses_pack: bool = False          # some reads come from the tier pack (one digest for the whole file)
    delta_experts: tuple[int, ...] = ()  # the (local) expert of each delta row read, in order

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reads)


#: A file as it was when the cache was opened: (size, mtime_ns, inode). Every write of the library replaces a
#: file by a rename, so a file rewritten since (a build or retier that committed meanwhile) has another inode.
def changed_since_opened(rel: str) -> VerificationError:
    """A load reads one commit or nothing: a file replaced since the cache was opened is refused, so the
    planes of a new tier never meet the old delta index (or the old layer manifests) the cache was opened with."""
    return VerificationError(f"{rel} changed since the cache was opened (replaced by a build or retier that "
                             "committed meanwhile, or edited), so this load would mix two versions of the cache",
                             "open the cache again")


def read_cache_header(path: Path, rel: str) -> Header:
    """A cache safetensors file's header: every tensor's dtype, shape and absolute byte range, strictly
    checked (stheader.read_header; a bad file is a VerificationError)."""
    return read_header(path, rel, VerificationError, VerificationError)


def read_pack_header(root: Path, fe: FileEntry, opened: Mapping[str, FileId] | None = None) -> Header:
    """The tier pack's header (read_cache_header), and its file size against cache.json's entry; with
    `opened` (the files as the cache was opened), a pack replaced since is refused before its header is used."""
    path = resolve_inside(root, fe.path)
    if opened is not None:
        try:
            now: FileId | None = file_id(os.lstat(path))
        except OSError:
            now = None
        if opened.get(fe.path) != now:
            raise changed_since_opened(fe.path)
    head = read_cache_header(path, fe.path)
    if head.size != fe.size:
        raise VerificationError(f"{fe.path} is {head.size} bytes, cache.json says {fe.size}",
                                "run moet-cache build again")
    return head


def layer_job(lm: LayerManifest, delta: DeltaMode, experts: tuple[int, ...], pack: Header | None,
              shard: Shard = Shard(), mid: tuple[int, ...] = ()) -> Job:
    """Layer lm's reads for delta mode `delta`; `experts`: the tier's experts of this layer (the delta
    index's); `pack`: the tier pack's header (needed only when delta is "tier" and experts or mid is not
    empty); `shard`: the rank's share of the experts (shard.py; by default all of every expert); `mid`: its
    mid-tier experts, read with delta "tier" only (with "all" every expert is FP4, with "none" none needs
    more than its base)."""
    if mid and delta == DeltaMode.TIER and not shard.whole:
        # the mid planes are not cut into a rank's share (shard.share) yet: refuse rather than load a wrong slice
        raise InputError(f"layer {lm.layer} has a mid tier, which a rank's share under tensor or expert "
                         "parallelism does not load yet",
                         "serve this cache on one GPU, or build it without --mid-budget")
    roles = {f.path: f.role for f in lm.files}
    tensors = [t for t in lm.tensors if roles[t.file] == L.Role.BASE]
    geo = lm.geometry()
    have = {t.name: (t.dtype, t.shape) for t in tensors}
    for name, (dtype, shape) in geo.required_shapes().items():
        if have.get(name) != (dtype, shape):
            got = have.get(name)
            raise VerificationError(f"layer {lm.layer}: tensor {name} is {got[0] + ' ' + str(list(got[1])) if got else 'missing'}, "
                                    f"the layer needs {dtype} {list(shape)}", "run moet-cache build again")
    ids = shard.expert_ids(lm.n_experts)
    width = shard.width(lm.intermediate_size)
    local = {e: k for k, e in enumerate(ids)}

    def part(r: Read, rows: tuple[int, ...]) -> Read:
        """r, or the rank's share of it (the rows `rows` of its first axis, the width's columns)."""
        if shard.whole:
            return r
        if DTYPES[r.dtype].itemsize == 0:  # packed F4 is never a plane file's dtype
            raise VerificationError(f"{r.path}: tensor {r.name} ({r.where}) is {r.dtype}, a plane file's are bytes",
                                    "the manifest is damaged; run moet-cache build again")
        if r.end - r.begin != st_nbytes(r.dtype, r.shape):
            raise VerificationError(f"{r.path}: tensor {r.name} ({r.where}) spans {r.end - r.begin} bytes, its "
                                    f"dtype {r.dtype} and shape {list(r.shape)} need {st_nbytes(r.dtype, r.shape)}",
                                    "the manifest is damaged; run moet-cache build again")
        shape, runs = share(r.name, r.shape, DTYPES[r.dtype].itemsize, rows, width, lm.intermediate_size)
        # a digest covers the whole tensor: a share's bytes are not checked against it (api.py refuses
        # verify="hash" for a shard)
        return Read(r.name, r.path, r.begin, r.end, r.dtype, shape, None, r.layer, runs)

    reads = [part(Read.of(t, lm.layer), ids) for t in tensors]
    uses_pack = False
    if delta == DeltaMode.ALL:
        reads += [part(Read.of(t, lm.layer), ids) for t in lm.tensors
                  if roles[t.file] == L.Role.DELTA_ALL and t.name in (L.W13_DELTA, L.W2_DELTA)]
        if sum(r.name in (L.W13_DELTA, L.W2_DELTA) for r in reads) != 2:
            raise VerificationError(f"layer {lm.layer} lists no delta planes", "run moet-cache build again")
        delta_experts = tuple(range(len(ids)))
    elif delta == DeltaMode.TIER:
        # the tier rows of the rank's experts, in its local order, renumbered to local ids
        rows = tuple(sorted((k for k, e in enumerate(experts) if e in local), key=lambda k: local[experts[k]]))
        delta_experts = tuple(local[experts[k]] for k in rows)
        if experts:
            for spec in geo.delta_specs(len(experts)):
                name = L.pack_tensor(lm.layer, spec.name)
                got = pack.tensors.get(name) if pack is not None else None
                if got is None or got.dtype != "U8" or got.shape != spec.shape:
                    raise VerificationError(f"{L.PACK}: tensor {name} is missing or has the wrong shape "
                                            f"(the index names {len(experts)} experts)", "run moet-cache build again")
                if rows:
                    reads.append(part(Read(spec.name, L.PACK, got.begin, got.end, "U8", spec.shape, None, lm.layer),
                                      rows))
                    uses_pack = True
        for spec in geo.mid_specs(len(mid)) if mid else ():
            name = L.pack_tensor(lm.layer, spec.name)
            got = pack.tensors.get(name) if pack is not None else None
            if got is None or got.dtype != spec.dtype or got.shape != spec.shape:
                raise VerificationError(f"{L.PACK}: tensor {name} is missing or has the wrong shape "
                                        f"(the index names {len(mid)} mid-tier experts)", "run moet-cache build again")
            reads.append(Read(spec.name, L.PACK, got.begin, got.end, spec.dtype, spec.shape, None, lm.layer))
            uses_pack = True
    else:
        delta_experts = ()
    return Job(tuple(reads), lm.layer, uses_pack, delta_experts)


def dense_jobs(entries: list[TensorEntry], job_bytes: int) -> list[Job]:
    """The dense tensors in order, small ones grouped: one job is ~job_bytes or one big tensor."""
    jobs: list[Job] = []
    group: list[Read] = []
    size = 0
    for t in entries:
        group.append(Read.of(t, None))
        size += t.end - t.begin
        if size >= job_bytes:
            jobs.append(Job(tuple(group)))
            group, size = [], 0
    if group:
        jobs.append(Job(tuple(group)))
    return jobs


__all__ = ["Read", "Job", "changed_since_opened", "read_cache_header", "read_pack_header", "layer_job", "dense_jobs"]
