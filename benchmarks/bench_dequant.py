"""The CPU reference's cost against its plain definition, in the same process (ratio > 1: faster).

Figures, at DeepSeek-V4-Flash's expert dims (H 4096, I 2048) on a layer of --experts random experts (the
layer's expert count only sets its memory; the time is per routed expert):
  dequant_<kind>_ratio  plain dequantization of one expert (tests/plain_dequant.py: each code unpacked, looked
                        up through int64 indices, scales repeated) / runtime.dequant.dequant_expert, for a
                        base, a tier and a mid-tier expert (best of --repeat, each its own expert)
  reference_ratio       plain fused_moe_reference (fresh weights per expert) / runtime.reference's, on a
                        bf16 routing of --tokens tokens, top-6 (the outputs compared bit for bit)
  *_s                   the seconds behind each ratio; reference_experts: experts the routing takes

    python benchmarks/bench_dequant.py [--experts 16] [--tokens 7] [--threads 2] [--repeat 3] [--json]
    python benchmarks/record.py benchmarks/results/dequant-cpu.json -- python benchmarks/bench_dequant.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from moet_cache.runtime.dequant import LayerPlanes, dequant_expert
from moet_cache.runtime.reference import fused_moe_reference
from moet_cache.runtime.synthetic_layer import random_layer

# the plain definitions are the tests' (tests/plain_dequant.py), as fault_campaign.py takes its machinery
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from plain_dequant import plain_dequant_expert, plain_fused_moe_reference  # noqa: E402

H, I, K = 4096, 2048, 6


def _best(run: Callable[[int], object], args: list[int]) -> float:
    """The shortest of run(a)'s wall times over args."""
    times = []
    for a in args:
        start = time.perf_counter()
        run(a)
        times.append(time.perf_counter() - start)
    return min(times)


def run(experts: int, tokens: int, threads: int, repeat: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    n_tier = n_mid = max(repeat, experts // 4)
    planes = LayerPlanes.from_tensors(random_layer(experts, H, I, n_tier=n_tier, e8m0=False, device="cpu",
                                                   seed=1, n_mid=n_mid))
    rows, mids = planes.tier_rows(), planes.mid.rows()
    by_kind = {"tier": list(rows)[:repeat], "mid": list(mids)[:repeat],
               "base": [e for e in range(experts) if e not in rows and e not in mids][:repeat]}
    result: dict[str, Any] = {"experts": experts, "hidden": H, "inter": I, "threads": threads}
    for kind, picked in by_kind.items():
        plain = _best(lambda e: plain_dequant_expert(planes, e, rows.get(e)), picked)
        fast = _best(lambda e: dequant_expert(planes, e, rows.get(e)), picked)
        result.update({f"dequant_{kind}_plain_s": plain, f"dequant_{kind}_s": fast,
                       f"dequant_{kind}_ratio": plain / fast})
    g = torch.Generator().manual_seed(0)
    x = torch.randn((tokens, H), generator=g).to(torch.bfloat16)
    ids = torch.rand((tokens, experts), generator=g).topk(min(K, experts), dim=1).indices
    w = torch.rand(ids.shape, generator=g)
    start = time.perf_counter()
    want = plain_fused_moe_reference(x, planes, w, ids, 7.0)
    plain = time.perf_counter() - start
    start = time.perf_counter()
    got = fused_moe_reference(x, planes, w, ids, 7.0)
    fast = time.perf_counter() - start
    result.update({"tokens": tokens, "reference_experts": int(torch.unique(ids).numel()),
                   "reference_plain_s": plain, "reference_s": fast, "reference_ratio": plain / fast,
                   "reference_bits_equal": torch.equal(got.view(torch.int32), want.view(torch.int32))})
    return result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="end with the figures as one JSON object")
    a = ap.parse_args(argv)
    result = run(a.experts, a.tokens, a.threads, a.repeat)
    for k, v in result.items():
        print(f"{k:24} {v:.3f}" if isinstance(v, float) else f"{k:24} {v}")
    if a.json:
        print(json.dumps(result))
    return 0 if result["reference_bits_equal"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
