"""vLLM's command-line flags as data: tokens grouped into flags (by the installed vLLM's own nargs when its
parser was read), renamed the way that vLLM spells them, merged (the user's over the preset's, in place),
checked against its parser's options, and split into one list a node for a multi-node start."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError


# Flags vLLM renamed: old spelling -> new spelling (the direction taken when the installed vLLM has only one).
RENAMES: dict[str, str] = {
    "--cuda-graph-sizes": "--cudagraph-capture-sizes",
}


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
    environment: dict[str, Any] = field(default_factory=dict)   # torch, moet_cache as vLLM's interpreter sees them

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


def refuse_config_file(flags: list[Flag]) -> None:
    """vLLM ranks command-line flags above a --config file, so the preset's flags would silently replace the
    file's values: refused with one line and what to do instead."""
    for f in flags:
        if f.option == "--config":
            raise InputError(f"--config {' '.join(f.values)}: vLLM ranks the command line above the file, so the "
                             "preset's flags would silently replace the file's settings",
                             "pass the file's settings as flags after --, which replace the preset's")


def last_values(flags: list[Flag], *names: str) -> tuple[str, ...] | None:
    """The values of the last flag of any of these spellings (argparse keeps the last), None when none is given."""
    found = [f.values for f in flags if f.option in names]
    return found[-1] if found else None


def node_flags(flags: list[Flag]) -> list[list[Flag]]:
    """vLLM 0.34's multi-node launch with its own multiprocessing backend (`--nnodes`, `--node-rank`,
    `--master-addr`, `--master-port`: vllm/config/parallel.py): the same flags on every node, each with its
    `--node-rank`, and every node but the first `--headless` (its workers join node 0's torch.distributed group:
    vllm/entrypoints/cli/serve.py `run_headless`). One list of flags a node; none for one node."""
    nnodes = last_values(flags, "--nnodes", "-n")
    try:
        n = int(nnodes[0]) if nnodes else 1
    except ValueError:
        raise InputError(f"--nnodes {nnodes[0]!r} is not a number of nodes") from None
    if n <= 1:
        return []
    backend = last_values(flags, "--distributed-executor-backend")
    if backend and backend[0] not in ("mp",):
        raise InputError(f"--nnodes {n} with --distributed-executor-backend {backend[0]}: vLLM 0.34 starts nodes "
                         "itself only with its multiprocessing backend",
                         "drop --nnodes for a Ray cluster (docs/SERVING.md, 'More than one node')")
    if not last_values(flags, "--master-addr"):
        raise InputError(f"--nnodes {n} needs --master-addr: the address of node 0, which every node reaches",
                         "add -- --master-addr <node 0's address>")
    tp = last_values(flags, "--tensor-parallel-size", "-tp") or ("1",)
    pp = last_values(flags, "--pipeline-parallel-size", "-pp") or ("1",)
    try:
        world = int(tp[0]) * int(pp[0])
    except ValueError:
        raise InputError(f"--tensor-parallel-size {tp[0]!r} / --pipeline-parallel-size {pp[0]!r}: not numbers of GPUs") from None
    if world % n:
        raise InputError(f"--nnodes {n} does not divide the {world} GPUs of tensor parallel {tp[0]} x pipeline "
                         f"parallel {pp[0]}", "give each node the same number of GPUs")
    keep = [f for f in flags if f.option not in ("--node-rank", "-r", "--headless")]
    return [keep + [Flag("--node-rank", (str(r),))] + ([Flag("--headless", ())] if r else []) for r in range(n)]
