"""Serve a verified cache with vLLM: named settings profiles, the `vllm serve` command, and its checks.

The command is built from a profile (docs/SERVING.md), the cache's loader and parser flags, then the
user's flags after `--`, which replace the profile's. When vLLM is installed, every flag is checked
against that version's own argument parser (run in vLLM's interpreter, so vLLM need not share our
environment) and known renames are adapted. Targets vLLM 0.34 (pinned in docs/SERVING.md).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import layout as L
from .errors import EnvironmentProblem, InputError, MissingDependencyError, VerificationError

if TYPE_CHECKING:
    from .verifier import VerifyReport

VLLM_PIN = "0.34.0"
INSTALL_HINT = f"install it with: pip install vllm=={VLLM_PIN}"
PARSER_NAME = "moet_deepseek"
PARSER_MODULE = "moet_cache.vllm_parsers"
LOAD_FORMAT = "moet"
PROBE_MARK = "MOET_CACHE_PROBE "
PROBE_TIMEOUT_S = 300

# Flags vLLM renamed: old spelling -> new spelling (the direction taken when the installed vLLM has only one).
RENAMES: dict[str, str] = {
    "--cuda-graph-sizes": "--cudagraph-capture-sizes",
}


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    flags: tuple[tuple[str, tuple[str, ...]], ...]
    env: tuple[tuple[str, str], ...] = ()


# The field report's single-GPU settings (RTX PRO 6000, 96 GB): see docs/SERVING.md for each flag.
PROFILES: dict[str, Profile] = {
    "single-gpu-96g": Profile(
        "single-gpu-96g",
        "The field report's settings: one 96 GB GPU, 260K context, fp8_ds_mla KV, 4 CUDA-graph sizes, "
        "no speculative decoding, thinking on.",
        (
            ("--tensor-parallel-size", ("1",)),
            ("--gpu-memory-utilization", ("0.96",)),
            ("--max-model-len", ("260000",)),
            ("--kv-cache-dtype", ("fp8_ds_mla",)),
            ("--block-size", ("256",)),
            ("--cudagraph-capture-sizes", ("1", "2", "4", "8")),
            ("--default-chat-template-kwargs", ('{"thinking": true}',)),
        ),
    ),
    "eager-debug": Profile(
        "eager-debug",
        "For debugging the loader: no CUDA graphs, 32K context, bf16 KV cache, thinking on.",
        (
            ("--tensor-parallel-size", ("1",)),
            ("--gpu-memory-utilization", ("0.90",)),
            ("--max-model-len", ("32768",)),
            ("--kv-cache-dtype", ("auto",)),
            ("--enforce-eager", ()),
            ("--default-chat-template-kwargs", ('{"thinking": true}',)),
        ),
    ),
}
DEFAULT_PROFILE = "single-gpu-96g"


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise InputError(f"unknown settings profile {name!r}", f"use one of {', '.join(PROFILES)}")
    return PROFILES[name]


# --- flags ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptionInfo:
    dest: str
    nargs: Any          # argparse's nargs: None (one value), 0, "?", "*", "+", or a count


@dataclass(frozen=True)
class OptionTable:
    """vLLM's own `vllm serve` options, as its argument parser defines them."""

    version: str
    python: str
    options: dict[str, OptionInfo]

    def lookup(self, opt: str) -> OptionInfo | None:
        return self.options.get(opt) or self.options.get(_dashes(opt))


@dataclass(frozen=True)
class Flag:
    option: str
    values: tuple[str, ...]

    def argv(self) -> list[str]:
        return [self.option, *self.values]


def _dashes(opt: str) -> str:
    # vLLM's FlexibleArgumentParser accepts --max_model_len for --max-model-len.
    return "--" + opt[2:].replace("_", "-") if opt.startswith("--") else opt


def _is_option(tok: str) -> bool:
    if not tok.startswith("-") or tok in ("-", "--"):
        return False
    try:
        float(tok)
        return False  # a negative number is a value
    except ValueError:
        return True


