"""One DeepSeek-V4-Flash MoE layer (E 256, top-6, H 4096, I 2048) on the planes, against a bf16
grouped GEMM, Humming's MXFP4 and NVFP4 weight-only MoE and a device-to-device copy, all in one process.
Humming runs as vLLM runs it, with vLLM's own SwiGLU and weighted-sum kernels (`vllm_glue`; where vLLM does
not import, torch's, and the run says so), and again with torch's separate kernels, labelled "torch glue".

    python benchmarks/bench_moe.py --tokens 1,4,16,64,256,2048,4096 [--json benchmarks/results/moe-h200.json]
    python benchmarks/bench_moe.py --fidelity --json benchmarks/results/moe-fidelity.json   # CPU is enough
    python benchmarks/bench_moe.py --sweep --write-config --tokens 1,2,3,4,6,8,12,16,24,32,40,48,64,256,288,\
        320,512,1024,1536,2048,3072,4096    # the device's launch steps, moet_cache/runtime/configs/<device>.json
    python benchmarks/bench_moe.py --expert-parallel 2,4,8 --tokens 1,2,4,8,16,2048,4096 --harness write \
        --json benchmarks/results/moe-ep-h200.json    # a rank's µs a routed pair against the whole layer's

Every contender is captured in a CUDA graph (as vLLM runs decode) and timed three ways (`--harness`),
each a median, the weights always read from HBM:
  write   one layer a replay, triton.testing.do_bench: the L2 flushed by zeroing 256 MB before each
          replay, so the layer's first reads also write back the dirty lines the flush leaves;
  read    one layer a replay, the L2 flushed by reading 256 MB (clean lines, as attention leaves them);
  stream  layers back to back in one graph, as a decode step runs them: N copies of the call, each with
          the routing's experts relabeled onto experts no other copy touches (N = 8, fewer where the
          experts run out), so no copy finds its weights in the L2; the replay's time / N, no flush.
Bytes read: the planes/codes and scales of the distinct experts the routing touches (+ the tier's
delta planes of the tier experts touched). Speed is reported as ratios within one run and one harness.
The eight forms the vLLM method serves (x4 or fitted tables, e8m0 or e4m3 scales, base only or a 10%
tier) run in every harness, and the run ends with the runtime's goals read from them, form by form.
`--json PATH` writes every figure with the command, commit, date and device (benchmarks/record.py);
`--sweep` also times each candidate block of the four forms the launch steps are kept for, and
`--write-config [PATH]` turns that sweep into the device's steps (runtime/launch_config.py).
`--expert-parallel N,...` times only the fitted e8m0 form with a 10% tier, whole and as every rank of each N
(benchmarks/expert_parallel.py), in the harnesses given (on the CPU: the wall clock, at a small `--ep-layer`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the repository root is on the path from here
from benchmarks.expert_parallel import (RankTime, ep_figures, expert_map, pairs_of, print_table, rank_experts,
                                        rank_layer)
from benchmarks.record import envelope, write
from moet_cache.load.assemble import DELTA_EXPERTS
from moet_cache.runtime import fused_moe
from moet_cache.runtime.dequant import LayerPlanes
from moet_cache.runtime.padding import to_local
from moet_cache.runtime.synthetic_layer import random_layer
from moet_cache.runtime.warm_up import warm_up

E, TOPK, H, I = 256, 6, 4096, 2048
MiB = 1 << 20


@dataclass(frozen=True)
class Result:
    name: str
    tokens: int
    us: float
    bytes_read: int
    note: str = ""
    form: str = ""  # the served form this row times (the goals' rows), or "" for a sweep point or an extra

    @property
    def gbps(self) -> float:
        return self.bytes_read / (self.us * 1e-6) / 1e9


def _capture(fn: Callable[[], object]) -> Callable[[], object]:
    """fn's CUDA graph replay (warmed up on a side stream first, as torch asks)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def timed(fn: Callable[[], object], graph: bool = True) -> tuple[float, str]:
    """Median microseconds of fn by triton.testing.do_bench (harness write), replayed from a CUDA graph when
    it captures."""
    import triton.testing

    run, note = fn, "eager"
    if graph:
        try:
            run, note = _capture(fn), "graph"
        except Exception as e:  # noqa: BLE001 - a contender that cannot be captured is timed eagerly
            note = f"eager ({type(e).__name__})"
            torch.cuda.synchronize()
    ms = triton.testing.do_bench(run, warmup=25, rep=150, return_mode="median")
    return ms * 1000.0, note


