"""The quality ladder: what each way of storing the routed experts does to a real trained model's output.

On a CPU, one command, from the committed reference model (benchmarks/quality_model/: a small
DeepSeek-V3-style MoE trained on Python's documentation, MXFP4 by quantization-aware training, and an
NVFP4 post-training export):

    python benchmarks/quality.py                       # the full ladder: table, results/quality.json, .png
    python benchmarks/quality.py --short --json-only   # the CI version (tests/test_quality.py)
    python benchmarks/quality.py --mid-only            # the 3-bit mid tier's rows alone (results/quality-mid.json)

Each row is one variant of the routed experts; everything else (attention, norms, router, shared
expert, embeddings) is the model's own torch forward with the dense tensors the cache holds. The
`path` column says how the routed experts were computed:
  cache       `moet-cache build` of the checkpoint, the loader (open_cache ... Cache.load) and
              moet_cache.runtime.fused_moe for every routed expert: the real path
  cache+sel   the same, with the tier's experts chosen here (a policy the build does not offer) by
              taking their delta planes from a lossless cache's load
  sim         weights computed here from the cache's planes (forms the format does not hold: 3-bit,
              1-bit, per-block Lloyd codebooks), run by the same torch MoE sum
The metrics are against the FP4 model, decoded straight from the checkpoint (quality_model/metrics.py).
Each model's ladder runs in its own process, both at once (`run`, `worker_command`);
benchmarks/quality_compare.py says whether two runs' figures are the same.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from moet_cache.build import BuildOptions, build_cache
from moet_cache.load import open_cache
from moet_cache.cache.quality_curve import CURVE_FILE, CURVE_FORMAT, CURVE_VERSION, REFERENCE_MODELS, curve_from_dict
from moet_cache.runtime import fused_moe
from moet_cache.runtime.dequant import LayerPlanes, dequant_expert
from moet_cache.units import parse_size

import record
from quality_model.metrics import EvalSet, Reference, evaluate, reference
from quality_model.model import ModelSpec, forward
from quality_model.routed import routed_sum
from quality_model.reference import Checkpoint, read_checkpoint
from quality_model.variants import LayerCodes, form_weights, mixed_weights, sq_errors

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "quality_model"
CHECKPOINTS = HERE / "data" / "quality_model"   # the committed reference checkpoints
RESULTS = HERE / "results"
CURVE_PATH = HERE.parent / "moet_cache" / "cache" / CURVE_FILE

# DeepSeek-V4-Flash on the 96 GB preset: a 4.5 GB delta budget over 43 layers x 256 routed experts of
# hidden 4096 and expert width 2048, 2 bits a weight of delta plane per expert (3 projections).
V4_LAYERS, V4_EXPERTS, V4_HIDDEN, V4_WIDTH, V4_BUDGET = 43, 256, 4096, 2048, "4.5GB"


def v4_preset_fraction() -> float:
    per_expert = 3 * V4_HIDDEN * V4_WIDTH // 4
    return (parse_size(V4_BUDGET) // per_expert) / (V4_LAYERS * V4_EXPERTS)


# the default build's rows (fitted tables, the tier by squared weight error): the curve plan and inspect read
DEFAULT_SERIES = "tier by sq. weight error (the default)"
DEFAULT_BASE_ROW = "base only, fitted tables"
# the default build with a mid tier (--mid-budget, no --profile: the mid tier by the squared error its mid plane
# removes) over each default tier size: the mid tier's curve. A share is of the experts outside the 4-bit tier.
MID_SERIES = "tier + mid tier by sq. weight error (--mid-budget)"
MID_SHARES = (0.125, 0.25, 0.5, 1.0)
MIX_OF_ROW = re.compile(r"^tier (\d+)/(\d+) \+ mid (\d+)/(\d+): ")   # its row name: the tier and mid tier held

RoutedFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Row:
    name: str
    path: str
    bits: float                 # resident bits a routed-expert weight (planes, scales, tables, tier)
    series: str                 # the plot's line: rows of one policy or form at several sizes
    metrics: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "path": self.path, "series": self.series, "bits_per_weight": round(self.bits, 4),
                **{k: float(f"{v:.6g}") for k, v in self.metrics.items()}}


class Ladder:
    def __init__(self, ckpt_dir: Path, work: Path, ev: EvalSet, calib: EvalSet) -> None:
        self.ckpt_dir, self.work, self.ev = ckpt_dir, work, ev
        self.ckpt: Checkpoint = read_checkpoint(ckpt_dir)
        self.spec: ModelSpec = self.ckpt.spec
        s = self.spec
        self.expert_weights = 3 * s.hidden * s.expert_width           # weights of one expert
        self.total_weights = s.layers * s.experts * self.expert_weights
        self.rows: list[Row] = []
        ref_fns = [routed_sum(w13, w2) for w13, w2 in self.ckpt.experts]
        self.dense = self.ckpt.dense
        self.ref: Reference = reference(self.logits(lambda i, x, tw, ti: ref_fns[i](x, tw, ti)), ev)
        self.calib_trace = self._calibrate(ref_fns, calib)

    # --- plumbing ------------------------------------------------------------------------------------
    def logits(self, routed: RoutedFn) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda tokens: forward(self.dense, self.spec, tokens, routed)

    def _calibrate(self, ref_fns: list, calib: EvalSet) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per layer: the calibration tokens' MoE inputs, top-k weights and ids under the FP4 model."""
        seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

        def routed(i: int, x: torch.Tensor, tw: torch.Tensor, ti: torch.Tensor) -> torch.Tensor:
            seen.append((x, tw, ti))
            return ref_fns[i](x, tw, ti)
        with torch.no_grad():
            forward(self.dense, self.spec, calib.tokens[:, :-1], routed, [])
        return seen

    def routing_counts(self) -> torch.Tensor:
        """[L, E] top-k slots each expert took on the calibration text."""
        return torch.stack([torch.bincount(ti.reshape(-1), minlength=self.spec.experts).float()
                            for _, _, ti in self.calib_trace])

    def write_profile(self) -> Path:
        counts = self.routing_counts()
        path = self.work / "routing.json"
        path.write_text(json.dumps({"format": "moet-cache-routing-profile", "format_version": 1,
                                    "layers": [{"layer": i, "counts": [int(c) for c in counts[i].tolist()]}
                                               for i in range(self.spec.layers)]}) + "\n")
        return path

    def build(self, name: str, **options: object) -> Path:
        out = self.work / name
        build_cache(self.ckpt_dir, out, BuildOptions(**options))
        return out

    @staticmethod
    def load(cache: Path, delta: str) -> list[dict[str, torch.Tensor]]:
        # layers come as they complete, in any order
        loaded = {layer.index: layer.tensors for layer in open_cache(cache).load(device="cpu", delta=delta,
                                                                               verify="hash")}
        return [loaded[i] for i in sorted(loaded)]

    def measure(self, name: str, path: str, bits: float, routed: RoutedFn, routed_gen: RoutedFn | None = None,
                series: str | None = None) -> Row:
        t0 = time.perf_counter()
        row = Row(name, path, bits, series or name, evaluate(self.logits(routed), self.ev, self.ref,
                                             self.logits(routed_gen) if routed_gen else None))
        self.rows.append(row)
        print(f"  {self.ckpt_dir.name} {name:<48} {path:<9} {bits:6.3f}  kl {row.metrics['kl']:.5f}  "
              f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        return row

    # --- bytes ---------------------------------------------------------------------------------------
    def fixed_bits(self, layers: list[dict[str, torch.Tensor]]) -> float:
        """Block scales, tables and global scales, per weight (the same for every nested form)."""
        names = ("w13_weight_scale", "w2_weight_scale", "w13_table", "w2_table", "w13_weight_scale_2",
                 "w2_weight_scale_2")
        nbytes = sum(t[n].numel() * t[n].element_size() for t in layers for n in names)
        return nbytes * 8 / self.total_weights

    def tier_bits(self, experts: int, bits_each: int = 2) -> float:
        return experts * self.expert_weights * bits_each / self.total_weights

    def mid_bits(self, experts: int) -> float:
        """The mid tier of `experts` experts, per weight: a bit a weight, and 4 more table entries than the base
        table in each of its 3 tables (as the sim rows count a 3-bit expert)."""
        return self.tier_bits(experts, 1) + experts * 3 * 4 * 4 * 8 / self.total_weights

    @property
    def expert_mid_bytes(self) -> int:
        """What `build --mid-budget` counts for one expert: its mid planes and its three 8-entry tables."""
        return self.expert_weights // 8 + 3 * 8 * 4

    # --- rows through the cache ----------------------------------------------------------------------
    def cache_row(self, name: str, layers: list[dict[str, torch.Tensor]], path: str = "cache",
                  series: str | None = None) -> Row:
        """PPL, KL and top-1 through fused_moe on the loaded planes. The greedy continuation (N more
        forwards, each of which would dequantize every expert again in fused_moe's CPU path) runs on
        the weights the runtime's own dequant_expert makes of the same planes, once; how far the two
        routes' logits are apart on the scored text is recorded with the row (routes_max_abs_diff)."""
        tier = sum(int(t["delta_experts"].numel()) if "delta_experts" in t else 0 for t in layers)
        mid = sum(int(t["mid_experts"].numel()) if "mid_experts" in t else 0 for t in layers)
        bits = 2 + self.fixed_bits(layers) + self.tier_bits(tier) + self.mid_bits(mid)
        fns = [routed_sum(*dequantized(t)) for t in layers]

        def by_weights(i: int, x: torch.Tensor, tw: torch.Tensor, ti: torch.Tensor) -> torch.Tensor:
            return fns[i](x, tw, ti)

        def by_fused_moe(i: int, x: torch.Tensor, tw: torch.Tensor, ti: torch.Tensor) -> torch.Tensor:
            return fused_moe(x, layers[i], tw, ti)
        row = self.measure(name, path, bits, by_fused_moe, by_weights, series)
        with torch.no_grad():
            tokens = self.ev.tokens[:1, :-1]
            diff = (self.logits(by_fused_moe)(tokens) - self.logits(by_weights)(tokens)).abs().max()
        row.metrics["routes_max_abs_diff"] = float(diff)
        return row

    @staticmethod
    def with_tier(all_layers: list[dict[str, torch.Tensor]], chosen: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        """A delta="all" load cut down to the chosen experts' delta planes (the loader's delta="tier" form)."""
        out = []
        for t, ex in zip(all_layers, chosen):
            idx = torch.tensor(sorted(ex), dtype=torch.int64)
            cut = dict(t)
            cut["w13_delta"], cut["w2_delta"], cut["delta_experts"] = t["w13_delta"][idx], t["w2_delta"][idx], idx
            out.append(cut)
        return out

    def top_experts(self, value: torch.Tensor, n: int) -> list[list[int]]:
        """The n experts of highest value [L, E], across layers (every expert costs the same)."""
        order = torch.argsort(value.reshape(-1), descending=True, stable=True)[:n].tolist()
        E = self.spec.experts
        return [[k % E for k in order if k // E == i] for i in range(self.spec.layers)]

    def output_errors(self, codes: list[LayerCodes]) -> torch.Tensor:
        """[L, E] routing-weighted output error of each expert's base-only form on the calibration text:
        sum over its tokens of (top-k weight)^2 * ||y_FP4(x) - y_base(x)||^2."""
        out = torch.zeros(self.spec.layers, self.spec.experts)
        for i, (x, tw, ti) in enumerate(self.calib_trace):
            (f13, f2), (b13, b2) = form_weights(codes[i], "fp4"), form_weights(codes[i], "base")
            inter = self.spec.expert_width
            for e in range(self.spec.experts):
                tok, k = (ti == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                xs = x[tok]

                def y(w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
                    gu = xs @ w13[e].T
                    return (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ w2[e].T
                out[i, e] = ((tw[tok, k].unsqueeze(1) ** 2) * (y(f13, f2) - y(b13, b2)) ** 2).sum()
        return out

    def activation_weighted_errors(self, codes: list[LayerCodes]) -> torch.Tensor:
        """[L, E] each expert's base-only squared weight error, every input channel's weighted by the mean
        squared input it meets on the calibration text (as llama.cpp's imatrix weights its quantization
        error), each token's input counted by its top-k weight squared: for w13 the MoE input, for w2 the
        FP4 expert's own SwiGLU activations. The per-projection, diagonal approximation of the routed output
        error: it needs per-channel activation statistics a profile could record, not a forward at build."""
        out = torch.zeros(self.spec.layers, self.spec.experts)
        inter = self.spec.expert_width
        for i, (x, tw, ti) in enumerate(self.calib_trace):
            (f13, f2), (b13, b2) = form_weights(codes[i], "fp4"), form_weights(codes[i], "base")
            for e in range(self.spec.experts):
                tok, k = (ti == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                w = tw[tok, k].unsqueeze(1) ** 2
                xs = x[tok]
                gu = xs @ f13[e].T
                act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
                a13, a2 = (w * xs ** 2).sum(0), (w * act ** 2).sum(0)
                out[i, e] = ((f13[e] - b13[e]) ** 2 * a13).sum() + ((f2[e] - b2[e]) ** 2 * a2).sum()
        return out

    # --- rows computed here --------------------------------------------------------------------------
    def sim_row(self, name: str, bits: float, weights: list[tuple[torch.Tensor, torch.Tensor]],
                series: str | None = None) -> Row:
        fns = [routed_sum(w13, w2) for w13, w2 in weights]
        return self.measure(name, "sim", bits, lambda i, x, tw, ti: fns[i](x, tw, ti), series=series)


def mid_cache_row(lad: Ladder, n: int, profile: Path, lbl: str) -> Row:
    """The 3-bit mid tier as the cache holds it: `build --mid-budget` (n experts' bytes, --profile, no 4-bit
    tier, the build's default base tables as the sim rows' planes), the loader's delta="tier" and fused_moe."""
    cache = lad.build(f"mid-{n}", delta_budget="0", mid_budget=str(n * lad.expert_mid_bytes), profile=str(profile))
    return lad.cache_row(f"3-bit tier, {n} experts (bytes of tier {lbl}): build --mid-budget --profile",
                         lad.load(cache, "tier"), series="3-bit tier, the cache (--mid-budget --profile)")


def mix_row(lad: Ladder, n4: int, mid: int) -> Row:
    """The default build with a mid tier: `build --delta-budget` of n4 experts' delta planes and `--mid-budget`
    of `mid` experts' mid planes and tables (no --profile), the loader's delta="tier" and fused_moe. The row
    names the tier and mid tier the cache holds, as "tier N/M + mid K/R" (R: the experts outside the tier)."""
    layers = lad.load(lad.build(f"mix-{n4}-{mid}", delta_budget=str(n4 * (lad.expert_weights // 4)),
                                mid_budget=str(mid * lad.expert_mid_bytes)), "tier")
    total = lad.spec.layers * lad.spec.experts
    tier = sum(int(t["delta_experts"].numel()) if "delta_experts" in t else 0 for t in layers)
    held = sum(int(t["mid_experts"].numel()) if "mid_experts" in t else 0 for t in layers)
    return lad.cache_row(f"tier {tier}/{total} + mid {held}/{total - tier}: sq. weight error (--mid-budget)", layers,
                         series=MID_SERIES)


def mid_ladder(lad: Ladder, codes: list[LayerCodes], counts: torch.Tensor, profile: Path, fixed: float, lbl: str,
               n4: int) -> dict[str, object]:
    """--mid-only: the mid tier at the preset's bytes through the cache, and its sim row (the check)."""
    s = lad.spec
    form_cache = [{f: form_weights(lc, f) for f in ("base", "3bit", "fp4")} for lc in codes]
    weight = counts / counts.sum(1, keepdim=True) * s.experts        # the build's --profile weights
    errs = {f: torch.stack([sq_errors(lc, fc)[f] for lc, fc in zip(codes, form_cache)]) * weight
            for f in ("base", "3bit")}
    three = lad.top_experts(errs["base"] - errs["3bit"], 2 * n4)
    forms3 = [["3bit" if e in three[i] else "base" for e in range(s.experts)] for i in range(s.layers)]
    weights = [mixed_weights(lc, f, fc) for lc, f, fc in zip(codes, forms3, form_cache)]
    extra = sum(fl.count("3bit") for fl in forms3)
    sim = lad.sim_row(f"3-bit tier, {2 * n4} experts (bytes of tier {lbl})",
                      2 + fixed + lad.mid_bits(extra), weights,
                      "3-bit tier (sq. error x routing)")
    cache = mid_cache_row(lad, 2 * n4, profile, lbl)
    chosen = [sorted(t["mid_experts"].tolist()) for t in lad.load(lad.work / f"mid-{2 * n4}", "tier")]
    return {"rows": [r.to_dict() for r in lad.rows],
            "check_mid_sim_vs_cache_kl": [sim.metrics["kl"], cache.metrics["kl"]],
            "mid_experts_same_as_sim": chosen == [sorted(x) for x in three]}


def dequantized(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's float32 weights (w13 [E, 2I, H], w2 [E, H, I]) from a loaded layer's planes, by the
    runtime's dequant_expert: FP4 codes for the tier's experts, the table for the rest."""
    planes = LayerPlanes.from_tensors(tensors)
    rows = planes.tier_rows()
    pairs = [dequant_expert(planes, e, rows.get(e)) for e in range(planes.num_experts)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def mix_forms(values: dict[str, torch.Tensor], units: int) -> list[list[str]]:
    """Greedy 2/3/4-bit mix under `units` extra bit-planes (one unit: one more bit a weight of one expert):
    each step takes the largest error drop per unit (values: form -> [L, E] weighted squared error); an
    expert's 2-to-4 jump is weighed as its two units together, so a larger second step is not missed."""
    L, E = values["base"].shape
    forms = [["base"] * E for _ in range(L)]
    left = units
    heap: list[tuple[float, int, int, int]] = []

    def push(i: int, e: int) -> None:
        cur = forms[i][e]
        if cur == "base":
            g1 = float(values["base"][i, e] - values["3bit"][i, e])
            g2 = float(values["base"][i, e] - values["fp4"][i, e]) / 2
            heapq.heappush(heap, (-max(g1, g2), i, e, 1 if g1 >= g2 else 2))
        elif cur == "3bit":
            heapq.heappush(heap, (-float(values["3bit"][i, e] - values["fp4"][i, e]), i, e, 1))
    for i in range(L):
        for e in range(E):
            push(i, e)
    while heap and left > 0:
        gain, i, e, step = heapq.heappop(heap)
        if gain >= 0 or step > left:
            if step > left:   # a two-unit jump that no longer fits: take its first unit instead
                g1 = float(values["base"][i, e] - values["3bit"][i, e])
                if g1 > 0:
                    heapq.heappush(heap, (-g1, i, e, 1))
            continue
        forms[i][e] = {("base", 1): "3bit", ("base", 2): "fp4", ("3bit", 1): "fp4"}[(forms[i][e], step)]
        left -= step
        push(i, e)
    return forms


def run(args: argparse.Namespace) -> dict[str, object]:
    """Every model's ladder, each in its own process (`worker_command`), all at once: on 2 cores two
    models take the wall time of one."""
    out: dict[str, object] = {"v4_preset_tier_fraction": round(v4_preset_fraction(), 6),
                              "eval": {"sequences": args.sequences, "length": args.length, "prompts": args.prompts,
                                       "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                                       "calib_sequences": args.calib_sequences},
                              "models": {}}
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    procs = {fmt: subprocess.Popen(worker_command(fmt, args), stdout=subprocess.PIPE, text=True, env=env)
             for fmt in args.models}
    try:
        for fmt, proc in procs.items():
            stdout, _ = proc.communicate()
            if proc.returncode:
                raise SystemExit(f"the {fmt} ladder failed (exit {proc.returncode}); its error is printed above")
            out["models"][fmt] = json.loads(stdout)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def worker_command(fmt: str, args: argparse.Namespace) -> list[str]:
    """One model's ladder as a process of its own (`--worker`: its result as JSON on stdout).

    It keeps the asked torch thread count: the figures depend on it (a float sum split over threads rounds
    differently). OMP_WAIT_POLICY=PASSIVE (unless set: OpenMP reads it when torch loads) makes an idle
    OpenMP thread sleep instead of spin: on a CPU shared with other jobs, spinning threads make every
    parallel region wait out scheduler slices (measured: `--short` took 95 s wall and 29 s of CPU spinning
    under a load average of 6, 19 s and 3.6 s passive; the same figures)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--models", fmt,
           "--sequences", str(args.sequences), "--length", str(args.length), "--prompts", str(args.prompts),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
           "--calib-sequences", str(args.calib_sequences), "--threads", str(args.threads),
           "--checkpoints", str(args.checkpoints)]
    return cmd + (["--short"] if args.short else []) + (["--workdir", args.workdir] if args.workdir else [])


def model_ladder(args: argparse.Namespace) -> dict[str, object]:
    """The ladder of the one model in args.models, in this process (run's worker)."""
    torch.set_num_threads(args.threads)
    text = (MODEL_DIR / "data" / "eval-slice.txt").read_bytes()
    calib_text = (MODEL_DIR / "data" / "calib-slice.txt").read_bytes()
    ev = EvalSet.from_bytes(text, args.sequences, args.length, args.prompts, args.prompt_len, args.new_tokens)
    calib = EvalSet.from_bytes(calib_text, args.calib_sequences, args.length, 0, 1, 0)
    (fmt,) = args.models
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        print(f"{fmt}:", file=sys.stderr, flush=True)
        return ladder_for(args.checkpoints / fmt, Path(tmp), ev, calib, v4_preset_fraction(), args)


def ladder_for(ckpt_dir: Path, work: Path, ev: EvalSet, calib: EvalSet, preset: float,
               args: argparse.Namespace) -> dict[str, object]:
    lad = Ladder(ckpt_dir, work, ev, calib)
    s = lad.spec
    n_experts = s.layers * s.experts
    delta_bytes = n_experts * lad.expert_weights // 4

    def budget(frac: float) -> str:
        return str(int(round(frac * n_experts)) * (lad.expert_weights // 4))

    # the lossless caches: fitted tables (the build's default form; its planes and tables serve every
    # "cache+sel" and "sim" row) and x4 tables (the faster GPU decode's form)
    x4_lossless = lad.build("lossless-x4", lossless=True, base_table="x4")
    fitted = lad.build("lossless-fitted", lossless=True, base_table="fitted")
    fitted_all = lad.load(fitted, "all")
    codes = [LayerCodes.from_tensors(i, t) for i, t in enumerate(fitted_all)]
    # The cache's planes hold the checkpoint's FP4 values exactly (checked on the bytes loaded here).
    for (w13, w2), lc in zip(lad.ckpt.experts, codes):
        if not (torch.equal(lc.w13.fp4(), w13) and torch.equal(lc.w2.fp4(), w2)):
            raise SystemExit("the cache's planes do not decode to the checkpoint's FP4 values")
    fixed = lad.fixed_bits(fitted_all)
    profile = lad.write_profile()
    counts = lad.routing_counts()
    default_frac = preset
    fracs = [("preset", preset)] if args.short else [("5%", 0.05), ("10%", 0.10), ("preset", preset), ("25%", 0.25)]

    def label(tag: str, frac: float) -> str:
        n = int(round(frac * n_experts))
        return f"{n}/{n_experts}" + (" (V4 preset)" if tag == "preset" else f" ({tag})")

    if args.mid_only:
        return mid_ladder(lad, codes, counts, profile, fixed, label("preset", preset), int(round(preset * n_experts)))
    # the default cache: what `moet-cache build --delta-budget` writes at the preset's fraction
    default_cache = lad.build("default", delta_budget=budget(default_frac))
    form = open_cache(default_cache).base_table
    default_layers = lad.load(default_cache, "tier")
    default_row = lad.cache_row(f"default cache: {form} tables, tier {label('preset', default_frac)} by sq. error",
                                default_layers, series=DEFAULT_SERIES)
    if args.short:
        return {"rows": [r.to_dict() for r in lad.rows], "default_kl": default_row.metrics["kl"],
                "default_table_form": str(form)}

    lad.cache_row("FP4 (every delta plane)", lad.load(fitted, "all"))
    lad.cache_row("base only, fitted tables", lad.load(fitted, "none"))
    lad.cache_row("base only, x4 tables", lad.load(x4_lossless, "none"))
    out_err = lad.output_errors(codes)
    act_err = lad.activation_weighted_errors(codes)
    for tag, frac in fracs:
        n = int(round(frac * n_experts))
        if tag != "preset":
            lad.cache_row(f"tier {label(tag, frac)}: sq. weight error", lad.load(lad.build(f"sq-{tag}",
                          delta_budget=budget(frac)), "tier"), series=DEFAULT_SERIES)
        lad.cache_row(f"tier {label(tag, frac)}: sq. weight error, x4 tables",
                      lad.load(lad.build(f"sq-x4-{tag}", delta_budget=budget(frac), base_table="x4"), "tier"),
                      series="tier by sq. weight error, x4 tables")
        lad.cache_row(f"tier {label(tag, frac)}: sq. error x routing (--profile)",
                      lad.load(lad.build(f"prof-{tag}", delta_budget=budget(frac), profile=str(profile)), "tier"),
                      series="tier by sq. error x routing (--profile)")
        lad.cache_row(f"tier {label(tag, frac)}: routing frequency",
                      lad.with_tier(fitted_all, lad.top_experts(counts, n)), "cache+sel",
                      series="tier by routing frequency")
        lad.cache_row(f"tier {label(tag, frac)}: routed output error",
                      lad.with_tier(fitted_all, lad.top_experts(out_err, n)), "cache+sel",
                      series="tier by routed output error")
        lad.cache_row(f"tier {label(tag, frac)}: activation-weighted sq. error",
                      lad.with_tier(fitted_all, lad.top_experts(act_err, n)), "cache+sel",
                      series="tier by activation-weighted sq. error (imatrix-style)")

    for tag, frac in [("base", 0.0), *fracs]:
        n4 = int(round(frac * n_experts))
        for share in MID_SHARES:
            mix_row(lad, n4, int(round(share * (n_experts - n4))))

    # nested forms computed from the planes: 3-bit, mixes, 1-bit cold
    form_cache = [{f: form_weights(lc, f) for f in ("1bit", "base", "3bit", "fp4")} for lc in codes]
    weight = counts / counts.sum(1, keepdim=True) * s.experts        # the build's --profile weights
    errs = {f: torch.stack([sq_errors(lc, fc)[f] for lc, fc in zip(codes, form_cache)]) * weight
            for f in ("base", "3bit", "fp4", "1bit")}

    def weights_of(forms: list[list[str]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [mixed_weights(lc, f, fc) for lc, f, fc in zip(codes, forms, form_cache)]

    def bits_of(forms: list[list[str]]) -> float:
        extra = sum({"1bit": -1, "base": 0, "3bit": 1, "fp4": 2}[f] for fl in forms for f in fl)
        tables3 = sum(1 for fl in forms for f in fl if f == "3bit") * 3 * 4 * 4   # 4 more table entries
        return 2 + fixed + lad.tier_bits(extra, 1) + tables3 * 8 / lad.total_weights

    lad.sim_row("3-bit, every expert", 3 + fixed + 3 * s.experts * s.layers * 16 * 8 / lad.total_weights,
                weights_of([["3bit"] * s.experts for _ in range(s.layers)]))
    for tag, frac in fracs:
        n4 = int(round(frac * n_experts))
        three = lad.top_experts(errs["base"] - errs["3bit"], 2 * n4)
        forms3 = [["3bit" if e in three[i] else "base" for e in range(s.experts)] for i in range(s.layers)]
        lad.sim_row(f"3-bit tier, {2 * n4} experts (bytes of tier {label(tag, frac)})", bits_of(forms3),
                    weights_of(forms3), "3-bit tier (sq. error x routing)")
        if tag == "preset":
            mid_cache_row(lad, 2 * n4, profile, label(tag, frac))
        by_out = lad.top_experts(out_err, 2 * n4)
        forms3o = [["3bit" if e in by_out[i] else "base" for e in range(s.experts)] for i in range(s.layers)]
        lad.sim_row(f"3-bit tier by routed output error, {2 * n4} experts (bytes of tier {label(tag, frac)})",
                    bits_of(forms3o), weights_of(forms3o), "3-bit tier (routed output error)")
        mix = mix_forms(errs, 2 * n4)
        n3, nf = sum(fl.count("3bit") for fl in mix), sum(fl.count("fp4") for fl in mix)
        lad.sim_row(f"2/3/4 mix: {nf} at 4, {n3} at 3 (bytes of tier {label(tag, frac)})", bits_of(mix), weights_of(mix),
                    "2/3/4-bit mix (sq. error x routing)")
    tier_sets = [set(t["delta_experts"].tolist()) for t in default_layers]
    for cold_frac in (0.10, 0.30):
        cold = lad.top_experts(-counts + torch.tensor([[1e9 if e in tier_sets[i] else 0.0 for e in range(s.experts)]
                                                        for i in range(s.layers)]), int(round(cold_frac * n_experts)))
        forms = [["fp4" if e in tier_sets[i] else "1bit" if e in cold[i] else "base" for e in range(s.experts)]
                 for i in range(s.layers)]
        lad.sim_row(f"default + coldest {cold_frac:.0%} at 1 bit", bits_of(forms), weights_of(forms),
                    "default + coldest at 1 bit")
    # the same forms as the default cache, computed here: checks the sim path against the real one
    forms = [["fp4" if e in tier_sets[i] else "base" for e in range(s.experts)] for i in range(s.layers)]
    check = lad.sim_row("default cache, computed here (check)", bits_of(forms), weights_of(forms))
    # the non-nested baseline: per-block Lloyd codebooks at 2.25 / 2.5 bits a weight
    for block in (128, 64):
        weights = [(lc.w13.lloyd(block), lc.w2.lloyd(block)) for lc in codes]
        lad.sim_row(f"Lloyd 4-level codebook per {block} weights (not nested)", 2 + 32 / block, weights,
                    "Lloyd codebooks, not nested")
    return {"rows": [r.to_dict() for r in lad.rows], "default_kl": default_row.metrics["kl"],
            "default_table_form": str(form), "check_sim_vs_cache_kl": [default_row.metrics["kl"], check.metrics["kl"]],
            "delta_bytes_all_experts": delta_bytes}


def table(result: dict[str, object]) -> str:
    lines = []
    for fmt, res in result["models"].items():
        lines.append(f"\n{fmt} reference model (KL, top-1 and greedy against its FP4 model)\n")
        lines.append("| variant | path | bits/weight | PPL | KL | top-1 | greedy |")
        lines.append("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for r in res["rows"]:
            lines.append(f"| {r['name']} | {r['path']} | {r['bits_per_weight']:.3f} | {r['ppl']:.4f} | "
                         f"{r['kl']:.5f} | {r['top1']:.4f} | {r['greedy']:.3f} |")
    return "\n".join(lines)


def plot_line(row: dict[str, object]) -> str:
    """The plot's line a row is on: its series; the mid-tier rows, one line for each tier they are over."""
    m = MIX_OF_ROW.search(str(row["name"])) if row["series"] == MID_SERIES else None
    return f"mid tier over tier {m.group(1)}/{m.group(2)} (--mid-budget)" if m else str(row["series"])


def plot(result: dict[str, object], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, len(result["models"]), figsize=(8 * len(result["models"]), 6), squeeze=False)
    marks = {"cache": "o", "cache+sel": "s", "sim": "^"}
    for ax, (fmt, res) in zip(axes[0], result["models"].items()):
        series: dict[str, list[dict]] = {}
        for r in res["rows"]:
            if r["kl"] > 0 and "(check)" not in r["name"]:
                series.setdefault(plot_line(r), []).append(r)
        for name, rows in series.items():
            rows = sorted(rows, key=lambda r: r["bits_per_weight"])
            ax.plot([r["bits_per_weight"] for r in rows], [r["kl"] for r in rows], marker=marks[rows[0]["path"]],
                    label=f"{name} [{rows[0]['path']}]", linewidth=1, markersize=5)
        ax.set_yscale("log")
        ax.set_xlabel("resident bits per routed-expert weight (planes, scales, tables, tier)")
        ax.set_ylabel("mean KL(FP4 || variant), nats per byte")
        ax.set_title(f"{fmt} reference model: KL to FP4 against resident bytes")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    return True


# --- the curve `moet-cache plan` and `inspect` read (moet_cache/cache/quality_curve.py) ---------------------------

TIER_OF_ROW = re.compile(r"tier (\d+)/(\d+)")


def mid_curves_from_rows(ref: str, rows: list[dict], tier_points: list[dict[str, object]]) -> list[dict[str, object]]:
    """One model's mid curves: at each tier fraction of its 4-bit curve but 1, that tier's point (share 0) and
    the MID_SERIES rows over that tier, each at the share its "tier N/M + mid K/R" says (K/R)."""
    cols: dict[float, list[dict[str, object]]] = {p["fraction"]: [{"share": 0.0, "kl": p["kl"], "row": p["row"]}]
                                                  for p in tier_points if p["fraction"] != 1.0}
    for r in rows:
        if r["series"] != MID_SERIES:
            continue
        m = MIX_OF_ROW.search(r["name"])
        if m is None or r["path"] != "cache":
            raise SystemExit(f"{ref}: row {r['name']!r} does not say its tier and mid tier as N/M + mid K/R")
        frac = int(m.group(1)) / int(m.group(2))
        if frac not in cols:
            raise SystemExit(f"{ref}: row {r['name']!r} is over a tier the 4-bit curve has no point at")
        cols[frac].append({"share": int(m.group(3)) / int(m.group(4)), "kl": r["kl"], "row": r["name"]})
    return [{"fraction": f, "points": sorted(pts, key=lambda p: p["share"])} for f, pts in sorted(cols.items())]


def curve_from_results(result: dict, results: str, commit: str, command: str) -> dict[str, object]:
    """The quality curve of the default build from a full ladder's results: per reference model, the KL at
    tier 0 (base only, fitted tables), at each tier size chosen by squared weight error (the fraction read from
    the row's "tier N/M"), and at 1 (every delta plane: the FP4 model, whose measured KL is float rounding
    of an exact 0 and is written as 0); and the mid curves over those tiers (mid_curves_from_rows)."""
    curves: dict[str, list[dict[str, object]]] = {}
    mids: dict[str, list[dict[str, object]]] = {}
    forms = {result["models"][ref].get("default_table_form") for ref in REFERENCE_MODELS}
    if len(forms) != 1 or None in forms:
        raise SystemExit(f"the results do not name one base-table form of the default build: {forms}")
    for ref in REFERENCE_MODELS:
        rows = result["models"][ref]["rows"]
        by_name = {r["name"]: r for r in rows}
        fp4 = by_name["FP4 (every delta plane)"]
        if abs(fp4["kl"]) > 1e-6:
            raise SystemExit(f"{ref}: the FP4 row's KL is {fp4['kl']}, not 0: the results are not the FP4 model's")
        pts = {0.0: {"fraction": 0.0, "kl": by_name[DEFAULT_BASE_ROW]["kl"], "row": DEFAULT_BASE_ROW},
               1.0: {"fraction": 1.0, "kl": 0.0, "row": fp4["name"]}}
        for r in rows:
            if r["series"] == DEFAULT_SERIES and r["path"] == "cache":
                m = TIER_OF_ROW.search(r["name"])
                if m is None:
                    raise SystemExit(f"{ref}: row {r['name']!r} does not say its tier as N/M")
                frac = int(m.group(1)) / int(m.group(2))
                pts[frac] = {"fraction": frac, "kl": r["kl"], "row": r["name"]}
        curves[ref] = [pts[f] for f in sorted(pts)]
        mids[ref] = mid_curves_from_rows(ref, rows, curves[ref])
    doc = {"format": CURVE_FORMAT, "format_version": CURVE_VERSION, "table_form": forms.pop(),
           "tier_policy": "squared weight error (moet-cache build --delta-budget, no --profile)",
           "measure": "mean KL(FP4 || cache) of the next-byte distributions, nats a byte, "
                      f"{result['eval']['sequences']} held-out windows of {result['eval']['length']} bytes",
           "model": "the quality ladder's reference models (benchmarks/quality_model: a 4-layer DeepSeek-V3-style "
                    "MoE over bytes, 32 routed experts a layer, MXFP4 by QAT and an NVFP4 export; docs/QUALITY.md)",
           "results": results, "results_commit": commit, "command": command, "curves": curves,
           "mid_policy": "the squared error a mid plane removes, among the experts outside the tier (moet-cache "
                         "build --mid-budget, no --profile); a share is of those experts",
           "mid_curves": mids}
    curve_from_dict(doc, "the curve written")   # refuses what the loader would refuse
    return doc


def write_curve(results: Path, out: Path) -> None:
    """Write the curve from a results file, naming the commit that last recorded it."""
    rel = results.resolve().relative_to(HERE.parent).as_posix()
    commit = subprocess.run(["git", "log", "-1", "--format=%H", "--", rel], cwd=HERE.parent, capture_output=True,
                            text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", rel], cwd=HERE.parent,
                           check=False).returncode != 0
    if not commit or dirty:
        raise SystemExit(f"{rel} differs from its last commit: commit the results before writing the curve")
    doc = curve_from_results(json.loads(results.read_text())["result"], rel, commit, "python benchmarks/quality.py")
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} from {rel} at {commit[:12]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="the CI version: the default cache only, few tokens")
    ap.add_argument("--models", nargs="+", default=None, help="mxfp4 and/or nvfp4 (default: both; --short: mxfp4)")
    ap.add_argument("--sequences", type=int, default=None)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--calib-sequences", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each model's process")
    ap.add_argument("--checkpoints", type=Path, default=CHECKPOINTS, help="the folder holding mxfp4/ and nvfp4/")
    ap.add_argument("--workdir", default=None, help="where the caches are built (a temporary folder in it)")
    ap.add_argument("--json", type=Path, default=None, help="where to write the result (default results/quality.json)")
    ap.add_argument("--json-only", action="store_true", help="print the JSON result, no table or plot")
    ap.add_argument("--mid-only", action="store_true",
                    help="only the 3-bit mid tier at the V4 preset's bytes: its cache row (build --mid-budget, the "
                         "loader, fused_moe) and the sim row it must equal (default --json results/quality-mid.json)")
    ap.add_argument("--write-curve", action="store_true",
                    help="run nothing: write moet_cache/cache/quality_curve.json from the results (--json, default "
                         "results/quality.json) as last committed")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)   # run's per-model process
    args = ap.parse_args()
    if args.write_curve:
        write_curve(args.json or RESULTS / "quality.json", CURVE_PATH)
        return
    short = args.short
    args.models = args.models or (["mxfp4"] if short else ["mxfp4", "nvfp4"])
    args.sequences = args.sequences or (2 if short else 8)
    args.length = 128 if short and args.length == 256 else args.length
    args.prompts = args.prompts or (2 if short else 4)
    args.new_tokens = args.new_tokens or (8 if short else 16)
    args.calib_sequences = 4 if short and args.calib_sequences == 16 else args.calib_sequences
    if args.worker:
        print(json.dumps(model_ladder(args)))
        return
    t0 = time.perf_counter()
    result = run(args)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    # what a machine of its own would take: this process and the models' processes
    result["cpu_seconds"] = round(sum(u.ru_utime + u.ru_stime for u in usage), 1)
    if args.json_only:
        print(json.dumps(result, indent=1))
        return
    path = args.json or RESULTS / ("quality-mid.json" if args.mid_only else "quality.json")
    record.write(path, record.envelope(["benchmarks/quality.py", *sys.argv[1:]], result))
    print(table(result))
    plotted = plot(result, path.with_suffix(".png"))
    print(f"\nwrote {path}" + (f" and {path.with_suffix('.png')}" if plotted else "") + f" in {result['seconds']} s ({result['cpu_seconds']} s of CPU)")


if __name__ == "__main__":
    main()
