"""Train the reference model on the Python documentation text (prepare_text.py), then write its FP4 checkpoints.

Bit for bit reproducible on a CPU: a fixed seed, one torch thread (recorded), deterministic ops, every
batch a function of (seed, step) alone, and a plain AdamW written out here whose state is saved as
safetensors (no pickle), so a killed run resumes from its last state to the same bytes. It also runs on
CUDA (--device cuda) for a bigger run; CUDA results are not bit-reproducible.

Schedule: full-precision (float32) training, then quantization-aware training of the routed experts in
MXFP4 (block 32, e8m0 scales; straight-through estimator) for the last --qat-fraction of the steps, as
DeepSeek-V4-Flash ships its experts. Written at the end (under --out):
  mxfp4/   the QAT model, routed experts MXFP4 (the ladder's main reference)
  nvfp4/   a post-training NVFP4 export (block 16, e4m3 scales, a global scale; ModelOpt layout) of the
           full-precision model as it stood when QAT began, as the V3/R1 NVFP4 releases are made
  train.json  the arguments, the seed, the thread count and each logged step's losses

    python benchmarks/quality_model/train.py --out benchmarks/data/quality_model
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quality_model.fp4export import mxfp4_fake, write_checkpoint  # noqa: E402
from quality_model.model import ModelSpec, RouterTrace, forward, init_dense, routed_from_weights  # noqa: E402

HERE = Path(__file__).resolve().parent


def batch(data: torch.Tensor, seed: int, step: int, size: int, seq: int) -> torch.Tensor:
    """[size, seq + 1] byte windows, a function of (seed, step) alone (so a resumed run sees the same)."""
    starts = np.random.default_rng([seed, step]).integers(0, len(data) - seq - 1, size=size)
    return torch.stack([data[s: s + seq + 1] for s in starts.tolist()]).long()


def balance_loss(trace: list[RouterTrace], experts: int) -> torch.Tensor:
    """Switch-style load balancing: E * sum_e (share of top-k slots) * (mean router probability)."""
    total = torch.zeros(())
    for t in trace:
        share = torch.bincount(t.topk_ids.reshape(-1), minlength=experts).float() / t.topk_ids.numel()
        total = total + experts * (share * t.probs.mean(0)).sum()
    return total / len(trace)


class AdamW:
    """Decoupled-weight-decay Adam over a dict of named tensors; state is three dicts of tensors."""

    def __init__(self, params: dict[str, torch.Tensor], betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1) -> None:
        self.params, self.betas, self.eps, self.wd = params, betas, eps, weight_decay
        self.m = {n: torch.zeros_like(p) for n, p in params.items()}
        self.v = {n: torch.zeros_like(p) for n, p in params.items()}

    @torch.no_grad()
    def step(self, lr: float, t: int) -> None:
        b1, b2 = self.betas
        for n, p in self.params.items():
            g = p.grad
            self.m[n].mul_(b1).add_(g, alpha=1 - b1)
            self.v[n].mul_(b2).addcmul_(g, g, value=1 - b2)
            if p.dim() > 1:
                p.mul_(1 - lr * self.wd)
            denom = (self.v[n] / (1 - b2 ** t)).sqrt_().add_(self.eps)
            p.addcdiv_(self.m[n], denom, value=-lr / (1 - b1 ** t))
            p.grad = None


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def expert_names(spec: ModelSpec) -> list[str]:
    return [f"experts.{i}.{w}" for i in range(spec.layers) for w in ("w13", "w2")]


def init_params(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = init_dense(spec, gen)
    E, I, H = spec.experts, spec.expert_width, spec.hidden
    for i in range(spec.layers):
        params[f"experts.{i}.w13"] = torch.randn((E, 2 * I, H), generator=gen) * 0.02
        params[f"experts.{i}.w2"] = torch.randn((E, H, I), generator=gen) * (0.02 / math.sqrt(2 * spec.layers))
    return params


def loss_of(params: dict[str, torch.Tensor], spec: ModelSpec, tokens: torch.Tensor, qat: bool,
            balance: float) -> tuple[torch.Tensor, torch.Tensor]:
    experts = [(mxfp4_fake(params[f"experts.{i}.w13"]), mxfp4_fake(params[f"experts.{i}.w2"])) if qat
               else (params[f"experts.{i}.w13"], params[f"experts.{i}.w2"]) for i in range(spec.layers)]
    runs = [routed_from_weights(w13, w2) for w13, w2 in experts]
    trace: list[RouterTrace] = []
    logits = forward(params, spec, tokens[:, :-1], lambda i, x, tw, ti: runs[i](x, tw, ti), trace)
    ce = F.cross_entropy(logits.reshape(-1, spec.vocab), tokens[:, 1:].reshape(-1))
    return ce, balance_loss(trace, spec.experts)


def save_state(path: Path, params: dict[str, torch.Tensor], opt: AdamW, step: int) -> None:
    tensors = {f"p/{n}": t.detach() for n, t in params.items()}
    tensors.update({f"m/{n}": t for n, t in opt.m.items()})
    tensors.update({f"v/{n}": t for n, t in opt.v.items()})
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata={"step": str(step)})
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description="train the reference MoE model")
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--qat-fraction", type=float, default=0.25)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--balance", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--stop-after", type=int, default=None,
                    help="leave after this many steps of this run (its state saved); the same command resumes")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--data", type=Path, default=HERE / "data")
    ap.add_argument("--out", type=Path, default=HERE.parent / "data" / "quality_model")
    for field in ("layers", "experts", "top_k", "expert_width", "hidden", "shared_width"):
        ap.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(ModelSpec(), field))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    spec = ModelSpec(layers=args.layers, experts=args.experts, top_k=args.top_k, expert_width=args.expert_width,
                     hidden=args.hidden, shared_width=args.shared_width)
    dev = torch.device(args.device)
    data = torch.from_numpy(np.frombuffer((args.data / "train.txt").read_bytes(), dtype=np.uint8).copy())
    held = torch.from_numpy(np.frombuffer((args.data / "eval-slice.txt").read_bytes(), dtype=np.uint8).copy())
    held_tokens = torch.stack([held[i * 257: i * 257 + 257] for i in range(8)]).long().to(dev)
    args.out.mkdir(parents=True, exist_ok=True)
    state_path, log_path = args.out / "state.safetensors", args.out / "train.json"
    params = {n: t.to(dev) for n, t in init_params(spec, args.seed).items()}
    for t in params.values():
        t.requires_grad_(True)
    opt = AdamW(params)
    start, log = 0, []
    if state_path.exists():  # resume: the same bytes as an unbroken run
        saved = load_file(str(state_path))
        with torch.no_grad():
            for n in params:
                params[n].copy_(saved[f"p/{n}"])
                opt.m[n].copy_(saved[f"m/{n}"])
                opt.v[n].copy_(saved[f"v/{n}"])
        with safe_open(str(state_path), "pt") as f:
            start = int(f.metadata()["step"])
        log = json.loads(log_path.read_text())["log"] if log_path.exists() else []
        log = [r for r in log if r["step"] < start]
    qat_from = int(round(args.steps * (1 - args.qat_fraction)))
    pre_qat = args.out / "pre-qat.safetensors"
    t0 = time.time()
    stop = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    for step in range(start, stop):
        if step == qat_from:
            save_file({n: t.detach().contiguous().cpu() for n, t in params.items()}, str(pre_qat))
        qat = step >= qat_from
        ce, bal = loss_of(params, spec, batch(data, args.seed, step, args.batch, args.seq).to(dev), qat, args.balance)
        (ce + args.balance * bal).backward()
        opt.step(lr_at(step, args.steps, args.lr, args.warmup), step + 1)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            with torch.no_grad():
                held_ce, _ = loss_of(params, spec, held_tokens, qat, 0.0)
            rec = {"step": step + 1, "train_ce": round(ce.item(), 4), "balance": round(bal.item(), 4),
                   "held_out_ce": round(float(held_ce), 4), "qat": qat,
                   "seconds": round(time.time() - t0, 1)}
            log.append(rec)
            print(json.dumps(rec), flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 in (args.steps, stop):
            save_state(state_path, params, opt, step + 1)
            log_path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                            "spec": spec.to_dict(), "torch": torch.__version__,
                                            "threads": torch.get_num_threads(), "qat_from_step": qat_from,
                                            "log": log}, indent=1) + "\n")
    if stop < args.steps:
        print(f"stopped after step {stop}; run the same command to go on", flush=True)
        return
    final = {n: t.detach().cpu() for n, t in params.items()}
    first = load_file(str(pre_qat)) if pre_qat.exists() else final
    for fmt, src in (("mxfp4", final), ("nvfp4", first)):
        dense = {n: t for n, t in src.items() if not n.startswith("experts.")}
        w13 = [src[f"experts.{i}.w13"] for i in range(spec.layers)]
        w2 = [src[f"experts.{i}.w2"] for i in range(spec.layers)]
        write_checkpoint(args.out / fmt, spec, dense, w13, w2, fmt)
    print(f"wrote {args.out / 'mxfp4'} and {args.out / 'nvfp4'}", flush=True)


if __name__ == "__main__":
    main()
