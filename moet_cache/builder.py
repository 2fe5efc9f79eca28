"""Build a cache from an NVFP4 checkpoint: base planes per layer, dense copies, the delta tier, manifests.

Order of writes (each atomic): aux files, dense shards (+ part records), per layer the plane files
then its manifest, the delta pack and index, the source map, cache.json, and last COMMIT.json.
A killed build is rerun: finished parts whose files still match their records are kept.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from . import layout as L
from .commit import Committer, utc_now
from .checkpoint import (
    INDEX_NAME,
    PROJECTIONS,
    Checkpoint,
    RawExpert,
    SourceReader,
    open_checkpoint,
)
from .cacheview import (
    file_matches,
    open_uncommitted_view,
    open_view,
    read_committed_manifest,
    read_delta_index,
)
from .errors import InputError, VerificationError
from .formats import E4M3_16, LAYOUT_FORMAT, ExpertFormat, e4m3_shift, e8m0_to_e4m3, stored_scales
from .fsutil import (
    CacheLock,
    atomic_write_bytes,
    check_free_space,
    fsync_dir,
    read_all,
    read_json_file,
    refuse_links,
)
from .geometry import LayerGeometry, is_w13
from .hashing import xxh3_hex
from .machine import usable_cores
from .manifest import (
    CACHE_MANIFEST,
    COMMIT_RECORD,
    FORMAT_VERSION,
    BuildParams,
    CacheManifest,
    CacheModel,
    VERIFIED_STATE,
    DeltaIndex,
    FileEntry,
    LayerKind,
    LayerManifest,
    LayerRef,
    ManifestError,
    PartManifest,
    TensorEntry,
    load_record,
    write_record,
)
from .modelconfig import parse_layer_selection
from .planes import (
    KERNEL,
    code_histogram_torch,
    error_and_energy_torch,
    fit_table,
    split_and_measure_e4m3,
    split_planes,
    split_planes_torch,
)
from .progress import NullProgress, Progress
from .stheader import read_header
from .stwriter import SafetensorsWriter, TensorSpec, WrittenFile
from .tiering import (
    DEFAULT_DELTA_BUDGET,
    Candidate,
    RoutingProfile,
    check_profile,
    choose_tier,
    load_profile,
)
from .units import parse_budget
from .verifier import speed_sample
from .version import __version__
from .vllm_config import SERVED_CONFIG, SOURCE_CONFIG, LayerForm, served_config_bytes

AUX_MAX_BYTES = 64 << 20
AUX_MAX_FILES = 4096
AUX_MAX_DEPTH = 4


def aux_files(src: Path) -> list[tuple[str, Path]]:
    """(relative path, path) of the source's small non-weight files, folders included (V4's encoding/).

    Links to files are followed (hub snapshots); linked folders, hidden names, weights and files over
    AUX_MAX_BYTES are not carried.
    """
    out: list[tuple[str, Path]] = []

    def walk(d: Path, rel: str, depth: int) -> None:
        for p in sorted(d.iterdir()):
            if len(out) >= AUX_MAX_FILES or p.name.startswith(".") or p.name == INDEX_NAME \
                    or p.name.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf")):
                continue
            r = f"{rel}{p.name}"
            try:
                if p.is_dir():
                    if not p.is_symlink() and depth < AUX_MAX_DEPTH:
                        walk(p, r + "/", depth + 1)
                elif p.is_file() and p.stat().st_size <= AUX_MAX_BYTES:
                    out.append((r, p))
            except OSError:
                continue  # a dangling link or an unreadable entry: not carried
    walk(src, "", 0)
    return out
_T = TypeVar("_T")



@dataclass(frozen=True)
class BuildOptions:
    delta_budget: str = DEFAULT_DELTA_BUDGET
    profile: str | None = None
    lossless: bool = False
    layers: str | None = None
    include_mtp: bool = False
    wait: bool = False


@dataclass(frozen=True)
class BuildResult:
    cache: str
    already_complete: bool
    layers: tuple[int, ...]
    layers_built: tuple[int, ...]
    layers_reused: tuple[int, ...]
    source_bytes: int
    cache_bytes: int
    tier_experts: int
    tier_bytes: int         # the delta planes of the tier: what the budget counts (never above it)
    tier_file_bytes: int    # delta/tier.safetensors on disk: the planes plus the file's header
    budget_bytes: int
    seconds: float


def _key(obj: object) -> str:
    return xxh3_hex(json.dumps(obj, sort_keys=True).encode())


def _entries(path: str, written: WrittenFile, role: str) -> tuple[FileEntry, list[TensorEntry]]:
    fe = FileEntry(path, written.size, written.xxh3, role)
    tensors = [TensorEntry(t.name, path, t.dtype, t.shape, t.begin, t.end, t.xxh3) for t in written.tensors]
    return fe, tensors


def _write_json_entry(root: Path, rel: str, record: object, role: str) -> FileEntry:
    data = write_record(root / rel, record)
    return FileEntry(rel, len(data), xxh3_hex(data), role)


def multiply_convention(layout: str, scalar: np.ndarray) -> float:
    """Checkpoint.multiply_global_scale for a float32 numpy scalar (the same float, without torch)."""
    return LAYOUT_FORMAT[layout].multiply(scalar)


@dataclass(frozen=True)
class _Planes:
    """One projection of one expert, split and measured by a worker thread."""
    x: RawExpert
    base: np.ndarray
    delta: np.ndarray
    table: np.ndarray
    error: float   # before the global scale
    energy: float


def _read_expert(reader: SourceReader, layer: int, expert: int, fmt: ExpertFormat) -> list[RawExpert]:
    """One expert's three projections, read from the source (on a read thread)."""
    return [reader.read_expert(layer, expert, p, fmt) for p in PROJECTIONS]


