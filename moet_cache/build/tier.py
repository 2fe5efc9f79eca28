"""The delta tier: which experts keep their FP4 delta planes (tiering.choose_tier, within the budget),
written as one pack (delta/tier.safetensors), its index (delta/tier.json) and its part record. A build
takes the chosen planes from the source (split again: the same planes, bit for bit) or, with --lossless,
from the per-layer delta files; retier takes them from those files, without the source.

With a mid budget the build also chooses a mid tier among the other experts (by the squared error their mid
plane removes, the same policy) and writes their mid planes and 8-entry tables into the same pack, split
again from the source."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import numpy as np

from ..cache import layout as L
from ..cancel import CancelToken
from ..source.checkpoint import SourceReader
from ..errors import InputError, VerificationError
from ..fsutil import open_regular, pread_into, resolve_inside
from ..hashing import new_hasher
from ..cache.manifest import DeltaIndex, FileEntry, LayerManifest, PartManifest
from ..codec.planes import HostKernel, code_histogram, fit_mid_table, mid_plane, split_planes
from ..stwriter import SafetensorsWriter, TensorSpec
from ..cache.tiering import Candidate, RoutingProfile, choose_tier
from ..window import bounded_window
from .parts import key_of, read_entry, reusable_part, write_record_entry, written_entries
from .plan import BuildPlan

TIER_PART = "delta/tier.part.json"
TIER_ROLES = (L.Role.PACK, L.Role.DELTA_INDEX)

#: (layer, w13_delta or w2_delta, experts) -> the experts' planes of that tensor, in order, as byte chunks.
DeltaReader = Callable[[int, str, tuple[int, ...]], Iterable[np.ndarray]]
#: (layer, w13_mid or w2_mid, experts) -> per expert and projection in order: (its mid plane, its 8-entry table).
MidReader = Callable[[int, str, tuple[int, ...]], Iterable[tuple[np.ndarray, np.ndarray]]]


def tier_key(layer_digests: dict[int, str], budget: int, profile_digest: str | None, mid_budget: int = 0) -> str:
    """What the tier's bytes depend on: the layer manifests, the budgets and the profile."""
    return key_of({"layers": {str(k): v for k, v in sorted(layer_digests.items())}, "budget": budget,
                   "profile": profile_digest, **({"mid_budget": mid_budget} if mid_budget else {})})


def tier_candidates(layers: dict[int, LayerManifest], profile: RoutingProfile | None) -> list[Candidate]:
    out = []
    for layer, lm in sorted(layers.items()):
        weights = profile.weights(layer, lm.n_experts) if profile else (1.0,) * lm.n_experts
        out += [Candidate(layer, e, lm.expert_delta_bytes, lm.sq_error[e], weights[e]) for e in range(lm.n_experts)]
    return out


def mid_candidates(layers: dict[int, LayerManifest], profile: RoutingProfile | None,
                   chosen: dict[int, tuple[int, ...]]) -> list[Candidate]:
    """Every expert outside the 4-bit tier, valued by the squared error its mid plane removes (base-only error
    minus 3-bit error) times its routing weight, at the bytes of its mid planes and tables."""
    out = []
    for layer, lm in sorted(layers.items()):
        if len(lm.mid_sq_error) != lm.n_experts:
            raise InputError(f"layer {layer} was built without its 3-bit errors, so no mid tier can be chosen",
                             "build the cache again with --mid-budget (its layers are rebuilt)")
        weights = profile.weights(layer, lm.n_experts) if profile else (1.0,) * lm.n_experts
        nbytes, tier = lm.geometry().expert_mid_bytes, set(chosen.get(layer, ()))
        out += [Candidate(layer, e, nbytes, max(0.0, lm.sq_error[e] - lm.mid_sq_error[e]), weights[e])
                for e in range(lm.n_experts) if e not in tier]
    return out