def _median_us(run: Callable[[], object], before: Callable[[], object] | None, reps: int = 200) -> float:
    """Median microseconds of run() timed by events, with before() (untimed) ahead of each."""
    for _ in range(10):
        run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for a, b in zip(starts, ends):
        if before is not None:
            before()
        a.record()
        run()
        b.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
    return times[len(times) // 2] * 1000.0


def timed_read_flush(fn: Callable[[], object]) -> float:
    """Median microseconds of fn's graph replay, the L2 flushed by a 256 MB read before each (harness read)."""
    flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    sink = torch.empty((), dtype=torch.int64, device="cuda")
    return _median_us(_capture(fn), lambda: torch.sum(flush, dim=0, dtype=torch.int64, out=sink))


def timed_stream(fns: list[Callable[[], object]]) -> float:
    """Median microseconds a call of one graph that runs fns back to back, divided by len(fns) (harness
    stream)."""
    return _median_us(_capture(lambda: [f() for f in fns]), None) / len(fns)


def disjoint_routings(ids: torch.Tensor, most: int = 8, n_experts: int = E) -> list[torch.Tensor]:
    """Copies of ids whose distinct experts are relabeled onto experts no other copy uses (the same
    pattern of sharing between tokens): as many as `most`, fewer where the n_experts run out."""
    hit = torch.unique(ids)
    n = max(1, min(most, n_experts // hit.numel()))
    perm = torch.randperm(n_experts, generator=torch.Generator().manual_seed(ids.numel()))
    out = []
    for j in range(n):
        relabel = torch.full((n_experts,), -1, dtype=torch.int64)
        relabel[hit.cpu()] = perm[j * hit.numel():(j + 1) * hit.numel()]
        out.append(relabel.to(ids.device)[ids.long()].to(ids.dtype))
    return out


HARNESSES = ("write", "read", "stream")


def timed_routings(ids: torch.Tensor, harness: str, n_experts: int = E) -> list[torch.Tensor]:
    """The routings a harness times a layer call on: the stream's disjoint copies of ids, else ids alone."""
    return disjoint_routings(ids, n_experts=n_experts) if harness == "stream" else [ids]


def time_in(harness: str, fns: list[Callable[[], object]]) -> tuple[float, str]:
    """(us a layer, note) of the calls fns, one a routing of timed_routings, in one harness; `wall` (off
    CUDA): the median wall-clock time of fns[0]."""
    if harness == "stream":
        return timed_stream(fns), f"stream of {len(fns)}"
    if harness == "read":
        return timed_read_flush(fns[0]), "read flush"
    if harness == "wall":
        return timed_wall(fns[0]), "wall clock"
    return timed(fns[0])


def timed_wall(fn: Callable[[], object], reps: int = 5) -> float:
    """Median microseconds of fn() by the wall clock, after one untimed call (harness wall, the CPU's)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2] * 1e6


def measure(make: Callable[[torch.Tensor], Callable[[], object]], ids: torch.Tensor, harness: str,
            bytes_of: Callable[[torch.Tensor], int]) -> tuple[float, int, str]:
    """(us a layer, bytes a layer reads, note) of the call make(ids) builds, in one harness."""
    routings = timed_routings(ids, harness)
    us, note = time_in(harness, [make(r) for r in routings])
    return us, sum(bytes_of(r) for r in routings) // len(routings), note


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us, _ = timed(lambda: dst.copy_(src), graph=False)
    return 2 * n / (us * 1e-6) / 1e9


def routing(T: int, seed: int, n_experts: int = E, top_k: int = TOPK,
            device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    # int32, as vLLM's router hands them to the experts (fused_topk / grouped_topk)
    ids = torch.rand((T, n_experts), generator=g, device=device).topk(top_k, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.randn((T, top_k), generator=g, device=device), dim=1) * 1.5
    return w, ids


def plane(t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A plane or block-scale tensor by its loader name, or its twin in the kernels' layouts (plane_layout's
    X4 and TILED names)."""
    from moet_cache.runtime.plane_layout import PlaneLayout

    return t[PlaneLayout.of(t).names[name]]


def plane_bytes_per_expert(t: dict[str, torch.Tensor]) -> int:
    parts = [plane(t, n) for n in ("w13_base", "w2_base", "w13_weight_scale", "w2_weight_scale")]
    return sum(p[0].numel() * p.element_size() for p in parts)


def served_layer(t: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """t with its planes moved into the kernels' layout (copies: t's stay as they are) as the vLLM method does
    at load (runtime/layout.py: x4 or tiles), and the move's time in ms."""
    from moet_cache.runtime.layout import prepare_in_place
    from moet_cache.runtime.plane_layout import PLANE_TENSORS

    out = dict(t, **{n: t[n].clone() for n in PLANE_TENSORS if n in t})
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    names = prepare_in_place(out)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    assert names, "the plane kernels do not take this layer here"
    return {names.get(k, k): v for k, v in out.items()}, ms


def x4_layer(t: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """t as built with --base-table x4 (each table a * (1, 4, -1, -4), a from its first entry), served
    (served_layer: its planes repacked for the x4 decode); and the repack's time in ms."""
    from moet_cache.codec.planes import X4_PATTERN

    pattern = torch.as_tensor(X4_PATTERN, device=t["w13_table"].device)
    return served_layer(dict(t, w13_table=t["w13_table"][..., :1].abs() * pattern,
                             w2_table=t["w2_table"][..., :1].abs() * pattern))


def layer_bytes(t: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in t.values())


def bench_planes(name: str, t: dict[str, torch.Tensor], x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                 config=None, harness: str = "write", form: str = "") -> Result:
    from moet_cache.runtime.launch import config_for, fused_moe_cuda, layer_form

    planes = LayerPlanes.from_tensors(t)
    cfg = config or config_for(x.device)  # what the runtime runs on this device
    us, nbytes, note = measure(lambda i: lambda: fused_moe_cuda(x, planes, w, i, 10.0, cfg), ids, harness,
                               lambda i: bytes_read(t, i))
    picked = cfg.pick(ids.numel(), **layer_form(planes))
    return Result(name, x.shape[0], us, nbytes, f"{note}; {type(picked).__name__.lower()} {picked}", form)


def bytes_read(t: dict[str, torch.Tensor], ids: torch.Tensor) -> int:
    """The bytes a layer call reads: base planes and block scales of the distinct experts routed, and the
    delta planes of the tier experts among them."""
    hit = set(ids.reshape(-1).tolist())
    tier = set(t["delta_experts"].tolist()) if "delta_experts" in t else set()
    delta = plane(t, "w13_delta")[0].numel() + plane(t, "w2_delta")[0].numel() if tier else 0
    return len(hit) * plane_bytes_per_expert(t) + len(hit & tier) * delta


def bf16_moe(w13: torch.Tensor, w2: torch.Tensor) -> Callable:
    """A bf16 MoE through torch's grouped GEMM (CUTLASS on sm90): pairs sorted by expert, two GEMMs."""
    def run(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.int32, device=x.device).index_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xs = x[order // TOPK]
        h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
        a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
        out = torch.empty_like(y)
        out[order] = y
        return (out.view(T, TOPK, H).float() * w.unsqueeze(-1)).sum(1).to(x.dtype)
    return run


MXFP4 = {"dtype": "float4e2m1", "group_size": 32, "scale_dtype": "float8e8m0"}
#: NVFP4 as ModelOpt ships it (the V3 family): E2M1, e4m3 scales per 16, an fp32 scale per tensor: the peer
#: of our layers with e4m3 scales
NVFP4 = {"dtype": "float4e2m1", "group_size": 16, "scale_dtype": "float8e4m3", "scale_2_type": "tensor"}
INT2 = {"dtype": "int2", "group_size": 32}  # evenly spaced 2-bit levels, bf16 scale per 32


@dataclass(frozen=True)
class Glue:
    """What runs between and after Humming's two GEMMs: `swiglu(gate_up [m, 2I], act [m, I])` writes the SwiGLU
    into act; `weighted_sum(down [T, top_k, H], topk_weights, topk_ids, out [T, H])` returns each token's
    weighted sum of its top-k slots (into out, or a new tensor)."""

    name: str
    swiglu: Callable[[torch.Tensor, torch.Tensor], None]
    weighted_sum: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def torch_glue() -> Glue:
    """torch's silu and multiply, then a float32 multiply, sum and cast: separate kernels, which vLLM's Humming
    MoE does not run (this bench's Humming baseline before; kept as a second, labelled line)."""
    def swiglu(gate_up: torch.Tensor, act: torch.Tensor) -> None:
        n = act.shape[1]
        torch.mul(torch.nn.functional.silu(gate_up[:, :n]), gate_up[:, n:], out=act)

    def weighted_sum(down: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return (down.float() * w.unsqueeze(-1)).sum(1).to(out.dtype)
    return Glue("torch glue", swiglu, weighted_sum)


def vllm_glue() -> Glue | None:
    """vLLM's own glue, as its Humming MoE runs it (vllm-project/vllm, HummingIndexedExperts.main_apply in
    fused_moe's Humming experts): the silu_and_mul op (SiluAndMul's CUDA kernel) between the GEMMs, and
    moe_fused_mul_sum (one Triton kernel: the weights and the sum) after them. None where vLLM does not
    import here."""
    try:
        import vllm._custom_ops  # noqa: F401 - loads vllm._C, which registers torch.ops._C
        from vllm.model_executor.layers.fused_moe.moe_fused_mul_sum import moe_fused_mul_sum
    except ImportError:
        return None
    if not hasattr(torch.ops._C, "silu_and_mul"):
        return None

    def swiglu(gate_up: torch.Tensor, act: torch.Tensor) -> None:
        torch.ops._C.silu_and_mul(act, gate_up)

    def weighted_sum(down: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return moe_fused_mul_sum(inputs=down, topk_weights=w, outputs=out, topk_ids=ids)
    return Glue("vLLM's glue", swiglu, weighted_sum)


class Humming:
    """Humming's weight-only MoE (bf16 activations, indexed GEMM): MXFP4 (E2M1 codes, e8m0 scales per
    32), the FP4 peer; NVFP4 (e4m3 scales per 16 and one per tensor), the peer of e4m3-scaled layers; or
    int2, what an evenly spaced 2-bit table would run at."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, cfg: dict) -> None:
        from humming.config import GemmType
        from humming.layer import HummingLayer, HummingMethod

        self.method, self.gemm = HummingMethod, GemmType.INDEXED
        self.layers = []
        for weight in (w13, w2):
            n, k = weight.shape[1], weight.shape[2]
            layer = HummingLayer(shape_n=n, shape_k=k, num_experts=E, weight_config=dict(cfg),
                                 torch_dtype=torch.bfloat16).cuda()
            layer.load_from_unquantized(weight)
            layer.transform()
            self.layers.append(layer)
        self.tuning = [HummingMethod.get_default_tuning_configs(lay, gemm_type=GemmType.INDEXED)
                       for lay in self.layers]
        self.compute = json.dumps({"use_f16_accum": False, "gemm_type": "indexed"})

    def resident_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for lay in self.layers for p in lay.parameters())

    @staticmethod
    def _select(configs: list, m: int) -> dict:
        for lo, hi, c in configs:
            if lo < m <= hi:
                return c
        raise ValueError(f"no Humming config for {m} rows")

    def prepare(self, ids: torch.Tensor, glue: Glue) -> Callable:
        from humming.testing.data import generate_moe_tensors

        T = ids.shape[0]
        m = ids.numel()
        meta = []
        for tuning in self.tuning:
            bm = self._select(tuning, m)["block_shape"][0]
            _, _, sorted_ids, expert_ids, padded = generate_moe_tensors(ids.int(), E, "indexed", bm)
            meta.append((sorted_ids, expert_ids, padded))
        tunings = [json.dumps(t) for t in self.tuning]
        out13 = torch.empty((m, 2 * I), dtype=torch.bfloat16, device="cuda")
        act = torch.empty((m, I), dtype=torch.bfloat16, device="cuda")
        out2 = torch.empty((m, H), dtype=torch.bfloat16, device="cuda")
        y = torch.empty((T, H), dtype=torch.bfloat16, device="cuda")
        ids = ids.contiguous()

        def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            s, e, p = meta[0]
            self.method.forward_layer(layer=self.layers[0], inputs=x, outputs=out13, sorted_ids=s, expert_ids=e,
                                      num_tokens_padded=p, top_k=TOPK, valid_shape_m=m,
                                      compute_config=self.compute, tuning_config=tunings[0])
            glue.swiglu(out13, act)
            s, e, p = meta[1]
            self.method.forward_layer(layer=self.layers[1], inputs=act, outputs=out2, sorted_ids=s, expert_ids=e,
                                      num_tokens_padded=p, top_k=1, valid_shape_m=m,
                                      compute_config=self.compute, tuning_config=tunings[1])
            return glue.weighted_sum(out2.view(T, TOPK, H), w, ids, y)
        return run


def sweep_configs(T: int, triton: bool) -> list:
    """Candidates timed by --sweep: the tensor-core plane kernels at every T; with `triton`, also the
    Triton pairs kernels up to T = 16 and the Triton grouped ones from T = 4."""
    from moet_cache.runtime.launch import Config, Grouped, Mma, Pairs, Prefill
    out = []
    # the decode steps launch dependent (pdl); a plain launch of the first block shows what that buys
    if T <= 16:
        out += [Config.only(m) for m in (
            Mma(1, 2, 2, direct=True), Mma(1, 2, 2, direct=True, pdl=True), Mma(1, 2, 2, direct=True, lean=True, pdl=True),
            Mma(1, 2, 2, direct=True, pdl=True, sum_in_w2=True),
            Mma(1, 1, 1, direct=True, pdl=True), Mma(1, 4, 4, direct=True, pdl=True), Mma(1, 2, 1, direct=True, pdl=True),
            Mma(1, 2, 2), Mma(2, 2, 2))]
    elif T <= 256:
        out += [Config.only(m) for m in (
            Mma(1, 2, 2, direct=True, lean=True), Mma(1, 2, 2, direct=True, lean=True, pdl=True),
            Mma(1, 2, 2, lean=True, pdl=True), Mma(1, 2, 2), Mma(2, 2, 2), Mma(2, 4, 4), Mma(4, 1, 1))]
        out += [Config.only(Prefill(*b)) for b in ((4, 4, 2, True, 2), (2, 8, 4, True, 2), (4, 8, 4, True, 2))]
    else:
        out += [Config.only(Mma(*m)) for m in ((1, 2, 2), (4, 1, 1))] + [Config.only(Mma(1, 2, 2, lean=True, pdl=True))]
        # the H200's three steps first (runtime/configs/NVIDIA_H200.json), then the shapes they were chosen against
        out += [Config.only(Prefill(*b)) for b in ((4, 4, 2, True, 2), (8, 4, 2, True, 2), (16, 4, 2, True, 1),
                                                   (12, 4, 3, True, 1), (12, 4, 2, True, 2), (8, 4, 3, True, 2),
                                                   (4, 8, 4, True, 2), (8, 8, 3), (4, 8, 4))]
    if not triton:
        return out
    if T <= 16:
        out += [Config.only(Pairs(bn, bkw, wp)) for bn, bkw, wp in
                ((32, 16, 2), (64, 16, 4), (64, 8, 2), (128, 16, 4), (128, 16, 8))]
    if T >= 4:
        v1 = ((16, 64, 4, 4, 2), (32, 128, 4, 8, 3)) if T <= 256 else ((64, 128, 4, 8, 3), (128, 128, 4, 8, 3))
        v2 = ((16, 64, 16, 4, 2), (64, 128, 16, 8, 2)) if T <= 256 else \
            ((64, 128, 16, 8, 2), (128, 64, 16, 8, 2), (128, 128, 16, 8, 2))
        out += [Config.only(Grouped(*g, False)) for g in v1] + [Config.only(Grouped(*g, True)) for g in v2]
    return out


#: the served form each of the config's decode ladders (launch_config.DECODE_LADDERS) is swept on
SWEEP_FORMS = {"mma": "fitted e8m0 tier10%", "mma_x4": "x4 e8m0 tier10%", "mma_x4_base": "x4 e8m0 base-only",
               "mma_x4_e4m3": "x4 e4m3 tier10%"}


def only_block(cfg: object) -> object:
    """The one block a Config.only(block) runs (Mma or Prefill), None for a Triton one."""
    if cfg.prefill:
        return cfg.prefill[0][1]
    return cfg.mma[0][1] if cfg.mma else None


def humming_glues() -> tuple[Glue, ...]:
    """The glues Humming runs with: vLLM's first (the baseline) where vLLM imports, then torch's."""
    return tuple(g for g in (vllm_glue(), torch_glue()) if g is not None)


def humming_row(hname: str, glue: Glue, glues: tuple[Glue, ...]) -> str:
    """A Humming row's name: plain for the baseline glue (the goals read it), labelled for the others."""
    return hname if glue is glues[0] else f"{hname}, {glue.name}"


def speed(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)
    rows: list[dict] = []
    copy = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy {copy:.0f} GB/s (read + written)", flush=True)
    base0 = torch.cuda.memory_allocated()
    planes8 = random_layer(E, H, I, n_tier=26, e8m0=True, device="cuda", seed=1)
    resident8 = torch.cuda.memory_allocated() - base0
    planes4 = random_layer(E, H, I, n_tier=26, e8m0=False, device="cuda", seed=2)
    none8 = {k: v for k, v in planes8.items() if k not in ("w13_delta", "w2_delta", "delta_experts")}
    none4 = {k: v for k, v in planes4.items() if k not in ("w13_delta", "w2_delta", "delta_experts")}
    print(f"MoE VRAM, one layer: planes e8m0 + 10% tier {layer_bytes(planes8) / MiB:.1f} MiB "
          f"(allocated {resident8 / MiB:.1f} MiB), base only {layer_bytes(none8) / MiB:.1f} MiB; "
          f"planes e4m3 base only {layer_bytes(none4) / MiB:.1f} MiB", flush=True)
    rows.append({"what": "vram", "planes_e8m0_tier_MiB": layer_bytes(planes8) / MiB,
                 "allocated_MiB": resident8 / MiB, "planes_e8m0_base_MiB": layer_bytes(none8) / MiB,
                 "planes_e4m3_base_MiB": layer_bytes(none4) / MiB, "copy_GBps": copy})
    first_ms = x4_layer(planes8)[1]  # a process's first repack also compiles the bit-move kernel (NVRTC)
    x4_8, ms = x4_layer(planes8)
    fitted8, tile_ms = served_layer(planes8)
    print(f"at load, a layer's planes and scales (10% tier) take {ms:.1f} ms to repack for x4 (a process's "
          f"first: {first_ms:.1f} ms with the kernel's compile), {tile_ms:.1f} ms to tile (fitted tables)", flush=True)
    rows.append({"what": "x4_repack_ms_per_layer", "ms": ms, "first_ms": first_ms})
    rows.append({"what": "tile_ms_per_layer", "ms": tile_ms})
    # the eight forms the vLLM method serves (x4 or fitted tables, e8m0 or e4m3 scales, base only or a 10%
    # tier), each laid out as it lays them out: timed in every harness, the goals read from them
    layers = {"x4 e8m0 base-only": x4_layer(none8)[0], "x4 e8m0 tier10%": x4_8,
              "x4 e4m3 base-only": x4_layer(none4)[0], "x4 e4m3 tier10%": x4_layer(planes4)[0],
              "fitted e8m0 base-only": served_layer(none8)[0], "fitted e8m0 tier10%": fitted8,
              "fitted e4m3 base-only": served_layer(none4)[0], "fitted e4m3 tier10%": served_layer(planes4)[0]}
    g = torch.Generator(device="cuda").manual_seed(3)
    w13 = (torch.randn((E, 2 * I, H), generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    w2 = (torch.randn((E, H, I), generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    bf16 = bf16_moe(w13, w2)
    glues = humming_glues()
    print(f"Humming's baseline: {glues[0].name}" + ("" if glues[0].name == "vLLM's glue" else
          " (vLLM does not import here: the baseline pays torch's separate kernels, which vLLM's Humming MoE "
          "does not)"), flush=True)
    rows.append({"what": "humming_glue", "glue": glues[0].name})
    hums: dict[str, tuple[Humming, int]] = {}
    for hname, hcfg, bits in (("humming mxfp4", MXFP4, 4.25), ("humming nvfp4", NVFP4, 4.5),
                              ("humming int2", INT2, 2.5)):
        try:
            t0 = time.time()
            hums[hname] = (Humming(w13, w2, hcfg), int(3 * H * I * bits / 8))
            res_mib = hums[hname][0].resident_bytes() / MiB
            print(f"{hname} resident {res_mib:.1f} MiB (set up in {time.time() - t0:.1f} s)", flush=True)
            rows.append({"what": "vram", hname: res_mib})
        except Exception as e:  # noqa: BLE001 - report and go on without it
            print(f"{hname} unavailable: {type(e).__name__}: {str(e)[:300]}", flush=True)
    sweep: dict[str, list] = {name: [] for name in SWEEP_FORMS}  # (pairs, block, µs) by ladder
    for T in args.tokens:
        w, ids = routing(T, 10 + T)
        x = (torch.randn((T, H), device="cuda") * 0.5).to(torch.bfloat16)
        for harness in args.harness:
            rows += speed_at(args, harness, T, x, w, ids, copy, layers, none8, bf16, hums, glues, sweep)
    print_goals(rows, copy)
    if args.write_config is not None:
        write_config(args, sweep)
    return rows


def write_config(args: argparse.Namespace, sweep: dict[str, list]) -> None:
    """The sweep's fastest blocks as this device's launch steps (launch_config.steps_from_sweep), written where
    launch.config_for finds them unless --write-config names another file."""
    from moet_cache.runtime import launch_config

    device = torch.cuda.get_device_name()
    path = Path(args.write_config) if args.write_config else \
        launch_config.CONFIG_DIR / launch_config.device_file_name(device)
    steps = launch_config.steps_from_sweep(sweep)
    made = envelope(["benchmarks/bench_moe.py", *sys.argv[1:]], None, device)
    source = f"{' '.join(made['command'])} at commit {made['commit']}, {made['date']}, harness {args.harness[0]}"
    launch_config.write(path, steps, device, source)
    print(f"wrote the launch steps for {device} to {path}", flush=True)


#: the swiglu_limit every layer call here runs with (V4-Flash's)
SWIGLU_LIMIT = 10.0
#: a rank's output off the whole layer's by more than this (relative to its largest value) is not bf16
#: rounding (the GPU kernels' tolerance against the reference, tests/test_runtime_gpu.py)
BF16_TOLERANCE = 1.5e-2


def layer_call(layer: dict[str, torch.Tensor], x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
               emap: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """The layer's call as the vLLM method's `apply` makes it: runtime.fused_moe on the router's ids, mapped
    first through the rank's expert map where it has one (another rank's expert -1, skipped)."""
    if emap is None:
        return lambda: fused_moe(x, layer, w, ids, swiglu_limit=SWIGLU_LIMIT)
    return lambda: fused_moe(x, layer, w, to_local(ids, emap), swiglu_limit=SWIGLU_LIMIT)


def expert_parallel_speed(args: argparse.Namespace) -> list[dict]:
    """--expert-parallel: the whole synthetic layer (served form fitted e8m0 tier10%, the build's default for
    MXFP4) and every rank of each N, at each T and in each harness (on the CPU: the wall clock), in one
    process; each rank's output checked first against the whole layer's with the other ranks' pairs
    skipped. Rows: `ep_whole`, `ep_rank` (us, the pairs it computes, us a pair, that check: the largest
    difference over the whole layer's largest value) and `ep` (the ratios, benchmarks/expert_parallel.py)."""
    n_experts, top_k, hidden, inter = args.ep_layer
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    harnesses = args.harness if cuda else ["wall"]
    n_tier = round(n_experts * 0.1)
    natural = random_layer(n_experts, hidden, inter, n_tier=n_tier, e8m0=True, device=device, seed=1)

    def served(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return served_layer(t)[0] if cuda else t  # the plane kernels' layout exists on CUDA only

    whole = served(natural)
    # every kernel the layer launches, compiled first as the vLLM method does at load (none off CUDA): the
    # first timed call does not pay it, and the ranks' layers find them compiled
    warm_up(LayerPlanes.from_tensors(whole))
    print(f"expert parallel on {torch.cuda.get_device_name() if cuda else 'the CPU'}: a layer of {n_experts} "
          f"experts, top-{top_k}, hidden {hidden}, width {inter}, {n_tier} in the tier (fitted e8m0); "
          f"N = {', '.join(map(str, args.expert_parallel))}; vLLM's linear placement", flush=True)
    rows: list[dict] = [{"what": "ep_layer", "experts": n_experts, "top_k": top_k, "hidden": hidden,
                         "inter": inter, "tier": n_tier, "form": "fitted e8m0 tier10%", "placement": "linear"}]
    inputs = {}
    for T in args.tokens:
        w, ids = routing(T, 10 + T, n_experts, top_k, device)
        x = (torch.randn((T, hidden), generator=torch.Generator(device=device).manual_seed(T), device=device)
             * 0.5).to(torch.bfloat16)
        inputs[T] = (x, w, ids)
    whole_time: dict[tuple[str, int], RankTime] = {}
    for T, (x, w, ids) in inputs.items():
        for harness in harnesses:
            routings = timed_routings(ids, harness, n_experts)
            us, note = time_in(harness, [layer_call(whole, x, w, r) for r in routings])
            t = whole_time[harness, T] = RankTime(None, us, sum(pairs_of(r) for r in routings) / len(routings))
            rows.append({"what": "ep_whole", "harness": harness, "tokens": T, "us": us, "pairs": t.pairs,
                         "us_per_pair": t.us_per_pair, "note": note})
    for n in args.expert_parallel:
        rank_time: dict[tuple[str, int], list[RankTime]] = {}
        for rank in range(n):
            emap = expert_map(n, rank, n_experts, device)
            layer = served(rank_layer(natural, rank_experts(emap)))
            worst = 0.0
            for T, (x, w, ids) in inputs.items():
                got = layer_call(layer, x, w, ids, emap)()
                want = layer_call(whole, x, w, torch.where(emap[ids.long()] >= 0, ids, -1))()
                diff = float((got.float() - want.float()).abs().max()) / max(float(want.float().abs().max()), 1e-30)
                worst = max(worst, diff)
                for harness in harnesses:
                    routings = timed_routings(ids, harness, n_experts)
                    us, note = time_in(harness, [layer_call(layer, x, w, r, emap) for r in routings])
                    t = RankTime(rank, us, sum(pairs_of(r, emap) for r in routings) / len(routings))
                    rank_time.setdefault((harness, T), []).append(t)
                    rows.append({"what": "ep_rank", "harness": harness, "tokens": T, "ep": n, "rank": rank,
                                 "experts": int((emap >= 0).sum()), "us": us, "pairs": t.pairs,
                                 "us_per_pair": t.us_per_pair, "rel_diff_vs_whole": diff, "note": note})
            differs = " DIFFERS beyond bf16 rounding" if worst > BF16_TOLERANCE else ""
            print(f"  N={n} rank {rank}: {int((emap >= 0).sum())} experts, "
                  f"{int(layer[DELTA_EXPERTS].numel())} in the tier; output against the whole layer's with "
                  f"the other ranks' pairs skipped: at most {worst:.2e} of its largest value{differs}", flush=True)
            del layer
        for (harness, T), ranks in rank_time.items():
            rows.append({"what": "ep", "harness": harness, "tokens": T, "ep": n,
                         **ep_figures(whole_time[harness, T], ranks)})
    print_table(rows)
    return rows


def speed_at(args: argparse.Namespace, harness: str, T: int, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
             copy: float, layers: dict[str, dict[str, torch.Tensor]], untiled: dict[str, torch.Tensor],
             bf16: Callable, hums: dict[str, tuple["Humming", int]], glues: tuple[Glue, ...],
             sweep: dict[str, list] | None = None) -> list[dict]:
    """Every contender at T tokens in one harness: printed, and the rows for --json. `layers` (the served
    forms) run in every harness; `untiled` (a fitted layer in the loader's natural layout, through the
    plane kernels and through Triton), the bf16 MoE and Humming's int2 in do_bench's only. Each Humming
    runs with each of `glues`: the first is the baseline (its row named plainly), the others labelled. With
    --sweep, each candidate block's time on each of SWEEP_FORMS' layers goes into `sweep` by ladder as well."""
    from moet_cache.runtime.launch import Config

    rows: list[dict] = []
    res: list[Result] = []
    if args.sweep and harness == args.harness[0]:
        for cfg in sweep_configs(T, args.sweep_triton):
            block = only_block(cfg)
            for ladder, form in SWEEP_FORMS.items():
                try:
                    r = bench_planes(f"sweep {form} {cfg}", layers[form], x, w, ids, cfg)
                    print(f"  T={T} {form:20s} {r.us:9.1f} us {r.gbps:7.0f} GB/s  {block or cfg}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"  T={T} {form} config failed {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                rows.append({"what": "sweep", "form": form, "tokens": T, "pairs": ids.numel(), "us": r.us,
                             "block": repr(block or cfg)})
                if block is not None and sweep is not None:
                    sweep[ladder].append((ids.numel(), block, r.us))
    for name, layer in layers.items():
        res.append(bench_planes(f"planes {name}", layer, x, w, ids, None, harness, form=name))
    if harness == "write":
        res.append(bench_planes("planes fitted e8m0 base-only untiled", untiled, x, w, ids, None, harness))
        res.append(bench_planes("planes fitted e8m0 base-only, Triton", untiled, x, w, ids,
                                Config(mma=(), prefill=()), harness))

    def experts(i: torch.Tensor) -> int:
        return len(set(i.reshape(-1).tolist()))

    if harness == "write":
        try:
            us, note = timed(lambda: bf16(x, w, ids))
            res.append(Result("bf16 grouped_mm", T, us, experts(ids) * 3 * H * I * 2, note))
        except Exception as e:  # noqa: BLE001
            print(f"  bf16 failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    for hname, (hum, per_expert) in hums.items():
        if harness != "write" and hname == "humming int2":
            continue
        for glue in glues:
            name = humming_row(hname, glue, glues)
            try:
                def make(i: torch.Tensor, hum: Humming = hum, glue: Glue = glue) -> Callable[[], object]:
                    run = hum.prepare(i, glue)
                    return lambda: run(x, w)
                us, nbytes, note = measure(make, ids, harness, lambda i, pe=per_expert: experts(i) * pe)
                res.append(Result(name, T, us, nbytes, note))
            except Exception as e:  # noqa: BLE001
                print(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    hit = experts(ids)
    ref = {r.name: r.us for r in res}
    for r in res:
        vs_h = ref.get("humming mxfp4", float("nan")) / r.us
        vs_n = ref.get("humming nvfp4", float("nan")) / r.us
        vs_b = ref.get("bf16 grouped_mm", float("nan")) / r.us
        print(f"{harness:6s} T={T:5d} experts={hit:3d} {r.name:36s} {r.us:9.1f} us {r.gbps:7.0f} GB/s "
              f"{100 * r.gbps / copy:5.1f}% copy  x{vs_h:5.2f} vs humming  x{vs_n:5.2f} vs nvfp4  "
              f"x{vs_b:5.2f} vs bf16  [{r.note}]", flush=True)
        rows.append({"what": "speed", "harness": harness, "name": r.name, "tokens": T, "experts": hit, "us": r.us,
                     "GBps": r.gbps, "copy_frac": r.gbps / copy, "speedup_vs_humming": vs_h,
                     "speedup_vs_humming_nvfp4": vs_n, "speedup_vs_bf16": vs_b, "note": r.note, "form": r.form})
    return rows


#: the runtime's goals (docs/RUNTIME.md): decode (T <= 16) at least 1.3x Humming MXFP4's speed and 50% of copy
#: bandwidth on the bytes read; prefill (T = 2048, the v4-flash-96g preset's chunk, and 4096) within 1.25x
#: Humming's time; resident MoE bytes within 1% of the planes. Humming is timed as vLLM runs it (vllm_glue)
#: where vLLM imports.
DECODE_MAX_T, DECODE_SPEEDUP, DECODE_COPY, PREFILL_TS, PREFILL_SLOWDOWN, RESIDENT_TOL = \
    16, 1.3, 0.5, (2048, 4096), 1.25, 0.01


def print_goals(rows: list[dict], copy: float) -> None:
    """The goals, form by form, from the speed rows of the served forms (those with a `form`) in each
    harness: a table of (x Humming MXFP4, % of copy) with `!` where a goal is missed, then the misses
    counted."""
    speed = [r for r in rows if r["what"] == "speed" and r.get("form")]
    forms = list(dict.fromkeys(r["form"] for r in speed))
    glue = next((r["glue"] for r in rows if r["what"] == "humming_glue"), "unknown glue")
    prefill = " and ".join(str(t) for t in PREFILL_TS)
    print(f"\ngoals: decode T <= {DECODE_MAX_T} >= {DECODE_SPEEDUP}x Humming MXFP4 and >= {100 * DECODE_COPY:.0f}% "
          f"of copy ({copy:.0f} GB/s); prefill T = {prefill} <= {PREFILL_SLOWDOWN}x Humming's time; Humming with "
          f"{glue}; '!' marks a miss", flush=True)
    missed: dict[str, list[str]] = {}
    checked = 0
    mark = {True: " ", False: "!"}
    for harness in dict.fromkeys(r["harness"] for r in speed):
        print(f"{harness:6s} T     " + "".join(f"{f:>22s}" for f in forms), flush=True)
        for T in sorted({r["tokens"] for r in speed if r["harness"] == harness}):
            cells = []
            for f in forms:
                r = next((r for r in speed if (r["harness"], r["tokens"], r["form"]) == (harness, T, f)), None)
                if r is None:
                    cells.append(f"{'-':>22s}")
                    continue
                x = r["speedup_vs_humming"]
                if T <= DECODE_MAX_T:
                    fast, full = x >= DECODE_SPEEDUP, r["copy_frac"] >= DECODE_COPY
                elif T in PREFILL_TS:
                    fast, full = x >= 1 / PREFILL_SLOWDOWN, True
                else:
                    fast = full = True  # no goal between decode and the prefill chunks
                checked += T <= DECODE_MAX_T or T in PREFILL_TS
                for ok, goal in ((fast, "speed"), (full, "copy")):
                    if not ok:
                        missed.setdefault(f"{harness} {goal}", []).append(f"{f} T={T}")
                cells.append(f"{x:6.2f}x{mark[fast]} {100 * r['copy_frac']:5.1f}%{mark[full]}")
            print(f"{harness:6s} {T:<5d} " + "".join(f"{c:>22s}" for c in cells), flush=True)
    vram = next((r for r in rows if r["what"] == "vram" and "allocated_MiB" in r), None)
    if vram is not None:
        off = abs(vram["allocated_MiB"] / vram["planes_e8m0_tier_MiB"] - 1)
        print(f"resident MoE bytes: {vram['allocated_MiB']:.1f} MiB allocated for {vram['planes_e8m0_tier_MiB']:.1f} "
              f"MiB of planes ({100 * off:.2f}% off: {'met' if off <= RESIDENT_TOL else 'MISSED'})", flush=True)
    for key, where in missed.items():
        print(f"missed ({key}): {len(where)}: {', '.join(where)}", flush=True)
    if not checked:
        print(f"no speed goal checked: no T <= {DECODE_MAX_T} or T = {prefill} timed", flush=True)
    elif not missed:
        print(f"every speed goal met ({checked} form, T and harness points)", flush=True)


def fidelity(args: argparse.Namespace) -> list[dict]:
    """Layer output error against the FP4 layer: base only, a uniform tier, a routing-weighted tier."""
    import tempfile

    import numpy as np

    from moet_cache import BuildOptions, build_cache, make_checkpoint, small_spec
    from moet_cache.load import open_cache

    e, k = 64, 6
    spec = small_spec(hidden_size=512, moe_intermediate_size=256, n_routed_experts=e, num_experts_per_tok=k,
                      num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=0,
                      intermediate_size=512, shard_bytes=64 << 20)
    rng = np.random.default_rng(0)
    pop = rng.lognormal(0.0, args.skew, size=e)  # expert popularity: a skewed (not a balanced) router
    pop = pop / pop.sum()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src = make_checkpoint(Path(tmp) / "src", spec)
        layer = 1
        profile = Path(tmp) / "profile.json"
        counts = (pop * 100000).astype(int).tolist()
        profile.write_text(json.dumps({"format": "moet-cache-routing-profile", "format_version": 1,
                                       "layers": [{"layer": layer, "counts": counts}]}))
        build_cache(src, Path(tmp) / "uni", BuildOptions(lossless=True, delta_budget="10%", base_table="fitted"))
        build_cache(src, Path(tmp) / "wtd", BuildOptions(lossless=True, delta_budget="10%", base_table="fitted",
                                                         profile=str(profile)))
        build_cache(src, Path(tmp) / "x4", BuildOptions(lossless=True, delta_budget="10%", profile=str(profile),
                                                        base_table="x4"))
        T = 256
        g = torch.Generator().manual_seed(1)
        x = torch.randn((T, spec.hidden_size), generator=g)
        ids = torch.from_numpy(np.stack([rng.choice(e, size=k, replace=False, p=pop) for _ in range(T)]))
        w = torch.softmax(torch.randn((T, k), generator=g), dim=1) * 1.5
        outs, shares = {}, {}
        for name, cache, delta in (("fp4", "uni", "all"), ("base-only", "uni", "none"),
                                   ("uniform tier 10%", "uni", "tier"), ("routing-weighted tier 10%", "wtd", "tier"),
                                   ("x4 tables, base-only", "x4", "none"),
                                   ("x4 tables, routing-weighted tier 10%", "x4", "tier")):
            c = open_cache(Path(tmp) / cache)
            t = next(x_.tensors for x_ in c.load(device="cpu", delta=delta, layers=[layer], workers=1))
            outs[name] = fused_moe(x, t, w, ids, swiglu_limit=10.0)
            if delta == "tier":
                tier = set(t["delta_experts"].tolist())
                share = shares[name] = float(np.isin(ids.numpy(), list(tier)).mean())
                print(f"{name}: {len(tier)} experts in the tier, {100 * share:.1f}% of routed pairs", flush=True)
        ref = outs["fp4"]
        for name, out in outs.items():
            if name == "fp4":
                continue
            rel = ((out - ref).norm() / ref.norm()).item()
            print(f"fidelity {name:36s} rel. error vs FP4 layer {rel:.4f}", flush=True)
            rows.append({"what": "fidelity", "name": name, "rel_error_vs_fp4": rel, "skew": args.skew,
                         "pairs_in_tier": shares.get(name, 0.0)})
    return rows


def sizes(text: str) -> tuple[int, ...]:
    """A comma-separated list of whole numbers (an argparse type)."""
    return tuple(int(v) for v in text.split(","))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,4,16,64,256,2048,4096", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--harness", default="write,stream", type=lambda s: s.split(","),
                    help=f"comma-separated, of {', '.join(HARNESSES)} (see the module's docstring)")
    ap.add_argument("--sweep", action="store_true", help="also time the block-size candidates (planes)")
    ap.add_argument("--sweep-triton", action="store_true", help="with --sweep: the Triton kernels' candidates too")
    ap.add_argument("--fidelity", action="store_true", help="only the fidelity figures (CPU is enough)")
    ap.add_argument("--skew", type=float, default=1.0, help="fidelity: sigma of the lognormal expert popularity")
    ap.add_argument("--expert-parallel", type=sizes, metavar="N,...",
                    help="only the expert-parallel figures: the whole layer against every rank of each N (e.g. "
                         "2,4,8), µs a routed pair and their ratio (the CPU runs it at a small --ep-layer)")
    ap.add_argument("--ep-layer", type=sizes, default=(E, TOPK, H, I), metavar="E,K,H,I",
                    help=f"with --expert-parallel: the synthetic layer's experts, top-k, hidden size and expert "
                         f"width (default V4-Flash's {E},{TOPK},{H},{I})")
    ap.add_argument("--json", type=Path, metavar="PATH",
                    help="write every figure here, with the command, commit, date and device (a results file)")
    ap.add_argument("--write-config", nargs="?", const="", metavar="PATH",
                    help="with --sweep: write the sweep's fastest blocks as this device's launch steps "
                         "(default: moet_cache/runtime/configs/<device>.json)")
    args = ap.parse_args()
    if unknown := set(args.harness) - set(HARNESSES):
        ap.error(f"unknown harness {', '.join(sorted(unknown))}: choose from {', '.join(HARNESSES)}")
    if args.write_config is not None and (not args.sweep or args.fidelity):
        ap.error("--write-config writes what --sweep measured: give --sweep (and not --fidelity)")
    if args.expert_parallel:
        if args.fidelity or args.sweep or args.write_config is not None:
            ap.error("--expert-parallel times the layer alone: give it without --fidelity, --sweep, --write-config")
        if len(args.ep_layer) != 4:
            ap.error("--ep-layer takes four numbers: experts, top-k, hidden size, expert width")
        if any(not 2 <= n <= args.ep_layer[0] for n in args.expert_parallel):
            ap.error(f"--expert-parallel: each N from 2 to the layer's {args.ep_layer[0]} experts")
    rows = fidelity(args) if args.fidelity else expert_parallel_speed(args) if args.expert_parallel else speed(args)
    if args.json:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.fidelity else "cpu"
        write(args.json, envelope(["benchmarks/bench_moe.py", *sys.argv[1:]], rows, device))


if __name__ == "__main__":
    main()
