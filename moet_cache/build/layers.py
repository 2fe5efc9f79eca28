"""The per-layer pipeline: each served layer reused (a killed build finished it) or read, split and
written; each built layer committed (fsync, hash, rename, then its manifest) on the committer thread
while the next one is read and split.

Within a layer, a pipeline in bounded memory: read threads keep the disk busy up to a window of experts
ahead, plane workers split and measure what is read (the kernels release the GIL), and the calling thread
writes expert e. Reads on their own threads: a worker that read its own expert left the disk idle while
it computed, and the CPU idle while it waited for the disk.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from ..cache import layout as L
from ..source.checkpoint import PROJECTIONS, RawExpert, SourceReader
from ..enums import BaseTable
from ..errors import InputError
from ..format.formats import E4M3_16, LAYOUT_FORMAT, ExpertFormat, TensorKind, e4m3_shift, e8m0_to_e4m3, stored_scales
from ..cache.geometry import LayerGeometry, is_w13
from ..cache.manifest import FileEntry, LayerManifest, write_record
from ..codec.planes import E4M3_VALUES, HostKernel, code_histogram, code_histogram_torch, error_and_energy, \
    error_and_energy_torch, fit_base_table, fit_mid_table, split_and_measure_mid_e4m3, split_planes_torch
from ..stwriter import SafetensorsWriter
from ..window import bounded_window
from .parts import Counters, read_entry, reusable, written_entries
from .plan import BuildPlan

_T = TypeVar("_T")
#: (layer manifest, its entry in cache.json), once the layer is committed
LayerDone = tuple[LayerManifest, FileEntry]


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
    mid_error: float  # (FP4 - 3-bit)^2 through the fitted 8-entry table, before the global scale


def mid_error(codes: np.ndarray, scale_bytes: np.ndarray) -> float:
    """The squared error left with the mid plane (base + the delta's high bit through fit_mid_table), from the
    codes and e4m3 scale bytes a projection's base error is measured with: what the mid tier is chosen by.
    Two numpy passes over the codes: the GPU split's (the host split has it from its one pass)."""
    return error_and_energy(codes, E4M3_VALUES[scale_bytes], fit_mid_table(code_histogram(codes)))[0]


def read_expert(reader: SourceReader, layer: int, expert: int, fmt: ExpertFormat) -> list[RawExpert]:
    """One expert's three projections, read from the source (on a read thread)."""
    return [reader.read_expert(layer, expert, p, fmt) for p in PROJECTIONS]


def measure_scales(x: RawExpert) -> tuple[np.ndarray, float]:
    """e4m3 block-scale bytes per 16 to measure this projection's error with, and the factor on the
    squared error and energy: MXFP4's e8m0 scales (per 32) become e4m3 of 2^(k - shift), error x 4^shift."""
    if x.fmt.scale_form == E4M3_16:
        return x.scale_bytes, 1.0
    shift = e4m3_shift(x.scale_bytes)
    return e8m0_to_e4m3(x.scale_bytes, shift), float(4.0 ** shift)


def plane_work(read: Future[list[RawExpert]], device: str | None = None, device_min_bytes: int = 0,
               kernel: HostKernel | None = None, form: BaseTable | str = BaseTable.FITTED) -> list[_Planes]:
    """Split and measure one expert's three projections once they are read (on a plane worker); the
    tables have `form` and the errors are measured against them (the tier is chosen by those errors)."""
    out = []
    for x in read.result():
        scale_bytes, factor = measure_scales(x)
        if device is None or (device != "cpu" and x.codes.nbytes < device_min_bytes):
            base, delta, table, er, eg, mer = split_and_measure_mid_e4m3(x.codes, scale_bytes, kernel=kernel,
                                                                         form=form)
        else:  # the same maths in torch on the device; the planes and table are bit-identical
            codes = torch.from_numpy(x.codes).to(device)
            tbase, tdelta = split_planes_torch(codes)
            table = fit_base_table(code_histogram_torch(codes), form)
            scales = torch.from_numpy(scale_bytes).view(torch.float8_e4m3fn).to(device).to(torch.float32)
            er, eg = error_and_energy_torch(codes, scales, table)
            base, delta = tbase.cpu().numpy(), tdelta.cpu().numpy()
            mer = mid_error(x.codes, scale_bytes)
        out.append(_Planes(x, base, delta, table, er * factor, eg * factor, mer * factor))
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


class _LayerFiles:
    """One layer being written: its base file, its --lossless delta file, and what is gathered per expert
    (global scales, input scales, tables, the source's raw scalars, squared error and energy)."""

    def __init__(self, plan: BuildPlan, root: Path, layer: int, geo: LayerGeometry) -> None:
        self.plan, self.root, self.layer, self.geo = plan, root, layer, geo
        self.fmt = plan.formats[layer]
        self.inputs = plan.input_scales[layer]
        E = geo.n_experts
        base_specs, delta_specs = plan.layer_specs(layer, geo)
        self.base = SafetensorsWriter(root / L.base_file(layer), base_specs)
        # Without --lossless the delta planes are not written here: the tier pack takes the chosen
        # experts' planes from the source at the end (one write of the few chosen, not a staged copy of all).
        try:
            self.delta = SafetensorsWriter(root / L.delta_file(layer), delta_specs) if plan.opts.lossless else None
        except BaseException:
            self.base.abort()
            raise
        self.scale2 = np.zeros((E, 3), dtype=np.float32)
        self.iscale = np.zeros((E, 3), dtype=np.float32)
        self.tables = np.zeros((E, 3, 4), dtype=np.float32)
        self.raw_scalars: dict[tuple[str, str], list[np.ndarray]] = {}
        self.sq_error: list[float] = []
        self.energy: list[float] = []
        self.mid_sq_error: list[float] = []
        self.source_bytes = 0

    def add(self, e: int, work: list[_Planes], reader: SourceReader, counters: Counters) -> None:
        """Write expert e's planes and block scales; gather its scalars and measures."""
        layer, fmt, bw, dw = self.layer, self.fmt, self.base, self.delta
        err = en = mid_err = 0.0
        for j, proj in enumerate(PROJECTIONS):
            x, w = work[j].x, work[j]
            g = x.scale_2
            _check_source_finite(layer, e, proj, g, w.error, w.energy,
                                 None if x.input_scale is None else fmt.multiply(x.input_scale))
            err, en, mid_err = err + w.error * g * g, en + w.energy * g * g, mid_err + w.mid_error * g * g
            w13 = is_w13(proj)
            bw.write(L.W13_BASE if w13 else L.W2_BASE, w.base)
            if dw is not None:
                dw.write(L.W13_DELTA if w13 else L.W2_DELTA, w.delta)
            bw.write(L.W13_SCALE if w13 else L.W2_SCALE, stored_scales(x.scale_bytes, fmt.scale_form, self.geo.form(proj)))
            self.scale2[e, j], self.tables[e, j] = g, w.table
            if x.global_scale is not None:
                self.raw_scalars.setdefault((proj, TensorKind.GLOBAL_SCALE), []).append(x.global_scale.reshape(-1))
            if self.inputs:
                if x.input_scale is None:
                    raise InputError(f"layer {layer} expert {e} {proj} has no input scale, expert 0 has")
                self.iscale[e, j] = fmt.multiply(x.input_scale)
                self.raw_scalars.setdefault((proj, TensorKind.INPUT_SCALE), []).append(x.input_scale.reshape(-1))
            n = x.codes.nbytes + x.scale_bytes.nbytes + (4 if x.global_scale is not None else 0) \
                + (4 if x.input_scale is not None else 0)
            reader.release(x.codes)  # split and measured: the buffer reads another expert
            self.source_bytes += n
            counters.advance(n)
        self.sq_error.append(err)
        self.energy.append(en)
        self.mid_sq_error.append(mid_err)

    def finish(self) -> None:
        """The per-layer tensors, once every expert is in; a short tensor is a bug: fail here, not on the
        committer thread."""
        bw, dw = self.base, self.delta
        bw.write(L.W13_SCALE_2, self.scale2[:, :2])
        bw.write(L.W2_SCALE_2, self.scale2[:, 2].copy())
        if self.inputs:
            bw.write(L.W13_INPUT_SCALE, self.iscale[:, :2])
            bw.write(L.W2_INPUT_SCALE, self.iscale[:, 2].copy())
        bw.write(L.W13_TABLE, self.tables[:, :2])
        bw.write(L.W2_TABLE, self.tables[:, 2].copy())
        if dw is not None:
            for (proj, kind), parts in self.raw_scalars.items():
                dw.write(L.source_scalar(proj, kind), np.concatenate(parts))
        bw.check_full()
        if dw is not None:
            dw.check_full()

    def abort(self) -> None:
        for w in (self.base, self.delta):
            if w is not None:
                w.abort()  # a no-op once committed

    def commit(self, counters: Counters) -> LayerManifest:
        """fsync, hash and rename the layer's files, then write its manifest (after its files are durable)."""
        writers = [(self.base, L.base_file(self.layer), L.Role.BASE)]
        if self.delta is not None:
            writers.append((self.delta, L.delta_file(self.layer), L.Role.DELTA_ALL))
        files, tensors = [], []
        try:
            for w, rel, role in writers:
                written = w.commit()
                counters.add_hashed(written)
                fe, t = written_entries(rel, written, role)
                files.append(fe)
                tensors += t
        finally:
            self.abort()
        plan, geo, m = self.plan, self.geo, self.plan.ckpt.model
        lm = LayerManifest(self.layer, plan.kinds[self.layer], geo.n_experts, m.hidden_size, m.moe_intermediate_size,
                           plan.layer_key(self.layer), plan.expert_delta_bytes, self.source_bytes, tuple(files),
                           tuple(tensors), tuple(self.sq_error), tuple(self.energy), self.fmt.name,
                           ((L.W13_SCALE, geo.w13_form), (L.W2_SCALE, geo.w2_form)), tuple(self.mid_sq_error))
        write_record(self.root / L.layer_manifest(self.layer), lm)
        return lm


def build_layer(plan: BuildPlan, root: Path, reader: SourceReader, counters: Counters, layer: int,
                forms: tuple[str, str]) -> Callable[[], LayerManifest]:
    """Read, split and write one layer's planes; returns its commit (fsync, hash, rename, then the manifest)."""
    tuning = plan.opts.tuning
    fmt = plan.formats[layer]
    workers, device = tuning.workers(), tuning.device()
    window = tuning.read_window(workers, plan.expert_source_bytes(layer))
    out = _LayerFiles(plan, root, layer, plan.geometry(layer, *forms))
    with out.base, (out.delta if out.delta is not None else nullcontext()), \
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moet-planes") as pool, \
            ThreadPoolExecutor(max_workers=tuning.read_threads, thread_name_prefix="moet-read") as reads:
        def submit(e: int) -> Future[list[_Planes]]:
            return pool.submit(plane_work, reads.submit(read_expert, reader, layer, e, fmt), device,
                               tuning.device_min_bytes, tuning.kernel(), plan.opts.base_table)
        for e, work in enumerate(bounded_window(submit, range(out.geo.n_experts), window, counters.cancel)):
            out.add(e, work, reader, counters)
        out.finish()
    return lambda: out.commit(counters)


def reusable_layer(plan: BuildPlan, root: Path, layer: int) -> LayerManifest | None:
    """The manifest a killed build wrote for this layer, if it has this build's key and its files match (and,
    for a build with a mid tier, its 3-bit errors: a layer written before the mid tier has none)."""
    lm = reusable(root, L.layer_manifest(layer), plan.layer_key(layer), LayerManifest.parse)
    return None if lm is not None and plan.opts.mid_budget and not lm.mid_sq_error else lm


@dataclass
class LayerResults:
    done: dict[int, LayerDone]
    built: list[int]
    reused: list[int]


def build_layers(plan: BuildPlan, root: Path, reader: SourceReader, counters: Counters) -> LayerResults:
    """Reuse or build every served layer, in order. Each built layer is committed on the committer thread
    (one in flight: bounded dirty pages) while the next is read and split; the scale-form check of the next
    layer (it reads every block scale of the layer) runs on its own thread, so the workers never wait for it."""
    built: list[int] = []
    reused: list[int] = []
    pending: dict[int, Callable[[], LayerDone]] = {}
    in_flight: Future[LayerManifest] | None = None
    served = plan.served
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="moet-commit") as committer, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="moet-forms") as forms_pool:
        def scale_forms(layer: int) -> tuple[str, str]:
            return plan.ckpt.scale_forms(layer, plan.formats[layer])
        forms = {served[0]: forms_pool.submit(scale_forms, served[0])}
        for i, layer in enumerate(served):
            counters.check()
            if i + 1 < len(served):
                forms[served[i + 1]] = forms_pool.submit(scale_forms, served[i + 1])
            lm = reusable_layer(plan, root, layer)
            if lm is not None:
                forms.pop(layer)
                reused.append(layer)
                counters.advance(lm.source_bytes, read=False)
                pending[layer] = _entry_of(root, lm)
            else:
                commit = build_layer(plan, root, reader, counters, layer, forms.pop(layer).result())
                if in_flight is not None:
                    in_flight.result()
                in_flight = committer.submit(commit)
                built.append(layer)
                pending[layer] = _entry_of(root, in_flight.result)
            counters.progress.layer_done(layer)
        done = {layer: get() for layer, get in pending.items()}
    return LayerResults(done, built, reused)


def _entry_of(root: Path, lm: LayerManifest | Callable[[], LayerManifest]) -> Callable[[], LayerDone]:
    """What gives the layer's manifest and its entry once it is committed."""
    def get() -> LayerDone:
        m = lm() if callable(lm) else lm
        return m, read_entry(root, L.layer_manifest(m.layer), L.Role.LAYER_MANIFEST)
    return get
