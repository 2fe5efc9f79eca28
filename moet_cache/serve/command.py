"""The `vllm serve` command for a verified cache, and its checks.

The command is built from a preset (docs/SERVING.md; by default the one for the cache's model type), the
cache's loader and parser flags, then the user's flags after `--`, which replace the preset's. When vLLM is
installed, every flag is checked against that version's own argument parser (vllm_env) and known renames are
adapted (flags). Before exec, the command's settings are planned on the GPU vLLM will see.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..cache import layout as L
from ..plan.drafter_vram import DrafterLayout
from ..errors import EnvironmentProblem, InputError, MissingDependencyError, VerificationError
from ..plan.parallel import check as check_parallel
from ..plan import (DEFAULT_GPU, GPU_PRESETS, PlanSettings, detect_gpu, footprint_from_cache, footprint_of_view,
                    make_plan)
from .flags import Flag, adapt_renames, check_known, merge_flags, node_flags, refuse_config_file, split_flags
from .presets import (DEFAULT_PRESET, Preset, check_reasoning_effort, choose_drafter, fit_preset, get_preset,
                      model_type_of, settings_from_flags)
from .vllm_env import (SERVER_MODULE, TORCH_PIN, VLLM_PIN, VllmProbe, check_plugin_env, install_hint, launcher,
                       vllm_install, vllm_install_hint, vllm_python)

if TYPE_CHECKING:
    from ..cache.cacheview import CacheView
    from ..verify.report import State, VerifyReport


PARSER_NAME = "moet_deepseek"
PARSER_MODULE = "moet_cache.integrations.vllm.parsers"
LOAD_FORMAT = "moet"


@dataclass(frozen=True)
class ServeCommand:
    argv: tuple[str, ...]               # the launcher, the model folder, the flags; argv[0] is what is exec'd
    env_added: tuple[tuple[str, str], ...]
    cache: str
    preset: str
    boot_state: State
    vllm: str | None                    # path of the vllm executable, None when not installed
    vllm_version: str | None            # the version whose parser checked the flags
    flags_checked: bool
    warnings: tuple[str, ...]
    notes: tuple[str, ...]
    plan_fits: bool | None = None       # None: no GPU seen, or no plan
    gpu: str | None = None
    model_type: str = ""
    torch_version: str | None = None    # torch in vLLM's interpreter, when vLLM's parser was loaded
    # The opened cache the boot check read (None: forced past manifests that cannot be read): the plan
    # before exec reads the same checked view instead of opening the cache again.
    view: CacheView | None = field(default=None, repr=False, compare=False)
    launcher: tuple[str, ...] = ("vllm", "serve")    # argv's part before the model folder
    cpu: bool = False                   # vLLM's CPU build: no GPU memory to plan, and its rules are not the GPU's
    nodes: tuple[tuple[str, ...], ...] = ()   # --nnodes above 1: each node's command, node 0 first (node_flags)

    @property
    def flag_argv(self) -> tuple[str, ...]:
        """The vLLM flags: argv after the launcher and the model folder."""
        return self.argv[len(self.launcher) + 1:]

    def shell(self, argv: tuple[str, ...] | None = None) -> str:
        """The command (or one node's, `argv`) as a shell line with the environment serve adds."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env_added)
        return (env + " " if env else "") + shlex.join(self.argv if argv is None else argv)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(dict(self.env_added))
        return env


def parser_plugin_path() -> str | None:
    """The file of moet_cache.integrations.vllm.parsers, found without importing it (it imports vLLM)."""
    spec = importlib.util.find_spec(PARSER_MODULE)
    return str(Path(spec.origin).resolve()) if spec and spec.origin else None


def _served_name(cache: Path, view: CacheView | None) -> str:
    m = view.manifest if view is not None else None
    if view is None:  # forced past manifests the view could not read: the commit's manifest, if it reads
        from ..cache.cacheview import read_committed_manifest
        try:
            m = read_committed_manifest(cache)
        except InputError:
            m = None
    name = hub_repo_name(Path(m.source_path)) if m and m.source_path else ""
    return name or cache.resolve().name


def hub_repo_name(source: Path) -> str:
    """The name clients ask for: a Hugging Face hub snapshot (`models--org--name/snapshots/<revision>`) is
    `org/name`, not its revision hash; any other folder its own name."""
    if source.parent.name == "snapshots" and source.parent.parent.name.startswith("models--"):
        repo = source.parent.parent.name[len("models--"):]
        if repo:
            return repo.replace("--", "/", 1)   # the hub writes org/name as org--name; names hold no "--"
    return source.name


STOCK_WARNING = ("--stock: vLLM's own FP4 MoE serves the experts, the loader expands every plane back to FP4: "
                 "the routed experts take their FP4 size in VRAM (about 4.5 bits a weight), not the planes' that "
                 "`moet-cache plan` counts")


def stock_overrides(cache: Path, cfg: dict[str, Any]) -> Flag:
    """--hf-overrides giving vLLM the source's own quantization_config (the cache's config.json names moet)."""
    block = cfg.get("quantization_config")
    source = block.get("source") if isinstance(block, dict) else None
    if not isinstance(source, dict):
        raise InputError(f"{cache}: the model folder's config.json keeps no source quantization block",
                         "--stock needs the source's own quantization method; serve without --stock")
    return Flag("--hf-overrides", (json.dumps({"quantization_config": source}),))


def integration_flags(cache: Path, verify_hash: bool, warnings: list[str], stock: bool = False,
                      view: CacheView | None = None, cfg: dict[str, Any] | None = None) -> list[Flag]:
    """The loader, the parsers and the served name: what makes vLLM read this cache. By default vLLM's
    routed experts compute on the planes (quantization method `moet`, named by the cache's config.json);
    `stock` hands vLLM the source's own method and the loader expands the planes to FP4 (warns)."""
    extra: dict[str, Any] = {"cache": str(cache.resolve())}
    if verify_hash:
        extra["verify"] = "hash"
    if stock:
        extra["expand"] = True
        warnings.append(STOCK_WARNING)
    flags = [Flag("--load-format", (LOAD_FORMAT,)),
             Flag("--model-loader-extra-config", (json.dumps(extra),)),
             Flag("--served-model-name", (_served_name(cache, view),))]
    if stock:
        flags.append(stock_overrides(cache, cfg if cfg is not None else served_config(cache, view)))
    plugin = parser_plugin_path()
    if plugin is None:
        warnings.append(f"{PARSER_MODULE} is not installed: vLLM's own parsers apply, not this project's")
    else:
        flags += [Flag("--reasoning-parser", (PARSER_NAME,)), Flag("--reasoning-parser-plugin", (plugin,)),
                  Flag("--tool-call-parser", (PARSER_NAME,)), Flag("--tool-parser-plugin", (plugin,)),
                  Flag("--enable-auto-tool-choice", ())]
    return flags


def _env_added(preset: Preset) -> list[tuple[str, str]]:
    env = list(preset.env)
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and "moet_cache" not in [p.strip() for p in plugins.split(",")]:
        # VLLM_PLUGINS limits which general plugins load; our loader is one of them.
        env.append(("VLLM_PLUGINS", ",".join(p for p in [plugins.strip(), "moet_cache"] if p)))
    return env


def check_boot(cache: Path, force: bool, warnings: list[str]) -> tuple[VerifyReport, CacheView | None]:
    """Refuse an incomplete, stale or corrupt cache (unless forced); warn about an unverified one. Returns the
    report and the opened-cache view the boot check read (None when its manifests could not be read)."""
    # Imported here: the boot check pulls in the cache view, and `moet-cache --help` should not.
    from ..verify.boot import boot_view
    from ..verify.report import CORRUPT, INCOMPLETE, STALE, UNVERIFIED
    r, view = boot_view(cache)
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
    return r, view


def served_config(cache: Path, view: CacheView | None) -> dict[str, Any]:
    """model/config.json, the config vLLM reads: through the checked view (its size and digest as cache.json
    lists them); read as it is only when --force serves a cache the boot check did not pass (`view` None)."""
    cfg: Any = None
    if view is not None:
        cfg = view.served_config
    else:
        try:
            cfg = json.loads((cache / L.AUX_DIR / "config.json").read_text())
        except (OSError, ValueError):
            cfg = None if not (cache / L.AUX_DIR / "config.json").is_file() else {}
    if cfg is None:
        raise InputError(f"{cache} has no {L.AUX_DIR}/config.json for vLLM to read", "rebuild the cache")
    return cfg if isinstance(cfg, dict) else {}


def serve_drafter(view: CacheView | None, preset_name: str, user_args: list[str], speculative: bool, cpu: bool) -> tuple[DrafterLayout | None, str | None]:
    """The drafter serve starts and the line that says so: the plan's choice (choose_drafter) on the GPU
    nvidia-smi sees, else the default card; none with --no-speculative or the user's own --speculative-config."""
    if any(a.split("=")[0] in ("--speculative-config", "-sc", "--speculative_config") for a in user_args):
        return None, None
    if not speculative:
        return None, "speculative decoding off (--no-speculative)"
    if view is None:
        return None, "speculative decoding off: the cache did not pass the boot check, no plan to decide it"
    seen = detect_gpu(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    gpu = seen or GPU_PRESETS[DEFAULT_GPU]
    fp = footprint_of_view(view)
    preset = get_preset(preset_name, model_type_of(fp.model))

    def settings_for(layout: DrafterLayout) -> PlanSettings:   # the preset's drafter flags, the user's over them
        flags = merge_flags(fit_preset(preset, fp.model, drafter=layout)[0], split_flags(user_args), None)
        return settings_from_flags(flags, gpu)
    choice = choose_drafter(fp, gpu, preset_name, cpu=cpu, settings_for=settings_for)
    where = f" (no GPU seen: planned on {DEFAULT_GPU}, the default card)" if seen is None and choice.planned else ""
    return choice.layout, choice.reason + where


def build_serve_command(cache: str | os.PathLike[str], preset_name: str = DEFAULT_PRESET,
                        user_args: list[str] | None = None, *, force: bool = False,
                        skip_flag_check: bool = False, require_vllm: bool = True,
                        stock: bool = False, speculative: bool = True) -> ServeCommand:
    """Boot-check the cache, build the `vllm serve` argv, check it with vLLM's parser when installed.
    `stock`: vLLM's own FP4 MoE on expanded planes (FP4 VRAM) instead of the `moet` method (plan's VRAM).
    `speculative`: start the cache's drafter when the plan fits it (serve_drafter); False: never.

    `require_vllm=False` is a dry run: a missing or broken vLLM (its parser does not load, moet-cache does not
    import there) is a warning and the command is still built; otherwise it is an error (exit 2 or 3)."""
    root = Path(cache)
    if not root.is_dir():
        raise InputError(f"{root} is not a cache folder")
    warnings: list[str] = []
    notes: list[str] = []
    report, view = check_boot(root, force, warnings)
    from ..verify.report import State
    unverified = report.state == State.UNVERIFIED
    if not report.complete:  # --force past the boot check: the files are read as they are on disk
        view = None
    model_dir = (root / L.AUX_DIR).resolve()
    cfg = served_config(root, view)
    model_type = model_type_of(cfg)
    preset = get_preset(preset_name, model_type)
    exe = shutil.which("vllm")
    if exe is None and require_vllm:
        raise MissingDependencyError("vLLM is not installed (no `vllm` on PATH)", vllm_install_hint())
    install = vllm_install(exe) if exe is not None else None
    start = launcher(exe, install)
    table = None
    probe = None
    try:
        if exe is not None and not skip_flag_check:
            probe = VllmProbe(vllm_python(exe))
            table = probe.table()
    except EnvironmentProblem as e:
        if require_vllm:
            if probe is not None:
                probe.close()
            raise
        warnings.append(f"{e.message}: the flags were not checked (dry run)")
        if probe is not None:
            probe.close()
        probe = None
    try:
        cpu = install is not None and install.cpu
        drafter, said = serve_drafter(view, preset.name, list(user_args or []), speculative, cpu)
        notes += [said] if said else []
        fitted, fit_notes = fit_preset(preset, cfg, cpu=cpu, drafter=drafter)
        notes += fit_notes
        base = fitted + integration_flags(root, unverified, warnings, stock, view, cfg)
        user = split_flags(list(user_args or []), table)
        refuse_config_file(user)
        base, n1 = adapt_renames(base, table)
        user, n2 = adapt_renames(user, table)
        notes += n1 + n2
        flags = merge_flags(base, user, table)
        check_reasoning_effort(flags, model_type)
        check_parallel(cfg, settings_from_flags(flags, GPU_PRESETS[DEFAULT_GPU]).parallel)
        args = [str(model_dir)] + [t for f in flags for t in f.argv()]
        nodes = tuple((*start, str(model_dir), *(t for f in node for t in f.argv())) for node in node_flags(flags))
        if table is not None and probe is not None:
            check_known(flags, table)
            model_flag = ["--model"] if start[-1] == "--model" else []   # the server module's spelling
            err = probe.parse([*model_flag, *args])
            if err is not None:
                raise InputError(f"vLLM {table.version} refuses the command: {err}",
                                 "fix the flag after --, or choose another --settings preset")
    finally:
        if probe is not None:
            probe.close()
    if table is not None:
        for problem in check_plugin_env(table):
            if require_vllm:
                raise EnvironmentProblem(problem, install_hint(table.python))
            warnings.append(f"{problem}; {install_hint(table.python)}")
    if exe is None:
        warnings.append(f"vLLM is not installed: the flags were not checked against its parser ({vllm_install_hint()})")
    elif skip_flag_check:
        warnings.append("--skip-flag-check: the flags were not checked against vLLM's parser")
    torch_v = table.environment.get("torch") if table is not None else None
    theirs = table.environment.get("moet_cache") if table is not None else None
    if theirs and Path(theirs).resolve().parent != Path(__file__).resolve().parents[1]:
        notes.append(f"vLLM's interpreter imports moet-cache from {Path(theirs).parent}, not this one "
                     f"({Path(__file__).parents[1]}): keep the two installs at the same version")
    if table is not None and table.version != VLLM_PIN:
        notes.append(f"vLLM {table.version} is installed; moet-cache is tested with {VLLM_PIN}")
    if torch_v is not None and not str(torch_v).startswith(TORCH_PIN):
        notes.append(f"torch {torch_v} is installed with vLLM; vLLM {VLLM_PIN} pins torch {TORCH_PIN}")
    if install is not None and not install.console_script_runs:
        found = ", ".join(f"{name} {version}" for name, version in install.distributions)
        notes.append(f"the `vllm` script of {found} cannot run (it asks for the `vllm` distribution): "
                     f"starting vLLM's OpenAI server as `python -m {SERVER_MODULE}`")
    return ServeCommand((*start, *args), tuple(_env_added(preset)),
                        str(root.resolve()), preset.name, report.state, exe,
                        table.version if table else None, table is not None, tuple(warnings), tuple(notes),
                        model_type=model_type, torch_version=torch_v, view=view, launcher=start,
                        cpu=install is not None and install.cpu, nodes=nodes)


@dataclass(frozen=True)
class PreflightPlan:
    gpu: str
    gpu_seen: bool                      # False: no GPU seen, planned for the default preset (no verdict)
    fits: bool
    margin: int
    deciding: str
    suggestions: tuple[str, ...] = field(default_factory=tuple)
    warnings: tuple[str, ...] = field(default_factory=tuple)   # the plan's warnings, which serve repeats


def preflight_plan(cmd: ServeCommand) -> PreflightPlan:
    """Plan the command's settings on the GPU nvidia-smi sees (else the default preset: warnings only)."""
    seen = detect_gpu(cmd.environment().get("CUDA_VISIBLE_DEVICES", ""))  # the GPU vLLM will see
    gpu = seen or GPU_PRESETS[DEFAULT_GPU]
    fp = footprint_of_view(cmd.view) if cmd.view is not None else footprint_from_cache(cmd.cache)
    p = make_plan(fp, settings_from_flags(split_flags(list(cmd.flag_argv)), gpu))
    return PreflightPlan(gpu.name, seen is not None, p.fits, p.margin, p.deciding,
                         tuple(x.advice() for x in p.suggestions),
                         p.warnings if seen is not None else p.notes)


def exec_vllm(cmd: ServeCommand) -> None:
    """Replace this process with vLLM: its signals and exit code are then vLLM's own."""
    if cmd.vllm is None:
        raise MissingDependencyError("vLLM is not installed (no `vllm` on PATH)", vllm_install_hint())
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd.argv[0], list(cmd.argv), cmd.environment())   # the vllm script, or vLLM's python