def source_mids(reader: SourceReader, workers: int, cancel: CancelToken | None = None,
                kernel: HostKernel | None = None) -> MidReader:
    """A MidReader that splits the experts again from the source: each projection's mid plane (the delta's
    high bit) and its 8-entry table fitted to its codes, read and split on worker threads."""
    def mid(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return mid_plane(split_planes(codes, kernel=kernel)[1]), fit_mid_table(code_histogram(codes))
    return _split_again(reader, workers, cancel, L.W13_MID, "moet-mid", mid)


def file_deltas(root: Path, layers: dict[int, LayerManifest]) -> DeltaReader:
    """A DeltaReader over the layers' --lossless delta files, which hold every expert's planes.

    Each delta tensor is read whole, expert by expert through the read seam (pread, no map), and hashed:
    the chosen experts' planes go out as they come, and a tensor that does not match its digest in the
    layer manifest (or cannot be read) raises a VerificationError after its last expert, before the pack
    that got its planes is committed. So a tier never carries a plane the manifests do not vouch for.
    """
    def read(layer: int, which: str, experts: tuple[int, ...]) -> Iterator[np.ndarray]:
        lm = layers[layer]
        files = {f.path for f in lm.files if f.role == L.Role.DELTA_ALL}
        t = next((t for t in lm.tensors if t.name == which and t.file in files), None)
        n = lm.n_experts
        if t is None or t.dtype != "U8" or not t.shape or t.shape[0] != n or (t.end - t.begin) % n \
                or any(e >= n for e in experts):
            raise VerificationError(f"layer {layer}: the manifest lists no {which} of {n} experts in a delta file",
                                    "run moet-cache verify --full, then build the cache again")
        per, wanted, h = (t.end - t.begin) // n, set(experts), new_hasher()
        buf = memoryview(bytearray(per))
        try:
            fd = open_regular(resolve_inside(root, t.file))
        except OSError as e:
            raise _unreadable(t.file, e) from None
        try:
            for e in range(n):
                try:
                    got = pread_into(fd, buf, t.begin + e * per)
                except OSError as err:
                    raise _unreadable(t.file, err) from None
                if got != per:
                    raise VerificationError(f"{t.file}: the file ends inside {which}",
                                            "run moet-cache verify --full, then build the cache again")
                h.update(buf)
                if e in wanted:
                    yield np.frombuffer(buf, dtype=np.uint8).copy()
        finally:
            os.close(fd)
        if h.hexdigest() != t.xxh3:
            raise VerificationError(f"{t.file}: {which} (layer {layer}) does not match its xxh3-128 digest, so its "
                                    "planes are not copied into the tier", "the cache is corrupt: run moet-cache "
                                    "verify --full, then build it again (with --lossless)")
    return read


def _unreadable(path: str, err: OSError) -> VerificationError:
    return VerificationError(f"{path} cannot be read ({err.strerror or err}), so its planes are not copied "
                             "into the tier", "check the disk, then run moet-cache verify --full")


def source_deltas(reader: SourceReader, workers: int, cancel: CancelToken | None = None,
                  kernel: HostKernel | None = None) -> DeltaReader:
    """A DeltaReader that splits the experts' planes again from the source (the same planes, bit for bit),
    read and split on worker threads a few experts ahead of the pack's writer."""
    return _split_again(reader, workers, cancel, L.W13_DELTA, "moet-tier",
                        lambda codes: split_planes(codes, kernel=kernel)[1])


def _split_again(reader: SourceReader, workers: int, cancel: CancelToken | None, w13: str, thread_name: str,
                 of_codes: Callable[[np.ndarray], Any]) -> Callable[[int, str, tuple[int, ...]], Iterator[Any]]:
    """A reader of the given experts' projections (gate and up for `w13`, down otherwise), each read from the
    source and mapped by `of_codes` on worker threads, a few experts ahead of the consumer, in order."""
    def read(layer: int, which: str, experts: tuple[int, ...]) -> Iterator[Any]:
        projs = ("gate_proj", "up_proj") if which == w13 else ("down_proj",)

        def one(item: tuple[int, str]) -> Any:
            x = reader.read_expert(layer, *item)
            out = of_codes(x.codes)
            reader.release(x.codes)
            return out
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=thread_name) as pool:
            yield from bounded_window(lambda item: pool.submit(one, item),
                                      ((e, proj) for e in experts for proj in projs), 2 * workers + 1, cancel)
    return read