def measure_scales(x: RawExpert) -> tuple[np.ndarray, float]:
    """e4m3 block-scale bytes per 16 to measure this projection's error with, and the factor on the
    squared error and energy: MXFP4's e8m0 scales (per 32) become e4m3 of 2^(k - shift), error x 4^shift."""
    if x.fmt.scale_form == E4M3_16:
        return x.scale_bytes, 1.0
    shift = e4m3_shift(x.scale_bytes)
    return e8m0_to_e4m3(x.scale_bytes, shift), float(4.0 ** shift)


def _plane_work(read: Future[list[RawExpert]], device: str | None = None) -> list[_Planes]:
    """Split and measure one expert's three projections once they are read (on a plane worker)."""
    out = []
    for x in read.result():
        scale_bytes, factor = measure_scales(x)
        if device is None or (device != "cpu" and x.codes.nbytes < _DEVICE_MIN_BYTES):
            base, delta, table, er, eg = split_and_measure_e4m3(x.codes, scale_bytes)
        else:  # the same maths in torch on the device; the planes and table are bit-identical
            codes = torch.from_numpy(x.codes).to(device)
            tbase, tdelta = split_planes_torch(codes)
            table = fit_table(code_histogram_torch(codes))
            scales = torch.from_numpy(scale_bytes).view(torch.float8_e4m3fn).to(device).to(torch.float32)
            er, eg = error_and_energy_torch(codes, scales, table)
            base, delta = tbase.cpu().numpy(), tdelta.cpu().numpy()
        out.append(_Planes(x, base, delta, table, er * factor, eg * factor))
    return out


def _check_source_finite(layer: int, e: int, proj: str, g: float, error: float, energy: float,
                         input_scale: float | None) -> None:
    """A NaN or infinite scale is the source's problem: say so (it used to surface as a damaged manifest)."""
    bad = "global scale" if not math.isfinite(g) else \
        "input scale" if input_scale is not None and not math.isfinite(input_scale) else \
        "block scales" if not (math.isfinite(error) and math.isfinite(energy)) else None
    if bad is not None:
        raise InputError(f"the source checkpoint's {bad} of layer {layer} expert {e} {proj} is NaN or infinite",
                         "the source checkpoint is damaged; copy it again or fix its scales")


def _plane_device() -> str | None:
    """Where the split runs: None for the host kernels (C, or numpy), else a torch device.

    By default the host's C kernels where they are built, else the GPU when one is present: on the
    H200 machine (4 GiB, 16 cores) a build took 5.4 s with the C kernels on 8 threads and 10.0 s with
    the GPU split, whose per-tensor copies and syncs cost more than the kernel saves (benchmarks/NOTES.md).
    MOET_CACHE_SPLIT_DEVICE=cpu keeps it on the host kernels, =torch-cpu runs the torch kernels on
    the host (how the tests check the GPU path's maths without a GPU), =cuda asks for the GPU.
    """
    want = os.environ.get("MOET_CACHE_SPLIT_DEVICE", "auto")
    if want == "cpu":
        return None
    if want == "torch-cpu":
        return "cpu"
    if want == "cuda" or (KERNEL != "c" and torch.cuda.is_available()):
        return "cuda"
    return None


_DENSE_CHUNK = 16 << 20  # dense tensors are copied in chunks of this size (bounded memory, reused buffers)
_DEVICE_MIN_BYTES = 512 << 10  # smaller tensors stay on the host: ~20 launches and 3 syncs cost more than them


READ_THREADS = 2                 # source reads in flight beside the plane workers (the disk wants a queue)
_READ_AHEAD_BYTES = 256 << 20    # source bytes read ahead of the writer at most (bounded memory)