def split_flags(args: list[str], table: OptionTable | None = None) -> list[Flag]:
    """Group tokens into flags and their values (by vLLM's nargs when known; else up to the next flag)."""
    out: list[Flag] = []
    i = 0
    while i < len(args):
        tok = args[i]
        if not _is_option(tok):
            raise InputError(f"unexpected value {tok!r} among the vLLM flags",
                             "serve sets the model itself; pass only flags after --")
        opt, eq, inline = tok.partition("=")
        opt = _dashes(opt)
        i += 1
        if eq:
            out.append(Flag(opt, (inline,)))
            continue
        info = table.lookup(opt) if table else None
        values: list[str] = []
        if info is not None and (info.nargs == 0 or isinstance(info.nargs, int)):
            n = info.nargs
            values, i = list(args[i:i + n]), i + n
        elif info is not None and info.nargs in (None, "?"):
            if i < len(args) and not _is_option(args[i]):
                values, i = [args[i]], i + 1
        else:
            while i < len(args) and not _is_option(args[i]):
                values.append(args[i])
                i += 1
        out.append(Flag(opt, tuple(values)))
    return out


def _key(flag: Flag, table: OptionTable | None) -> str:
    info = table.lookup(flag.option) if table else None
    if info is not None:
        return info.dest
    opt = flag.option
    return "--" + opt[5:] if opt.startswith("--no-") else opt  # --no-X and --X set the same thing


def adapt_renames(flags: list[Flag], table: OptionTable | None) -> tuple[list[Flag], list[str]]:
    """Spell renamed flags the way the installed vLLM (or, without one, the pinned vLLM) knows them."""
    out, notes = [], []
    back = {new: old for old, new in RENAMES.items()}
    for f in flags:
        opt = f.option
        if opt in RENAMES and (table is None or (not table.lookup(opt) and table.lookup(RENAMES[opt]))):
            notes.append(f"{opt} is now {RENAMES[opt]}; renamed")
            opt = RENAMES[opt]
        elif opt in back and table is not None and not table.lookup(opt) and table.lookup(back[opt]):
            notes.append(f"vLLM {table.version} knows {opt} as {back[opt]}; renamed")
            opt = back[opt]
        out.append(Flag(opt, f.values))
    return out, notes


def merge_flags(base: list[Flag], overrides: list[Flag], table: OptionTable | None) -> list[Flag]:
    """The base flags with each one the overrides also set replaced in place; new ones appended."""
    over = {_key(f, table): f for f in overrides}
    if any(f.option in ("--compilation-config", "-O") and "cudagraph_capture_sizes" in " ".join(f.values)
           for f in overrides):  # vLLM refuses both spellings of the capture sizes at once
        base = [f for f in base if f.option != "--cudagraph-capture-sizes"]
    out, used = [], set()
    for f in base:
        k = _key(f, table)
        if k in over:
            if k not in used:
                out.append(over[k])
                used.add(k)
        else:
            out.append(f)
    for f in overrides:
        k = _key(f, table)
        if k not in used:
            out.append(over[k])  # the last of repeated flags wins, as in argparse
            used.add(k)
    return out


def check_known(flags: list[Flag], table: OptionTable) -> None:
    """Every flag must be one the installed vLLM's parser defines; an unknown one is named."""
    for f in flags:
        if table.lookup(f.option) is None:
            near = difflib.get_close_matches(f.option, list(table.options), n=1)
            raise InputError(f"vLLM {table.version} has no flag {f.option}",
                             f"did you mean {near[0]}?" if near else "see `vllm serve --help`")


# --- vLLM's own parser, in vLLM's own interpreter ------------------------------------------------------

