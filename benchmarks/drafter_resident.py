"""The drafter's resident bytes: what the DSpark drafter's MoE layers hold on the device, as vLLM 0.34 builds them
with the moet method, against the plane bytes `plan` and `inspect` count for the drafter.

A synthetic DeepSeek-V4 with the DSpark drafter (three blocks mtp.0-2), its drafter experts V4-Flash wide (hidden
4096, experts 2048 wide; fewer experts, so that it builds in seconds), built into a cache with --include-drafter
and a tier. Its draft model's MoE layers are vLLM's FusedMoE under the `moet` quantization method, at the place and
prefix vLLM's DSpark draft model gives them (model.layers.K, built as layer num_hidden_layers + K:
vllm/models/deepseek_v4/nvidia/dspark.py), made on the device (create_weights), filled by the moet loader
(load_into_model) and laid out for the kernels (process_weights_after_loading). Figures, with the tier (the
loader's default; figures `with_tier_*`) and base-only (`base_only_*`):

  held_bytes        CUDA: torch.cuda.memory_allocated() after minus before (synchronized, collected, unused
                    blocks released); CPU: the layers' tensors' storages, each counted once, whole
  plane_bytes       the drafter's planes, scales and tables, plus its tier rows with the tier (plan's and
                    inspect's drafter figures: moet_cache/plan/measure.py, moet_cache/plan/drafter_vram.py)
  held_vs_planes    held_bytes / plane_bytes (goal: within 1%)
  tensor_bytes      the routed experts' tensors' storages (as held_bytes on the CPU); layer_bytes the same over
                    the whole FusedMoE layers (router and all); on CUDA also reserved_bytes, the allocator's reserve
                    after it released its unused blocks

    python benchmarks/drafter_resident.py --device cuda --json benchmarks/results/drafter-resident-h200.json

(`--json PATH` writes the figures with the command, commit, date and device: benchmarks/record.py.) Importable:
build(workdir, ...) -> cache folder, measure(cache, device, delta) -> dict.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vllm.triton_utils  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.fused_moe import FusedMoEFactory  # noqa: E402
from vllm.model_executor.layers.quantization import get_quantization_config  # noqa: E402

from benchmarks.record import envelope, write  # noqa: E402 (the repository root is on the path from here)
from moet_cache import BuildOptions, build_cache  # noqa: E402
from moet_cache.integrations.vllm.loader import PluginOptions, load_into_model  # noqa: E402
from moet_cache.integrations.vllm.plugin import register  # noqa: E402
from moet_cache.plan.measure import footprint_from_cache  # noqa: E402
from moet_cache.source.synthetic import dspark_v4_spec, make_v4_checkpoint  # noqa: E402

GOAL = 0.01  # held within 1% of the plane bytes
DELTAS = {"tier": "with_tier", "none": "base_only"}  # the loader's delta modes measured, by their figures' prefix


def build(workdir: Path, hidden: int = 4096, inter: int = 2048, experts: int = 16, budget: str = "25%") -> Path:
    """A DSpark V4 checkpoint (one main layer, three drafter blocks) and its cache with the drafter; the cache."""
    spec = dspark_v4_spec(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                          num_hidden_layers=1, q_lora_rank=256, o_lora_rank=128, head_dim=512, index_head_dim=128,
                          vocab_size=1024, shard_bytes=512 << 20, fast_codes=True, dense="bf16")
    src = make_v4_checkpoint(workdir / "checkpoint", spec)
    build_cache(src, workdir / "cache", BuildOptions(include_mtp=True, delta_budget=budget))
    return workdir / "cache"


class _DraftModel(nn.Module):
    """vLLM 0.34's DSparkDeepseekV4Model's place for the blocks' MoE: model.layers[K].ffn.experts. The dense
    tensors the loader hands its load_weights are counted, not kept (they are not the MoE's)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()
        self.dense = 0

    def load_weights(self, weights: Any) -> set[str]:
        names = {name for name, _ in weights}
        self.dense += len(names)
        return names


def draft_model(cache: Path, device: str) -> _DraftModel:
    """The drafter blocks' FusedMoE layers on `device` under the cache's `moet` method (create_weights runs)."""
    cfg = json.loads((cache / "model" / "config.json").read_text())
    qc = get_quantization_config("moet").from_config(cfg["quantization_config"])
    model = _DraftModel()
    with torch.device(device):
        for k in range(cfg["num_nextn_predict_layers"]):
            block = nn.Module()
            block.ffn = nn.Module()
            block.ffn.experts = FusedMoEFactory(
                num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"], hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["moe_intermediate_size"], params_dtype=torch.bfloat16, quant_config=qc,
                tp_size=1, dp_size=1, pcp_size=1, prefix=f"model.layers.{cfg['num_hidden_layers'] + k}.ffn.experts",
                swiglu_limit=cfg.get("swiglu_limit"))
            model.model.layers.append(block)
    return model


def storage_bytes(modules: list[nn.Module]) -> int:
    """The bytes the modules' tensors keep allocated: each storage once, whole (a view keeps its whole buffer)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for m in modules for t in (*m.parameters(), *m.buffers()) if t.numel()}
    return sum(storages.values())


def _settled(device: str) -> int:
    """CUDA's allocated bytes once freed tensors are gone and the allocator released its unused blocks; 0 on
    the CPU."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()
    return 0


def measure(cache: Path, device: str, delta: str = "tier", workers: int = 4) -> dict[str, Any]:
    """The drafter's MoE layers built, loaded and laid out on `device`; their held bytes against the plane bytes."""
    drafter = footprint_from_cache(cache).drafter
    if drafter is None or not drafter.planed:
        raise SystemExit(f"{cache} holds no drafter planes (build it with --include-drafter)")
    planes = drafter.expert_bytes + (drafter.tier_bytes if delta == "tier" else 0)
    register()
    had_triton = vllm.triton_utils.HAS_TRITON
    # vLLM's platform wants Triton on a CPU, where vLLM's CUDA build reports none; the layers built here run no
    # Triton (as in tests/test_vllm_quant.py)
    vllm.triton_utils.HAS_TRITON = had_triton or not device.startswith("cuda")
    try:
        with set_current_vllm_config(VllmConfig()):
            before = _settled(device)
            t0 = time.perf_counter()
            model = draft_model(cache, device)
            load_into_model(model, PluginOptions(cache=str(cache), workers=workers, delta=delta))
            experts = [block.ffn.experts.routed_experts for block in model.model.layers]
            for ex in experts:
                ex.quant_method.process_weights_after_loading(ex)
            seconds = time.perf_counter() - t0
            after = _settled(device)
    finally:
        vllm.triton_utils.HAS_TRITON = had_triton
    tensors = storage_bytes(experts)
    held = after - before if device.startswith("cuda") else tensors
    out = {"layers": len(experts), "experts_in_tier": drafter.tier_experts if delta == "tier" else 0,
           "plane_bytes": planes, "held_bytes": held, "tensor_bytes": tensors,
           "layer_bytes": storage_bytes([block.ffn.experts for block in model.model.layers]),
           "held_vs_planes": held / planes, "seconds": round(seconds, 3)}
    if device.startswith("cuda"):
        out["reserved_bytes"] = torch.cuda.memory_reserved()  # _settled released the unused blocks
    return out


def run(workdir: Path, device: str, hidden: int, inter: int, experts: int, budget: str,
        workers: int) -> dict[str, Any]:
    cache = build(workdir, hidden, inter, experts, budget)
    result: dict[str, Any] = {"device": device, "hidden": hidden, "inter": inter, "experts": experts,
                              "delta_budget": budget}
    goals = {}
    for delta, name in DELTAS.items():
        figures = measure(cache, device, delta, workers)
        result.update({f"{name}_{k}": v for k, v in figures.items()})
        goals[f"{name}_held_vs_planes"] = abs(figures["held_vs_planes"] - 1) <= GOAL
    result["goals_met"] = goals
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048, help="the experts' width (moe_intermediate_size)")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--delta-budget", default="25%")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--workdir", type=Path, help="where the checkpoint and cache are built (default: a temporary "
                    "folder, removed at the end)")
    ap.add_argument("--json", type=Path, help="write the figures as a results file (benchmarks/record.py)")
    args = ap.parse_args(argv)
    made = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="drafter-resident-")) if made else args.workdir
    try:
        result = run(workdir, args.device, args.hidden, args.inter, args.experts, args.delta_budget, args.workers)
    finally:
        if made:
            shutil.rmtree(workdir, ignore_errors=True)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    for key in DELTAS.values():
        print(f"{name}, drafter {key.replace('_', ' ')}: held {result[f'{key}_held_bytes']:,} B, planes "
              f"{result[f'{key}_plane_bytes']:,} B, held/planes {result[f'{key}_held_vs_planes']:.5f}"
              f" ({'within' if result['goals_met'][f'{key}_held_vs_planes'] else 'NOT within'} 1%)", flush=True)
    if args.json:
        write(args.json, envelope(["benchmarks/drafter_resident.py", *(argv if argv is not None else sys.argv[1:])],
                                  result, name))
        print(f"wrote {args.json}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