def _read_window(workers: int, expert_bytes: int) -> int:
    """Experts in flight (read, being split, or waiting to be written): enough to keep the reads going
    while the workers compute, never more than _READ_AHEAD_BYTES of source."""
    return max(2, min(4 * workers, _READ_AHEAD_BYTES // max(1, expert_bytes)))


def _plane_workers() -> int:
    """Threads for the split: the cores this process may use, at most 8."""
    return min(8, usable_cores())


@dataclass
class _Plan:
    served: list[int]
    kinds: dict[int, LayerKind]
    omitted: set[str]               # source tensors not carried into the cache at all
    planed: set[str]                # source tensors that become planes
    formats: dict[int, ExpertFormat]  # each served layer's expert format (one a layer)
    input_scales: dict[int, bool]   # each served layer: the source has input scales
    dense_by_shard: dict[str, list[str]] = field(default_factory=dict)


class _Builder:
    def __init__(self, ckpt: Checkpoint, root: Path, opts: BuildOptions, progress: Progress,
                 commits: Committer | None = None) -> None:
        self.ckpt, self.root, self.opts, self.progress = ckpt, root, opts, progress
        self.commits = commits or Committer(root)
        self.model = ckpt.model
        self.fingerprint = ckpt.fingerprint()
        self.plan = self._make_plan()
        self.profile: RoutingProfile | None = load_profile(opts.profile) if opts.profile else None
        if self.profile:
            check_profile(self.profile, {layer: self.model.n_routed_experts for layer in self.plan.served})
        self.built: list[int] = []
        self.reused: list[int] = []
        self.read_bytes = 0
        self._committer: ThreadPoolExecutor  # set in run()
        self._in_flight: Future[object] | None = None
        self.reader = SourceReader(ckpt)
        self._count_lock = threading.Lock()
        self.hashed = (0, 0.0)  # (bytes, seconds) of written files re-read and hashed: a speed sample

    # --- planning ----------------------------------------------------------------------------
    def _make_plan(self) -> _Plan:
        m, ck = self.model, self.ckpt
        fam = ck.family
        main = list(fam.moe_layers)
        mtp = list(fam.mtp_layers)
        if self.opts.layers:
            sel = parse_layer_selection(self.opts.layers)
            total = max([m.num_hidden_layers + m.num_nextn_predict_layers - 1, *mtp]) + 1
            beyond = sorted(i for i in sel if i >= total)
            if beyond:
                raise InputError(f"--layers names layer {beyond[0]}, but the model has layers 0-{total - 1}")
            if set(mtp) & sel and not self.opts.include_mtp:
                first = sorted(set(mtp) & sel)[0]
                raise InputError(f"--layers names the MTP layer {first} ({fam.layer_prefix(first)} of the source)",
                                 "add --include-mtp to build planes for MTP layers")
            served = sorted(sel & set(main + mtp))
            if not served:
                raise InputError(f"--layers {self.opts.layers} selects no MoE layer",
                                 f"the MoE layers are {main[0]}-{main[-1]}" if main else "the model has no MoE layer")
        else:
            served = main + (mtp if self.opts.include_mtp else [])
        if not served:
            raise InputError("the model has no MoE layer to build planes for")
        ck.validate_experts(served)
        kinds = {i: (LayerKind.MTP if fam.is_mtp(i) else LayerKind.MOE) for i in served}
        planed = ck.expert_tensor_names(served)
        omitted: set[str] = set()
        if not (self.opts.include_mtp or self.opts.lossless):
            omitted = {n for n in ck.tensors if fam.is_mtp(-1 if (x := fam.layer_of(n)) is None else x)}
        formats = {i: ck.layer_format(i) for i in served}
        input_scales = {i: ck.has_input_scales(i, formats[i]) for i in served}
        plan = _Plan(served, kinds, omitted, planed, formats, input_scales)
        for name in sorted(ck.tensors):
            if name not in planed and name not in omitted:
                plan.dense_by_shard.setdefault(ck.tensors[name].shard, []).append(name)
        return plan

    def _nbytes(self, name: str) -> int:
        info = self.ckpt.tensors[name]
        return TensorSpec(name, info.dtype, info.shape).nbytes

    def build_params(self, budget: int) -> BuildParams:
        return BuildParams(tuple(self.plan.served), self.opts.include_mtp, self.opts.lossless, budget,
                           self.profile.digest if self.profile else None)

    def total_delta_bytes(self) -> int:
        m = self.model
        return len(self.plan.served) * m.n_routed_experts * self._expert_delta_bytes()

    def _geometry(self, layer: int | None = None, w13_form: str = E4M3_16, w2_form: str = E4M3_16) -> LayerGeometry:
        m = self.model
        inputs = self.plan.input_scales.get(layer, False) if layer is not None else False
        return LayerGeometry(m.n_routed_experts, m.hidden_size, m.moe_intermediate_size, w13_form, w2_form, inputs)

    def _expert_delta_bytes(self) -> int:
        return self._geometry().expert_delta_bytes

    # --- the build ---------------------------------------------------------------------------
    def run(self) -> BuildResult:
        t0 = time.perf_counter()
        budget = parse_budget(self.opts.delta_budget, self.total_delta_bytes(), what="delta budget")
        params = self.build_params(budget)
        done = self._already_complete(params)
        if done is not None:
            return self._result(done, True, budget, t0)
        self.commits.uncommit()
        self._check_space(budget)
        expert_bytes = sum(self._nbytes(n) for n in self.plan.planed)
        dense_bytes = sum(self._nbytes(n) for names in self.plan.dense_by_shard.values() for n in names)
        self.progress.start(expert_bytes + dense_bytes, "build")
        files = self._copy_aux()
        manifests: dict[int, tuple[LayerManifest, FileEntry]] = {}
        # The dense copy (disk-bound) runs on its own thread beside the layers (CPU-bound). Each built
        # layer is fsynced, hashed and renamed, and then its manifest written, on a committer thread
        # while the next layer is read and split (the disk writes one back while it reads the next).
        # Within a part the order is unchanged: its files are durable before the record naming them.
        # The scale-form check of the next layer (it reads every block scale of the layer) runs on its own
        # thread while this one is built, so the plane workers never wait for it.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="moet-commit") as self._committer, \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="moet-dense") as dense_pool, \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="moet-forms") as forms_pool:
            dense = [dense_pool.submit(self._dense, shard, names)
                     for shard, names in sorted(self.plan.dense_by_shard.items())]
            done: list[Callable[[], tuple[LayerManifest, FileEntry]]] = []
            served = self.plan.served
            forms = {served[0]: forms_pool.submit(self._scale_forms, served[0])}
            for i, layer in enumerate(served):
                if i + 1 < len(served):
                    forms[served[i + 1]] = forms_pool.submit(self._scale_forms, served[i + 1])
                done.append(self._layer(layer, forms.pop(layer)))
                self.progress.layer_done(layer)
            for entries in dense:
                files.extend(entries.result())
            for layer, result in zip(self.plan.served, done):
                manifests[layer] = result()
        files.extend(self._tier(manifests, budget))
        files.append(self._source_map())
        files = self._served_config(files, {layer: lm for layer, (lm, _) in manifests.items()})
        refs = tuple(LayerRef(layer, fe.path, fe.size, fe.xxh3) for layer, (_, fe) in sorted(manifests.items()))
        manifest = CacheManifest(__version__, utc_now(), str(self.ckpt.root.resolve()), self.ckpt.layout,
                                 self.fingerprint, CacheModel(self.model, self.ckpt.family),
                                 params, refs, tuple(files))
        size, secs = self.hashed
        self.commits.commit(manifest, partial(sweep, self.root), speed_sample(size, secs))
        self.progress.finish()
        return self._result(manifest, False, budget, t0)

    def _result(self, manifest: CacheManifest, already: bool, budget: int, t0: float) -> BuildResult:
        index = read_delta_index(self.root, manifest)
        assert index is not None  # every build writes one
        pack = manifest.file(L.Role.PACK)
        return BuildResult(
            cache=str(self.root), already_complete=already, layers=tuple(self.plan.served),
            layers_built=tuple(self.built), layers_reused=tuple(self.reused), source_bytes=self.read_bytes,
            cache_bytes=sum(f.size for f in manifest.files) + sum(r.size for r in manifest.layers),
            tier_experts=sum(len(ex) for _, ex in index.layers), tier_bytes=index.used_bytes,
            tier_file_bytes=pack.size if pack else 0, budget_bytes=budget, seconds=time.perf_counter() - t0)

    def _already_complete(self, params: BuildParams) -> CacheManifest | None:
        try:
            manifest = read_committed_manifest(self.root)
        except (ManifestError, InputError):
            return None
        if manifest is None or manifest.build != params or manifest.source_fingerprint != self.fingerprint:
            return None
        from .verifier import boot_check
        return manifest if boot_check(self.root).ok else None

    def _check_space(self, budget: int) -> None:
        codes = sum(self._nbytes(n) for n in self.plan.planed)
        dense = sum(self._nbytes(n) for names in self.plan.dense_by_shard.values() for n in names)
        estimate = codes + min(budget, codes // 2) + dense
        present = sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file() and not p.is_symlink())
        check_free_space(self.root, max(0, estimate - present))

    # --- parts ---------------------------------------------------------------------------------
    def _copy_aux(self) -> list[FileEntry]:
        """The model folder: config.json, hf_quant_config.json, generation_config.json, the tokenizer files and
        folders such as V4's encoding/, so a server needs nothing from the source. Links in the source are
        followed (a Hugging Face hub snapshot's files are links into its blobs); links in the cache never."""
        out = []
        for rel_src, p in aux_files(self.ckpt.root):
            try:
                data = read_all(p, AUX_MAX_BYTES, follow=True)
            except (OSError, InputError):
                continue  # not a plain file after all (it changed), or grown past the limit: not carried
            # the source's config.json is kept as config.source.json; _served_config writes config.json
            source_config = rel_src == SERVED_CONFIG
            rel = f"{L.AUX_DIR}/{SOURCE_CONFIG if source_config else rel_src}"
            refuse_links(self.root, tuple(str(Path(rel).parents[i]) for i in range(len(Path(rel).parts) - 1)))
            dest = self.root / rel
            if not (dest.is_file() and not dest.is_symlink() and dest.read_bytes() == data):
                atomic_write_bytes(dest, data)
            out.append(FileEntry(rel, len(data), xxh3_hex(data), L.Role.SOURCE_CONFIG if source_config else L.Role.AUX))
        if not any(f.role == L.Role.SOURCE_CONFIG for f in out):
            raise InputError(f"cannot copy {self.ckpt.root / 'config.json'} into the cache's model folder",
                             "config.json must be a readable file (or a link to one) of at most 64 MiB")
        return out

    def _served_config(self, files: list[FileEntry], layers: dict[int, LayerManifest]) -> list[FileEntry]:
        """model/config.json: what vLLM reads, the source's config.json with `quant_method: moet` and the
        source's block inside (vllm_config.py); the source's own bytes stay in model/config.source.json."""
        entry = next((f for f in files if f.role == L.Role.SOURCE_CONFIG), None)
        if entry is None:
            return files
        forms = {layer: LayerForm(lm.scale_form(L.W13_SCALE), lm.scale_form(L.W2_SCALE),
                                  any(t.name == L.W13_INPUT_SCALE for t in lm.tensors))
                 for layer, lm in layers.items()}
        served = served_config_bytes((self.root / entry.path).read_bytes(), forms)
        dest = self.root / L.AUX_DIR / SERVED_CONFIG
        if not (dest.is_file() and dest.read_bytes() == served):
            atomic_write_bytes(dest, served)
        return [*files, FileEntry(f"{L.AUX_DIR}/{SERVED_CONFIG}", len(served), xxh3_hex(served), L.Role.AUX)]

    def _reusable_part(self, rel: str, key: str) -> PartManifest | None:
        path = self.root / rel
        if not path.is_file():
            return None
        try:
            part = load_record(path, PartManifest.parse, rel)
        except ManifestError:
            return None
        if part.build_key != key or not part.files or not all(file_matches(self.root, f) for f in part.files):
            return None
        return part

    def _commit_later(self, commit: Callable[[], _T]) -> Callable[[], _T]:
        """Run `commit` on the committer thread, after the previous one (one in flight: bounded dirty pages)."""
        if self._in_flight is not None:
            self._in_flight.result()
        fut = self._in_flight = self._committer.submit(commit)
        return fut.result

    def _dense(self, shard: str, names: list[str]) -> list[FileEntry]:
        """Copy one shard's dense tensors (on the dense thread); returns the file's and its part record's entries."""
        rel, rec = L.dense_file(shard), L.dense_record(shard)
        key = _key({"v": FORMAT_VERSION, "src": self.fingerprint.to_dict(), "shard": shard, "names": names})
        part = self._reusable_part(rec, key)
        if part is not None:
            self._advance(sum(self._nbytes(n) for n in names), read=False)
            data = (self.root / rec).read_bytes()
            return [part.files[0], FileEntry(rec, len(data), xxh3_hex(data), L.Role.PART)]
        specs = [TensorSpec(n, self.ckpt.tensors[n].dtype, self.ckpt.tensors[n].shape) for n in names]
        with SafetensorsWriter(self.root / rel, specs, self.ckpt.shard_metadata.get(shard)) as w:
            for n, chunk in self._chunks(names):
                w.write(n, chunk)
                self._advance(chunk.nbytes)
            written = w.commit()
        fe, tensors = _entries(rel, written, L.Role.DENSE)
        part = PartManifest(key, (fe,), tuple(tensors), self.ckpt.shard_metadata.get(shard))
        return [fe, _write_json_entry(self.root, rec, part, L.Role.PART)]  # the record after its file

    def _advance(self, nbytes: int, read: bool = True) -> None:
        """Count source bytes read and report progress; called from the main and the dense thread."""
        with self._count_lock:
            if read:
                self.read_bytes += nbytes
            self.progress.advance(nbytes)

    def _chunks(self, names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
        """(name, bytes) chunks of these tensors in order; the next two are read on a thread while one is written.

        Three reused buffers: a yielded chunk is valid until the next one is asked for.
        """
        items = []
        for n in names:
            size = self._nbytes(n)
            items += [(n, start, min(_DENSE_CHUNK, size - start)) for start in range(0, size, _DENSE_CHUNK)]
        bufs = [np.empty(min(_DENSE_CHUNK, max((k for _, _, k in items), default=1)), dtype=np.uint8)
                for _ in range(3)]
        inflight: deque[tuple[str, np.ndarray, Future[None]]] = deque()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="moet-read") as rd:
            for i, (n, start, k) in enumerate(items):
                while len(inflight) < 2 and i + len(inflight) < len(items):
                    n2, start2, k2 = items[i + len(inflight)]
                    out = bufs[(i + len(inflight)) % 3][:k2]
                    inflight.append((n2, out, rd.submit(self.reader.read_into, n2, out, start2)))
                name, out, fut = inflight.popleft()
                fut.result()
                yield name, out

    def _layer_key(self, layer: int) -> str:
        return _key({"v": FORMAT_VERSION, "src": self.fingerprint.to_dict(), "layout": self.ckpt.layout,
                     "layer": layer, "lossless": self.opts.lossless, "input_scale": self.plan.input_scales[layer],
                     "format": self.plan.formats[layer].name, "scale_forms": 2})

    def _layer(self, layer: int, forms: Future[tuple[str, str]] | None = None) -> Callable[[], tuple[LayerManifest, FileEntry]]:
        """Reuse or build one layer; returns what gives its manifest and manifest entry once committed."""
        rel = L.layer_manifest(layer)
        key = self._layer_key(layer)
        path = self.root / rel
        lm = None
        if path.is_file():
            try:
                lm = load_record(path, LayerManifest.parse, rel)
            except ManifestError:
                lm = None
            if lm is not None and (lm.build_key != key or not all(file_matches(self.root, f) for f in lm.files)):
                lm = None
        if lm is not None:
            self.reused.append(layer)
            self._advance(lm.source_bytes, read=False)
            return partial(self._manifest_entry, lm)
        committed = self._commit_later(self._build_layer(layer, key, forms.result() if forms else None))
        self.built.append(layer)
        return lambda: self._manifest_entry(committed())

    def _manifest_entry(self, lm: LayerManifest) -> tuple[LayerManifest, FileEntry]:
        rel = L.layer_manifest(lm.layer)
        data = (self.root / rel).read_bytes()
        return lm, FileEntry(rel, len(data), xxh3_hex(data), L.Role.LAYER_MANIFEST)

    def _layer_specs(self, layer: int, geo: LayerGeometry) -> tuple[list[TensorSpec], list[TensorSpec]]:
        E = geo.n_experts
        delta = geo.delta_specs()
        fmt = self.plan.formats[layer]
        for proj in PROJECTIONS:
            for kind in self._scalar_kinds(layer):
                info = self.ckpt.tensors[self.ckpt.expert_names(layer, 0, proj, fmt)[kind]]
                delta.append(TensorSpec(L.source_scalar(proj, kind), info.dtype, (E, *info.shape)))
        return geo.base_specs(), delta

    def _scalar_kinds(self, layer: int) -> tuple[str, ...]:
        kinds = self.plan.formats[layer].scalar_kinds
        return kinds if self.plan.input_scales[layer] else tuple(k for k in kinds if k != "input_scale")

    def _scale_forms(self, layer: int) -> tuple[str, str]:
        return self.ckpt.scale_forms(layer, self.plan.formats[layer])

    def _build_layer(self, layer: int, key: str, forms: tuple[str, str] | None = None) -> Callable[[], LayerManifest]:
        """Read, split and write one layer's planes; returns its commit (fsync, hash, rename, then the manifest)."""
        m, ck = self.model, self.ckpt
        E = m.n_routed_experts
        fmt = self.plan.formats[layer]
        forms = forms or self._scale_forms(layer)
        geo = self._geometry(layer, *forms)
        base_specs, delta_specs = self._layer_specs(layer, geo)
        delta_rel = L.delta_file(layer)
        lossless = self.opts.lossless
        scale2 = np.zeros((E, 3), dtype=np.float32)
        iscale = np.zeros((E, 3), dtype=np.float32)
        tables = np.zeros((E, 3, 4), dtype=np.float32)
        raw_scalars: dict[tuple[str, str], list[np.ndarray]] = {}
        sq_error, energy = [], []
        source_bytes = 0
        # A pipeline in bounded memory: read threads keep the disk busy up to `window` experts ahead,
        # plane workers split and measure what is read (the kernels release the GIL), and this thread
        # writes expert e. Reads on their own threads: a worker that read its own expert left the
        # disk idle while it computed, and the CPU idle while it waited for the disk.
        workers, device = _plane_workers(), _plane_device()
        expert_bytes = sum(self._nbytes(n) for p in PROJECTIONS for n in ck.expert_names(layer, 0, p, fmt).values()
                           if n in ck.tensors)
        window = _read_window(workers, expert_bytes)
        reader = self.reader
        pending: deque[Future[list[_Planes]]] = deque()
        ahead = 0
        # Without --lossless the delta planes are not written here: the tier pack takes the chosen
        # experts' planes from the source at the end (one write of the few chosen, not a staged copy of all).
        with SafetensorsWriter(self.root / L.base_file(layer), base_specs) as bw, \
                (SafetensorsWriter(self.root / delta_rel, delta_specs) if lossless else nullcontext()) as dw, \
                ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moet-planes") as pool, \
                ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="moet-read") as reads:
            for e in range(E):
                while ahead < E and len(pending) < window:
                    pending.append(pool.submit(_plane_work, reads.submit(_read_expert, reader, layer, ahead, fmt), device))
                    ahead += 1
                work = pending.popleft().result()
                err = en = 0.0
                for j, proj in enumerate(PROJECTIONS):
                    x, base, delta, table = work[j].x, work[j].base, work[j].delta, work[j].table
                    g = x.scale_2
                    _check_source_finite(layer, e, proj, g, work[j].error, work[j].energy,
                                         None if x.input_scale is None else fmt.multiply(x.input_scale))
                    err, en = err + work[j].error * g * g, en + work[j].energy * g * g
                    w13 = is_w13(proj)
                    bw.write(L.W13_BASE if w13 else L.W2_BASE, base)
                    if dw is not None:
                        dw.write(L.W13_DELTA if w13 else L.W2_DELTA, delta)
                    bw.write(L.W13_SCALE if w13 else L.W2_SCALE,
                             stored_scales(x.scale_bytes, fmt.scale_form, geo.form(proj)))
                    scale2[e, j], tables[e, j] = g, table
                    if x.global_scale is not None:
                        raw_scalars.setdefault((proj, "global_scale"), []).append(x.global_scale.reshape(-1))
                    if self.plan.input_scales[layer]:
                        if x.input_scale is None:
                            raise InputError(f"layer {layer} expert {e} {proj} has no input scale, expert 0 has")
                        iscale[e, j] = fmt.multiply(x.input_scale)
                        raw_scalars.setdefault((proj, "input_scale"), []).append(x.input_scale.reshape(-1))
                    n = x.codes.nbytes + x.scale_bytes.nbytes + (4 if x.global_scale is not None else 0) \
                        + (4 if x.input_scale is not None else 0)
                    reader.release(x.codes)  # split and measured: the buffer reads another expert
                    source_bytes += n
                    self._advance(n)
                sq_error.append(err)
                energy.append(en)
            bw.write(L.W13_SCALE_2, scale2[:, :2])
            bw.write(L.W2_SCALE_2, scale2[:, 2].copy())
            if self.plan.input_scales[layer]:
                bw.write(L.W13_INPUT_SCALE, iscale[:, :2])
                bw.write(L.W2_INPUT_SCALE, iscale[:, 2].copy())
            bw.write(L.W13_TABLE, tables[:, :2])
            bw.write(L.W2_TABLE, tables[:, 2].copy())
            if dw is not None:
                for (proj, kind), parts in raw_scalars.items():
                    dw.write(L.source_scalar(proj, kind), np.concatenate(parts))
            bw.check_full()  # a short tensor is a bug: fail here, not on the committer thread
            if dw is not None:
                dw.check_full()

        def commit() -> LayerManifest:
            writers = [(bw, L.base_file(layer), L.Role.BASE)] + ([(dw, delta_rel, L.Role.DELTA_ALL)] if dw else [])
            files, tensors = [], []
            try:
                for w, rel, role in writers:
                    written = w.commit()
                    with self._count_lock:
                        self.hashed = (self.hashed[0] + written.size, self.hashed[1] + written.hash_seconds)
                    fe, t = _entries(rel, written, role)
                    files.append(fe)
                    tensors += t
            finally:
                for w, _, _ in writers:
                    w.abort()  # a no-op once committed
            lm = LayerManifest(layer, self.plan.kinds[layer], E, m.hidden_size, m.moe_intermediate_size, key,
                               self._expert_delta_bytes(), source_bytes, tuple(files), tuple(tensors),
                               tuple(sq_error), tuple(energy), fmt.name,
                               ((L.W13_SCALE, geo.w13_form), (L.W2_SCALE, geo.w2_form)))
            write_record(self.root / L.layer_manifest(layer), lm)  # after its files are durable
            return lm
        return commit

    # --- the tier --------------------------------------------------------------------------------
    def _tier(self, manifests: dict[int, tuple[LayerManifest, FileEntry]], budget: int) -> list[FileEntry]:
        layer_mans = {layer: lm for layer, (lm, _) in manifests.items()}
        key = tier_key({layer: fe.xxh3 for layer, (_, fe) in manifests.items()}, budget,
                       self.profile.digest if self.profile else None)
        part_rel = TIER_PART
        part = self._reusable_part(part_rel, key)
        if part is None:
            chosen = choose_tier(tier_candidates(layer_mans, self.profile), budget)
            deltas = _file_deltas({layer: self.root / L.delta_file(layer) for layer in layer_mans}) \
                if self.opts.lossless else self._source_deltas
            pack_fe, index_fe = write_delta_pack(self.root, layer_mans, chosen, deltas, budget,
                                                 self.profile is not None)
            part = PartManifest(key, (pack_fe, index_fe), ())
            part_fe = _write_json_entry(self.root, part_rel, part, L.Role.PART)
        else:
            data = (self.root / part_rel).read_bytes()
            part_fe = FileEntry(part_rel, len(data), xxh3_hex(data), L.Role.PART)
        return [*part.files, part_fe]

    def _source_deltas(self, layer: int, which: str, experts: tuple[int, ...]) -> Iterator[np.ndarray]:
        """The delta planes of these experts, split again from the source (the same planes, bit for bit),
        read and split on worker threads a few experts ahead of the pack's writer."""
        projs = ("gate_proj", "up_proj") if which == L.W13_DELTA else ("down_proj",)
        reader = self.reader

        def delta(e: int, proj: str) -> np.ndarray:
            x = reader.read_expert(layer, e, proj)
            out = split_planes(x.codes)[1]
            reader.release(x.codes)
            return out
        workers = _plane_workers()
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moet-tier") as pool:
            pending: deque[Future[np.ndarray]] = deque()
            for e, proj in ((e, proj) for e in experts for proj in projs):
                pending.append(pool.submit(delta, e, proj))
                if len(pending) > 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

    def _source_map(self) -> FileEntry:
        ck = self.ckpt
        shards = []
        for shard in ck.shards:
            names = sorted(n for n, t in ck.tensors.items() if t.shard == shard and n not in self.plan.omitted)
            shards.append({"name": shard, "metadata": ck.shard_metadata.get(shard),
                           "tensors": [[n, ck.tensors[n].dtype, list(ck.tensors[n].shape)] for n in names]})
        doc = {"format": "moet-cache-source-map", "format_version": FORMAT_VERSION, "layout": ck.layout,
               "complete": not self.plan.omitted, "index_metadata": (ck.index or {}).get("metadata"),
               "shards": shards}
        data = (json.dumps(doc, indent=None) + "\n").encode()
        atomic_write_bytes(self.root / L.SOURCE_MAP, data)
        return FileEntry(L.SOURCE_MAP, len(data), xxh3_hex(data), L.Role.SOURCE_MAP)


def sweep(root: Path, manifest: CacheManifest) -> None:
    """Remove what an earlier (killed) build or retier left that this cache does not list: unlisted files
    in our folders, the staging folder, temp files of atomic writes (the caller holds the lock)."""
    keep = {f.path for f in manifest.files} | {r.manifest for r in manifest.layers}
    for layer in manifest.layers:
        lm = load_record(root / layer.manifest, LayerManifest.parse)
        keep.update(f.path for f in lm.files)
    for folder in (L.LAYERS_DIR, L.DENSE_DIR, "delta", L.AUX_DIR):
        d = root / folder
        if d.is_dir() and not d.is_symlink():
            for p in (d.rglob("*") if folder == L.AUX_DIR else d.iterdir()):
                if p.relative_to(root).as_posix() not in keep and (p.is_file() or p.is_symlink()):
                    p.unlink()
    staging = root / L.STAGING_DIR
    if staging.is_dir():
        shutil.rmtree(staging)
    for name in (CACHE_MANIFEST, COMMIT_RECORD, L.SOURCE_MAP):
        for p in root.glob(f".{name}.tmp-*"):
            p.unlink(missing_ok=True)
    state = root / VERIFIED_STATE
    for p in state.parent.glob(f".{state.name}.tmp-*") if state.parent.is_dir() and not state.parent.is_symlink() else ():
        p.unlink(missing_ok=True)
    fsync_dir(root)


TIER_PART = "delta/tier.part.json"


def tier_key(layer_digests: dict[int, str], budget: int, profile_digest: str | None) -> str:
    """What the tier's bytes depend on: the layer manifests, the budget and the profile."""
    return _key({"layers": {str(k): v for k, v in sorted(layer_digests.items())}, "budget": budget,
                 "profile": profile_digest})


def tier_candidates(layers: dict[int, LayerManifest], profile: RoutingProfile | None) -> list[Candidate]:
    out = []
    for layer, lm in sorted(layers.items()):
        weights = profile.weights(layer, lm.n_experts) if profile else (1.0,) * lm.n_experts
        out += [Candidate(layer, e, lm.expert_delta_bytes, lm.sq_error[e], weights[e]) for e in range(lm.n_experts)]
    return out


#: (layer, w13_delta or w2_delta, experts) -> the experts' planes of that tensor, in order, as byte chunks.
DeltaReader = Callable[[int, str, tuple[int, ...]], Iterable[np.ndarray]]


def _file_deltas(sources: dict[int, Path]) -> DeltaReader:
    """A DeltaReader over per-layer delta files (the --lossless ones) holding every expert's planes.

    Read through the strict header reader: a damaged file is a damaged cache (exit 1), never a crash.
    """
    def read(layer: int, which: str, experts: tuple[int, ...]) -> Iterator[np.ndarray]:
        path = sources[layer]
        head = read_header(path, str(path.name), VerificationError, VerificationError)
        ent = head.tensors.get(which)
        if ent is None or ent.dtype != "U8" or not ent.shape or any(e >= ent.shape[0] for e in experts):
            raise VerificationError(f"{path.name}: {which} is missing or does not hold the tier's experts",
                                    "run moet-cache verify --full, then build the cache again")
        per = (ent.end - ent.begin) // ent.shape[0]
        with open(path, "rb") as f:
            for e in experts:
                data = os.pread(f.fileno(), per, ent.begin + e * per)
                if len(data) != per:
                    raise VerificationError(f"{path.name}: the file ends inside {which}", "build the cache again")
                yield np.frombuffer(data, dtype=np.uint8)
    return read


def write_delta_pack(root: Path, layers: dict[int, LayerManifest], chosen: dict[int, tuple[int, ...]],
                     deltas: DeltaReader, budget: int, weighted: bool) -> tuple[FileEntry, FileEntry]:
    """Write delta/tier.safetensors (chosen experts' planes, layer by layer) and its index."""
    specs = []
    for layer, experts in sorted(chosen.items()):
        if experts:
            specs += [TensorSpec(L.pack_tensor(layer, sp.name), sp.dtype, sp.shape)
                      for sp in layers[layer].geometry().delta_specs(len(experts))]
    with SafetensorsWriter(root / L.PACK, specs) as w:
        for layer, experts in sorted(chosen.items()):
            if not experts:
                continue
            for which in (L.W13_DELTA, L.W2_DELTA):
                for chunk in deltas(layer, which, experts):
                    w.write(L.pack_tensor(layer, which), chunk)
        written = w.commit()
    pack_fe = FileEntry(L.PACK, written.size, written.xxh3, L.Role.PACK)
    used = sum(layers[layer].expert_delta_bytes * len(ex) for layer, ex in chosen.items())
    index = DeltaIndex(L.PACK, budget, used, weighted, tuple(sorted(chosen.items())))
    index_fe = _write_json_entry(root, L.DELTA_INDEX, index, L.Role.DELTA_INDEX)
    return pack_fe, index_fe


def build_cache(src: str | os.PathLike[str], cache: str | os.PathLike[str],
                options: BuildOptions | None = None, progress: Progress | None = None) -> BuildResult:
    """Build (or resume, or confirm) the cache for `src` at `cache`."""
    opts = options or BuildOptions()
    root = Path(cache)
    src_path = Path(src)
    if root.exists() and not root.is_dir():
        raise InputError(f"{root} exists and is not a folder")
    if root.resolve() == src_path.resolve() or src_path.resolve() in root.resolve().parents:
        raise InputError("the cache folder must not be the checkpoint folder or inside it")
    root.mkdir(parents=True, exist_ok=True)
    with CacheLock(root, wait=opts.wait):
        refuse_links(root, L.WRITTEN_DIRS)
        commits = Committer(root)
        with commits.guard(), open_checkpoint(src_path) as ckpt:
            builder = _Builder(ckpt, root, opts, progress or NullProgress(), commits)
            try:
                return builder.run()
            finally:
                builder.reader.close()


@dataclass(frozen=True)
class RetierResult:
    cache: str
    budget_bytes: int
    tier_experts: int
    tier_bytes: int         # the delta planes of the tier: what the budget counts (never above it)
    tier_file_bytes: int    # delta/tier.safetensors on disk: the planes plus the file's header
    weighted_by_profile: bool


def retier_cache(cache: str | os.PathLike[str], delta_budget: str, profile: str | None = None,
                 wait: bool = False) -> RetierResult:
    """Choose a new delta tier for a --lossless cache, without the source; recommits the cache.

    The same commit protocol as a build (moet_cache.commit): interrupted with Ctrl-C or SIGTERM it puts
    the previous commit back where it can prove nothing changed; killed inside its window it leaves the
    cache uncommitted, and the same command resumes it (from cache.json, re-hashing the files it keeps).
    """
    from dataclasses import replace

    root = Path(cache)
    with CacheLock(root, wait=wait):
        refuse_links(root, L.WRITTEN_DIRS)
        commits = Committer(root)
        with commits.guard():
            cf = _retier_source(root)
            m = cf.manifest
            total = sum(lm.n_experts * lm.expert_delta_bytes for lm in cf.layers.values())
            budget = parse_budget(delta_budget, total, what="delta budget")
            prof = load_profile(profile) if profile else None
            if prof:
                check_profile(prof, {layer: lm.n_experts for layer, lm in cf.layers.items()})
            chosen = choose_tier(tier_candidates(cf.layers, prof), budget)
            commits.uncommit()
            deltas = _file_deltas({layer: root / L.delta_file(layer) for layer, ex in chosen.items() if ex})
            pack_fe, index_fe = write_delta_pack(root, cf.layers, chosen, deltas, budget, prof is not None)
            key = tier_key({r.layer: r.xxh3 for r in m.layers}, budget, prof.digest if prof else None)
            part_fe = _write_json_entry(root, TIER_PART, PartManifest(key, (pack_fe, index_fe), ()), L.Role.PART)
            keep = [f for f in m.files if f.role not in TIER_ROLES and f.path != TIER_PART]
            new = replace(m, created=utc_now(), files=(*keep, pack_fe, index_fe, part_fe),
                          build=replace(m.build, delta_budget_bytes=budget, profile_xxh3=prof.digest if prof else None))
            commits.commit(new, partial(sweep, root))
            used = sum(cf.layers[layer].expert_delta_bytes * len(ex) for layer, ex in chosen.items())
            return RetierResult(str(root), budget, sum(len(ex) for ex in chosen.values()), used, pack_fe.size,
                                prof is not None)


TIER_ROLES = (L.Role.PACK, L.Role.DELTA_INDEX)


def _retier_source(root: Path) -> Any:
    """The cache to re-tier: the committed one, or the one a killed retier (or build) left uncommitted,
    if every file it keeps still matches its digest (re-hashed); the tier itself is rewritten anyway."""
    if (root / COMMIT_RECORD).is_file():
        cf = open_view(root)
    else:
        try:
            cf = open_uncommitted_view(root)
        except ManifestError as e:
            raise InputError(f"{root} is not committed and cannot be resumed without the source: {e.message}",
                             "run moet-cache build SRC CACHE (with --lossless) to finish it") from None
        bad = next((f.path for f, _ in cf.files
                    if f.role not in TIER_ROLES and f.path != TIER_PART and not file_matches(root, f)), None)
        if bad is not None:
            raise InputError(f"{root} is not committed and {bad} does not match its record, so it cannot be "
                             "resumed without the source", "run moet-cache build SRC CACHE (with --lossless)")
    if not cf.manifest.build.lossless:
        raise InputError("only a --lossless cache keeps every delta plane, so only it can be re-tiered",
                         "build again with the new --delta-budget (the source is needed)")
    return cf


__all__ = ["BuildOptions", "BuildResult", "RetierResult", "build_cache", "file_matches", "read_json_file", "retier_cache"]