def write_delta_pack(root: Path, layers: dict[int, LayerManifest], chosen: dict[int, tuple[int, ...]],
                     deltas: DeltaReader, budget: int, weighted: bool,
                     cancel: CancelToken | None = None, mid: MidTier | None = None) -> tuple[FileEntry, FileEntry]:
    """Write delta/tier.safetensors (chosen experts' planes, layer by layer; then the mid tier's, when there
    is one) and its index."""
    specs = []
    for layer, experts in sorted(chosen.items()):
        if experts:
            specs += [TensorSpec(L.pack_tensor(layer, sp.name), sp.dtype, sp.shape)
                      for sp in layers[layer].geometry().delta_specs(len(experts))]
    for layer, experts in sorted(mid.chosen.items()) if mid else ():
        if experts:
            specs += [TensorSpec(L.pack_tensor(layer, sp.name), sp.dtype, sp.shape)
                      for sp in layers[layer].geometry().mid_specs(len(experts))]
    with SafetensorsWriter(root / L.PACK, specs) as w:
        for layer, experts in sorted(chosen.items()):
            if not experts:
                continue
            for which in (L.W13_DELTA, L.W2_DELTA):
                for chunk in deltas(layer, which, experts):
                    if cancel is not None:
                        cancel.check()
                    w.write(L.pack_tensor(layer, which), chunk)
        if mid is not None:
            _write_mids(w, mid, cancel)
        written = w.commit()
    pack_fe = written_entries(L.PACK, written, L.Role.PACK)[0]
    used = sum(layers[layer].expert_delta_bytes * len(ex) for layer, ex in chosen.items())
    mid_fields = () if mid is None else (
        mid.budget, sum(layers[layer].geometry().expert_mid_bytes * len(ex) for layer, ex in mid.chosen.items()),
        tuple(sorted(mid.chosen.items())))
    index = DeltaIndex(L.PACK, budget, used, weighted, tuple(sorted(chosen.items())), *mid_fields)
    index_fe = write_record_entry(root, L.DELTA_INDEX, index, L.Role.DELTA_INDEX)
    return pack_fe, index_fe


@dataclass(frozen=True)
class MidTier:
    """The mid tier to write: its budget, its experts per layer and where their planes and tables come from."""

    budget: int
    chosen: dict[int, tuple[int, ...]]
    read: MidReader


def _write_mids(w: SafetensorsWriter, mid: MidTier, cancel: CancelToken | None) -> None:
    """Each layer's mid planes (w13, then w2, as they are split), then its tables (gathered meanwhile)."""
    for layer, experts in sorted(mid.chosen.items()):
        if not experts:
            continue
        tables = {L.W13_MID: [], L.W2_MID: []}
        for which in (L.W13_MID, L.W2_MID):
            for plane, table in mid.read(layer, which, experts):
                if cancel is not None:
                    cancel.check()
                w.write(L.pack_tensor(layer, which), plane)
                tables[which].append(table)
        w.write(L.pack_tensor(layer, L.W13_MID_TABLE), np.stack(tables[L.W13_MID]).reshape(len(experts), 2, 8))
        w.write(L.pack_tensor(layer, L.W2_MID_TABLE), np.stack(tables[L.W2_MID]).reshape(len(experts), 8))


def write_tier(root: Path, layers: dict[int, LayerManifest], chosen: dict[int, tuple[int, ...]],
               deltas: DeltaReader, budget: int, profile: RoutingProfile | None, key: str,
               cancel: CancelToken | None = None, mid: MidTier | None = None) -> list[FileEntry]:
    """The pack, its index, then the part record naming both (a resumed build keeps a finished tier)."""
    pack_fe, index_fe = write_delta_pack(root, layers, chosen, deltas, budget, profile is not None, cancel, mid)
    part_fe = write_record_entry(root, TIER_PART, PartManifest(key, (pack_fe, index_fe), ()), L.Role.PART)
    return [pack_fe, index_fe, part_fe]


def build_tier(plan: BuildPlan, root: Path, reader: SourceReader, layers: dict[int, tuple[LayerManifest, FileEntry]],
               budget: int, profile: RoutingProfile | None, cancel: CancelToken | None = None,
               mid_budget: int = 0) -> list[FileEntry]:
    """The build's tier (and mid tier): kept when a killed build finished it for the same layers, budgets and
    profile."""
    layer_mans = {layer: lm for layer, (lm, _) in layers.items()}
    key = tier_key({layer: fe.xxh3 for layer, (_, fe) in layers.items()}, budget,
                   profile.digest if profile else None, mid_budget)
    part = reusable_part(root, TIER_PART, key)
    if part is not None:
        return [*part.files, read_entry(root, TIER_PART, L.Role.PART)]
    chosen = choose_tier(tier_candidates(layer_mans, profile), budget)
    deltas = file_deltas(root, layer_mans) if plan.opts.lossless \
        else source_deltas(reader, plan.opts.tuning.workers(), cancel, plan.opts.tuning.kernel())
    mid = MidTier(mid_budget, choose_tier(mid_candidates(layer_mans, profile, chosen), mid_budget),
                  source_mids(reader, plan.opts.tuning.workers(), cancel, plan.opts.tuning.kernel())) \
        if mid_budget else None
    return write_tier(root, layer_mans, chosen, deltas, budget, profile, key, cancel, mid)


__all__ = ["TIER_PART", "TIER_ROLES", "DeltaReader", "MidReader", "MidTier", "mid_candidates", "source_mids", "build_tier", "file_deltas",
           "source_deltas", "tier_candidates", "tier_key", "write_delta_pack", "write_tier"]