_PROBE = r'''
import contextlib, io, json, sys
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.common.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
import vllm
p = make_arg_parser(FlexibleArgumentParser())
opts = {}
for a in p._actions:
    for o in a.option_strings:
        opts[o] = {"dest": a.dest, "nargs": a.nargs}
M = "MOET_CACHE_PROBE "
print(M + json.dumps({"version": vllm.__version__, "options": opts}), flush=True)
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
        return OptionTable(str(doc["version"]), self.python, opts)

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


# --- the command ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeCommand:
    argv: tuple[str, ...]               # argv[0] is the vllm executable (or "vllm" when not installed)
    env_added: tuple[tuple[str, str], ...]
    cache: str
    profile: str
    boot_state: str
    vllm: str | None                    # path of the vllm executable, None when not installed
    vllm_version: str | None            # the version whose parser checked the flags
    flags_checked: bool
    warnings: tuple[str, ...]
    notes: tuple[str, ...]
    plan_fits: bool | None = None       # None: no GPU seen, or no plan
    gpu: str | None = None

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env_added)
        return (env + " " if env else "") + shlex.join(self.argv)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(dict(self.env_added))
        return env


def parser_plugin_path() -> str | None:
    """The file of moet_cache.vllm_parsers, found without importing it (it imports vLLM)."""
    spec = importlib.util.find_spec(PARSER_MODULE)
    return str(Path(spec.origin).resolve()) if spec and spec.origin else None


def _served_name(cache: Path) -> str:
    from .verifier import read_committed_manifest
    try:
        m = read_committed_manifest(cache)
    except InputError:
        m = None
    name = Path(m.source_path).name if m and m.source_path else ""
    return name or cache.resolve().name


def integration_flags(cache: Path, verify_hash: bool, warnings: list[str]) -> list[Flag]:
    """The loader, the parsers and the served name: what makes vLLM read this cache."""
    extra: dict[str, Any] = {"cache": str(cache.resolve())}
    if verify_hash:
        extra["verify"] = "hash"
    flags = [Flag("--load-format", (LOAD_FORMAT,)),
             Flag("--model-loader-extra-config", (json.dumps(extra),)),
             Flag("--served-model-name", (_served_name(cache),))]
    plugin = parser_plugin_path()
    if plugin is None:
        warnings.append(f"{PARSER_MODULE} is not installed: vLLM's own parsers apply, not this project's")
    else:
        flags += [Flag("--reasoning-parser", (PARSER_NAME,)), Flag("--reasoning-parser-plugin", (plugin,)),
                  Flag("--tool-call-parser", (PARSER_NAME,)), Flag("--tool-parser-plugin", (plugin,)),
                  Flag("--enable-auto-tool-choice", ())]
    return flags


def _env_added(profile: Profile) -> list[tuple[str, str]]:
    env = list(profile.env)
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and "moet_cache" not in [p.strip() for p in plugins.split(",")]:
        # VLLM_PLUGINS limits which general plugins load; our loader is one of them.
        env.append(("VLLM_PLUGINS", ",".join(p for p in [plugins.strip(), "moet_cache"] if p)))
    return env


def check_boot(cache: Path, force: bool, warnings: list[str]) -> VerifyReport:
    """Refuse an incomplete, stale or corrupt cache (unless forced); warn about an unverified one."""
    # Imported here: the verifier pulls in safetensors, and `moet-cache --help` should not.
    from .verifier import CORRUPT, INCOMPLETE, STALE, UNVERIFIED, boot_check
    r = boot_check(cache)
    if r.state in (INCOMPLETE, STALE, CORRUPT):
        what = "; ".join(p.describe() for p in r.problems[:3])
        if not force:
            raise VerificationError(f"{cache}: the cache is {r.state_text} ({what})",
                                    "run `moet-cache verify` and `moet-cache build` to repair it, "
                                    "or --force to serve it anyway", list(r.problems))
        warnings.append(f"serving a cache that is {r.state_text} because of --force ({what})")
    elif r.state == UNVERIFIED:
        warnings.append("files changed since the last full verify: the loader will hash every tensor "
                        "(run `moet-cache verify --full` to record them)")
    return r


def build_serve_command(cache: str | os.PathLike[str], profile_name: str = DEFAULT_PROFILE,
                        user_args: list[str] | None = None, *, force: bool = False,
                        skip_flag_check: bool = False, require_vllm: bool = True) -> ServeCommand:
    """Boot-check the cache, build the `vllm serve` argv, check it with vLLM's parser when installed."""
    root = Path(cache)
    if not root.is_dir():
        raise InputError(f"{root} is not a cache folder")
    profile = get_profile(profile_name)
    warnings: list[str] = []
    notes: list[str] = []
    report = check_boot(root, force, warnings)
    unverified = report.state == "unverified"
    model_dir = (root / L.AUX_DIR).resolve()
    if not (model_dir / "config.json").is_file():
        raise InputError(f"{root} has no {L.AUX_DIR}/config.json for vLLM to read", "rebuild the cache")
    exe = shutil.which("vllm")
    if exe is None and require_vllm:
        raise MissingDependencyError("vLLM is not installed (no `vllm` on PATH)", INSTALL_HINT)
    table = None
    probe = None
    if exe is not None and not skip_flag_check:
        probe = VllmProbe(vllm_python(exe))
    try:
        if probe is not None:
            table = probe.table()
        base = [Flag(o, v) for o, v in profile.flags] + integration_flags(root, unverified, warnings)
        user = split_flags(list(user_args or []), table)
        base, n1 = adapt_renames(base, table)
        user, n2 = adapt_renames(user, table)
        notes += n1 + n2
        flags = merge_flags(base, user, table)
        args = [str(model_dir)] + [t for f in flags for t in f.argv()]
        if table is not None and probe is not None:
            check_known(flags, table)
            err = probe.parse(args)
            if err is not None:
                raise InputError(f"vLLM {table.version} refuses the command: {err}",
                                 "fix the flag after --, or choose another --settings profile")
    finally:
        if probe is not None:
            probe.close()
    if exe is None:
        warnings.append(f"vLLM is not installed: the flags were not checked against its parser ({INSTALL_HINT})")
    elif skip_flag_check:
        warnings.append("--skip-flag-check: the flags were not checked against vLLM's parser")
    if table is not None and table.version != VLLM_PIN:
        notes.append(f"vLLM {table.version} is installed; moet-cache targets {VLLM_PIN}")
    return ServeCommand(("vllm" if exe is None else exe, "serve", *args), tuple(_env_added(profile)),
                        str(root.resolve()), profile.name, report.state, exe,
                        table.version if table else None, table is not None, tuple(warnings), tuple(notes))


# --- plan before exec ---------------------------------------------------------------------------------


def _human_int(text: str) -> int:
    t = text.strip().lower()
    mult = {"k": 1000, "m": 1000**2}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise InputError(f"cannot read {text!r} as a number of tokens") from None


def settings_from_argv(argv: tuple[str, ...] | list[str], gpu: Any) -> Any:
    """The PlanSettings that a `vllm serve` argv asks for (flags vLLM would use; the rest default)."""
    from .vram import PlanSettings, parse_sizes_list
    flags = {f.option: f.values for f in split_flags([a for a in argv[3:]])} if len(argv) > 3 else {}
    s: dict[str, Any] = {"gpu": gpu}
    if "--gpu-memory-utilization" in flags:
        s["utilization"] = float(flags["--gpu-memory-utilization"][0])
    if "--max-model-len" in flags:
        s["max_model_len"] = _human_int(flags["--max-model-len"][0])
    if "--kv-cache-dtype" in flags:
        s["kv_cache_dtype"] = flags["--kv-cache-dtype"][0]
    if "--block-size" in flags:
        s["block_size"] = int(flags["--block-size"][0])
    if "--enforce-eager" in flags:
        s["cudagraph_sizes"] = ()
    elif "--cudagraph-capture-sizes" in flags:
        s["cudagraph_sizes"] = parse_sizes_list(",".join(flags["--cudagraph-capture-sizes"]))
    spec = flags.get("--speculative-config") or flags.get("-sc")
    if spec:
        try:
            method = str(json.loads(spec[0]).get("method", ""))
        except (ValueError, AttributeError):
            method = ""
        s["speculative"] = "mtp" if "mtp" in method else "none"
    return PlanSettings(**s)


@dataclass(frozen=True)
class PreflightPlan:
    gpu: str
    fits: bool
    margin: int
    deciding: str
    suggestions: tuple[str, ...] = field(default_factory=tuple)


def preflight_plan(cmd: ServeCommand) -> PreflightPlan | None:
    """Plan the command's settings on the GPU that nvidia-smi sees; None without a GPU."""
    from .vram import detect_gpu, footprint_from_cache, make_plan
    gpu = detect_gpu()
    if gpu is None:
        return None
    p = make_plan(footprint_from_cache(cmd.cache), settings_from_argv(cmd.argv, gpu))
    return PreflightPlan(gpu.name, p.fits, p.margin, p.deciding, tuple(s.setting for s in p.suggestions))


def exec_vllm(cmd: ServeCommand) -> None:
    """Replace this process with vLLM: its signals and exit code are then vLLM's own."""
    if cmd.vllm is None:
        raise MissingDependencyError("vLLM is not installed (no `vllm` on PATH)", INSTALL_HINT)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd.vllm, list(cmd.argv), cmd.environment())
