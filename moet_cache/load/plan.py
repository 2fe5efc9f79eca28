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

from .. import layout as L
from ..enums import DeltaMode
from ..errors import VerificationError
from ..fsutil import FileId, file_id, resolve_inside
from ..manifest import FileEntry, LayerManifest, TensorEntry
from ..stheader import Header, read_header


@dataclass(frozen=True)
class Read:
    """One tensor's byte range in one cache file, and what it must be."""

    name: str
    path: str
    begin: int
    end: int
    dtype: str
    shape: tuple[int, ...]
    xxh3: str | None                 # None: the file has no per-tensor digest (the tier pack)
    layer: int | None                # the served layer it belongs to; None: a dense tensor

    @classmethod
    def of(cls, t: TensorEntry, layer: int | None) -> Read:
        return cls(t.name, t.file, t.begin, t.end, t.dtype, t.shape, t.xxh3, layer)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

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
              mid: tuple[int, ...] = ()) -> Job:
    """Layer lm's reads for delta mode `delta`; `experts`: the tier's experts of this layer (the delta
    index's); `mid`: its mid-tier experts, read with delta "tier" only (with "all" every expert is FP4, with
    "none" none needs more than its base); `pack`: the tier pack's header (needed only when delta is "tier"
    and experts or mid is not empty)."""
    roles = {f.path: f.role for f in lm.files}
    reads = [Read.of(t, lm.layer) for t in lm.tensors if roles[t.file] == L.Role.BASE]
    geo = lm.geometry()
    have = {r.name: (r.dtype, r.shape) for r in reads}
    for name, (dtype, shape) in geo.required_shapes().items():
        if have.get(name) != (dtype, shape):
            got = have.get(name)
            raise VerificationError(f"layer {lm.layer}: tensor {name} is {got[0] + ' ' + str(list(got[1])) if got else 'missing'}, "
                                    f"the layer needs {dtype} {list(shape)}", "run moet-cache build again")
    uses_pack = False
    if delta == DeltaMode.ALL:
        reads += [Read.of(t, lm.layer) for t in lm.tensors
                  if roles[t.file] == L.Role.DELTA_ALL and t.name in (L.W13_DELTA, L.W2_DELTA)]
        if sum(r.name in (L.W13_DELTA, L.W2_DELTA) for r in reads) != 2:
            raise VerificationError(f"layer {lm.layer} lists no delta planes", "run moet-cache build again")
    elif delta == DeltaMode.TIER:
        if experts:
            for spec in geo.delta_specs(len(experts)):
                name = L.pack_tensor(lm.layer, spec.name)
                got = pack.tensors.get(name) if pack is not None else None
                if got is None or got.dtype != "U8" or got.shape != spec.shape:
                    raise VerificationError(f"{L.PACK}: tensor {name} is missing or has the wrong shape "
                                            f"(the index names {len(experts)} experts)", "run moet-cache build again")
                reads.append(Read(spec.name, L.PACK, got.begin, got.end, "U8", spec.shape, None, lm.layer))
                uses_pack = True
        if mid:
            for spec in geo.mid_specs(len(mid)):
                name = L.pack_tensor(lm.layer, spec.name)
                got = pack.tensors.get(name) if pack is not None else None
                if got is None or got.dtype != spec.dtype or got.shape != spec.shape:
                    raise VerificationError(f"{L.PACK}: tensor {name} is missing or has the wrong shape "
                                            f"(the index names {len(mid)} mid-tier experts)", "run moet-cache build again")
                reads.append(Read(spec.name, L.PACK, got.begin, got.end, spec.dtype, spec.shape, None, lm.layer))
                uses_pack = True
    return Job(tuple(reads), lm.layer, uses_pack)


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
