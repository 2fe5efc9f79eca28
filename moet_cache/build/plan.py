"""The build's plan: what a checkpoint and the options make of the cache, before a byte is written.

Pure: it reads the checkpoint's headers and config (already parsed), never a tensor, and writes nothing;
the keys it gives decide which parts of an earlier (killed) build are reused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from ..source.checkpoint import PROJECTIONS, Checkpoint
from ..enums import BaseTable
from ..errors import InputError
from ..format.formats import E4M3_16, ExpertFormat, TensorKind
from ..cache.geometry import LayerGeometry
from ..cache.manifest import FORMAT_VERSION, BuildParams, LayerKind, SourceFingerprint
from ..format.modelconfig import parse_layer_selection
from ..stwriter import TensorSpec
from ..cache import layout as L
from .options import BuildOptions
from .parts import key_of


@dataclass(frozen=True)
class BuildPlan:
    ckpt: Checkpoint = field(repr=False)
    opts: BuildOptions
    served: list[int]
    kinds: dict[int, LayerKind]
    omitted: set[str]                 # source tensors not carried into the cache at all
    planed: set[str]                  # source tensors that become planes
    formats: dict[int, ExpertFormat]  # each served layer's expert format (one a layer)
    input_scales: dict[int, bool]     # each served layer: the source has input scales
    dense_by_shard: dict[str, list[str]]
    fingerprint: SourceFingerprint

    # --- sizes -----------------------------------------------------------------------------------
    def nbytes(self, name: str) -> int:
        info = self.ckpt.tensors[name]
        return TensorSpec(name, info.dtype, info.shape).nbytes

    @property
    def planed_bytes(self) -> int:
        return sum(self.nbytes(n) for n in self.planed)

    @property
    def dense_bytes(self) -> int:
        return sum(self.nbytes(n) for names in self.dense_by_shard.values() for n in names)

    def expert_source_bytes(self, layer: int) -> int:
        """One expert's source bytes in this layer (codes, scales, scalars of its three projections)."""
        ck, fmt = self.ckpt, self.formats[layer]
        return sum(self.nbytes(n) for p in PROJECTIONS for n in ck.expert_names(layer, 0, p, fmt).values()
                   if n in ck.tensors)

    def geometry(self, layer: int | None = None, w13_form: str = E4M3_16, w2_form: str = E4M3_16) -> LayerGeometry:
        m = self.ckpt.model
        inputs = self.input_scales.get(layer, False) if layer is not None else False
        return LayerGeometry(m.n_routed_experts, m.hidden_size, m.moe_intermediate_size, w13_form, w2_form, inputs)

    @property
    def expert_delta_bytes(self) -> int:
        return self.geometry().expert_delta_bytes

    @property
    def total_delta_bytes(self) -> int:
        return len(self.served) * self.ckpt.model.n_routed_experts * self.expert_delta_bytes

    @property
    def total_mid_bytes(self) -> int:
        """Every served expert's mid tier (planes and tables): what a --mid-budget percentage is of."""
        return len(self.served) * self.ckpt.model.n_routed_experts * self.geometry().expert_mid_bytes

    def build_params(self, budget: int, profile_digest: str | None, mid_budget: int = 0) -> BuildParams:
        return BuildParams(tuple(self.served), self.opts.include_mtp, self.opts.lossless, budget, profile_digest,
                           BaseTable(self.opts.base_table), mid_budget)

    # --- a layer's files ---------------------------------------------------------------------------
    def layer_key(self, layer: int) -> str:
        key = {"v": FORMAT_VERSION, "src": self.fingerprint.to_dict(), "layout": self.ckpt.layout,
               "layer": layer, "lossless": self.opts.lossless, "input_scale": self.input_scales[layer],
               "format": self.formats[layer].name, "scale_forms": 2}
        # The table form is part of a layer's bytes: a rerun with another form rebuilds the layer (never a
        # cache of mixed forms). Named only when not fitted, so a fitted layer keeps the key it always had.
        if self.opts.base_table != BaseTable.FITTED:
            key["base_table"] = str(self.opts.base_table)
        return key_of(key)

    def dense_key(self, shard: str) -> str:
        return key_of({"v": FORMAT_VERSION, "src": self.fingerprint.to_dict(), "shard": shard,
                       "names": self.dense_by_shard[shard]})

    def scalar_kinds(self, layer: int) -> tuple[TensorKind, ...]:
        kinds = self.formats[layer].scalar_kinds
        return kinds if self.input_scales[layer] else tuple(k for k in kinds if k != TensorKind.INPUT_SCALE)

    def layer_specs(self, layer: int, geo: LayerGeometry) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """The base file's tensors and the --lossless delta file's (planes, then the source's scalars)."""
        E = geo.n_experts
        delta = geo.delta_specs()
        fmt = self.formats[layer]
        for proj in PROJECTIONS:
            for kind in self.scalar_kinds(layer):
                info = self.ckpt.tensors[self.ckpt.expert_names(layer, 0, proj, fmt)[kind]]
                delta.append(TensorSpec(L.source_scalar(proj, kind), info.dtype, (E, *info.shape)))
        return geo.base_specs(), delta


def served_layers(ck: Checkpoint, opts: BuildOptions) -> list[int]:
    """The layers that get planes: every MoE layer (and the MTP ones with include_mtp), or --layers."""
    m, fam = ck.model, ck.family
    main, mtp = list(fam.moe_layers), list(fam.mtp_layers)
    if not opts.layers:
        served = main + (mtp if opts.include_mtp else [])
    else:
        sel = parse_layer_selection(opts.layers)
        total = max([m.num_hidden_layers + m.num_nextn_predict_layers - 1, *mtp]) + 1
        beyond = sorted(i for i in sel if i >= total)
        if beyond:
            raise InputError(f"--layers names layer {beyond[0]}, but the model has layers 0-{total - 1}")
        if set(mtp) & sel and not opts.include_mtp:
            first = sorted(set(mtp) & sel)[0]
            raise InputError(f"--layers names the MTP layer {first} ({fam.layer_prefix(first)} of the source)",
                             "add --include-drafter (or --include-mtp) to build planes for drafter layers")
        served = sorted(sel & set(main + mtp))
        if not served:
            raise InputError(f"--layers {opts.layers} selects no MoE layer",
                             f"the MoE layers are {main[0]}-{main[-1]}" if main else "the model has no MoE layer")
    if not served:
        raise InputError("the model has no MoE layer to build planes for")
    return served


def make_plan(ck: Checkpoint, opts: BuildOptions) -> BuildPlan:
    fam = ck.family
    served = served_layers(ck, opts)
    ck.validate_experts(served)
    planed = ck.expert_tensor_names(served)
    omitted: set[str] = set()
    if not (opts.include_mtp or opts.lossless):
        omitted = {n for n in ck.tensors if fam.is_mtp(-1 if (x := fam.layer_of(n)) is None else x)}
    formats = {i: ck.layer_format(i) for i in served}
    dense_by_shard: dict[str, list[str]] = {}
    for name in sorted(ck.tensors):
        if name not in planed and name not in omitted:
            dense_by_shard.setdefault(ck.tensors[name].shard, []).append(name)
    return BuildPlan(ck, opts, served, {i: (LayerKind.MTP if fam.is_mtp(i) else LayerKind.MOE) for i in served}, omitted, planed,
                     formats, {i: ck.has_input_scales(i, formats[i]) for i in served}, dense_by_shard,
                     ck.fingerprint())
