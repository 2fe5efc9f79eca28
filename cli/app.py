"""The moet-cache console script: the typer app, and main(), which maps errors to exit codes."""

from __future__ import annotations

import atexit
import signal
import sys
import traceback

import typer

from moet_cache.errors import OutputError

from . import build, demo, export, inspect_cmd, verify
from . import plan, serve
from ._common import MoetCommand, version_text
from ._env import debug_from_env
from ._errors import EXIT_ENVIRONMENT, EXIT_USAGE, exit_code_for, hint_for, message_for
from ._output import envelope, write_json
from ._signals import InterruptGate

HELP = """Turn an NVFP4 MoE checkpoint into a verified 2-bit base-plane + FP4
delta-tier cache, and serve it.

\b
Exit codes: 0 ok; 1 verification found a problem (incomplete, unverified,
stale, corrupt, mismatch); 2 bad input or usage; 3 environment (lock held,
disk full, interrupted).

\b
Every command takes --json (one JSON document on stdout on every exit, with
command, ok, exit_code, error and hint) and --quiet (no summaries or notes).
--debug, anywhere before a bare --, adds tracebacks to errors.

\b
Environment variables:
  MOET_CACHE_DEBUG=1           same as --debug
  MOET_CACHE_SPLIT_DEVICE=...  build: auto (default), cpu, torch-cpu, cuda
  MOET_CACHE_KERNELS=numpy|c   build: the numpy or the C kernels (A/B runs)
  MOET_CACHE_KERNEL_IMAGES=DIR serve: where the GPU kernels' compiled images
                               are kept between starts (off: none kept)
  MOET_CACHE_TEST_KILL_AT=W    tests only: SIGKILL this process at commit
                               window W (docs/GUARANTEES.md)
A value these do not name is refused (exit 2); empty is the same as unset."""

app = typer.Typer(help=HELP, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  add_completion=False, context_settings={"help_option_names": ["-h", "--help"]})
for _name, _fn in (("build", build.build), ("verify", verify.verify), ("inspect", inspect_cmd.inspect),
                   ("export", export.export), ("retier", build.retier), ("demo", demo.demo),
                   ("plan", plan.plan), ("serve", serve.serve)):
    app.command(_name, cls=MoetCommand)(_fn)
COMMANDS = ("build", "verify", "inspect", "export", "retier", "demo", "plan", "serve")


def _version_callback(value: bool) -> None:
    if value:
        print(version_text())
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", "-V", callback=_version_callback, is_eager=True,
                                       help="Print the versions of moet-cache, torch and vLLM, and whether "
                                            "the C kernels are built; then exit.")) -> None:
    pass


def _command_and_json(args: list[str]) -> tuple[str | None, bool]:
    """The command named in the arguments and whether --json was given (before a bare --)."""
    cut = args.index("--") if "--" in args else len(args)
    name = next((a for a in args[:cut] if not a.startswith("-")), None)
    return (name if name in COMMANDS else None), "--json" in args[:cut]


def _split_debug(args: list[str]) -> tuple[list[str], bool]:
    """Take --debug out of the arguments (not after a bare --, which belongs to vLLM)."""
    cut = args.index("--") if "--" in args else len(args)
    head = [a for a in args[:cut] if a != "--debug"]
    return head + args[cut:], len(head) != cut


def _last_json(doc: dict) -> None:
    """The error's JSON document; when stdout cannot take it, the line on stderr has said it all."""
    try:
        write_json(doc)
    except OutputError:
        pass


def main(argv: list[str] | None = None) -> int:
    args, debug = _split_debug(list(sys.argv[1:] if argv is None else argv))
    gate = InterruptGate() if argv is None else None  # the console script, not an in-process call
    command, json_mode = _command_and_json(args)
    if gate is not None:
        gate.command, gate.json_mode = command, json_mode  # a second Ctrl-C still writes the JSON document
        gate.install()  # progress_for() finds it as the SIGINT handler
    code = EXIT_ENVIRONMENT
    try:
        code = _dispatch(args, debug, command, json_mode)
        return code
    finally:
        if gate is not None:  # the outcome is decided and printed: a signal now cannot change the exit code
            gate.settle(code)


def _dispatch(args: list[str], debug: bool, command: str | None, json_mode: bool) -> int:
    """Run the command; every way it ends becomes an exit code (and, with --json, its one document)."""
    try:
        debug = debug_from_env() or debug  # a bogus MOET_CACHE_DEBUG is refused like any bad input
        rv = app(args=args, prog_name="moet-cache", standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # the one place errors become messages and exit codes
        if type(e).__name__ == "Abort":  # typer's wrapper of Ctrl-C
            e = KeyboardInterrupt()
        code = exit_code_for(e)
        if code is None and hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int):
            e.show()  # a usage error from typer: it prints its own one-line message
            code = EXIT_USAGE if e.exit_code == 2 else e.exit_code
            _settle(code)
            if json_mode:
                usage = e.format_message() if hasattr(e, "format_message") else str(e)
                _last_json(envelope(command, code, usage, "see `moet-cache --help`", "UsageError"))
            return code
        _settle(70 if code is None else code)  # from here a signal cannot interrupt the report or change its code
        if debug:
            traceback.print_exc()
        if code is None:
            sys.stderr.write(f"Error: internal error: {type(e).__name__}: {e}\n"
                             "This is a bug in moet-cache; rerun with --debug and report the traceback.\n")
            if json_mode:
                _last_json(envelope(command, 70, f"internal error: {type(e).__name__}: {e}",
                                    "this is a bug in moet-cache; rerun with --debug and report the traceback",
                                    type(e).__name__))
            return 70
        sys.stderr.write(f"Error: {message_for(e)}\n")
        if json_mode and not isinstance(e, OutputError):
            _last_json(envelope(command, code, message_for(e, with_hint=False), hint_for(e), type(e).__name__))
        return code


def _settle(code: int) -> None:
    """The exit code is decided: the console script's gate holds signals from here on (InterruptGate.settle)."""
    gate = InterruptGate.installed()
    if gate is not None:
        gate.settle(code)


def run() -> None:
    # The interpreter's teardown puts the default SIGINT handler back before the process ends: a Ctrl-C
    # there would end it as killed by the signal (130), whatever the printed outcome said. Registered
    # first, this runs as the last atexit handler and ignores both signals from then on (until then,
    # thread joins and the other handlers included, the gate holds them).
    atexit.register(_ignore_signals_from_now_on)
    sys.exit(main())


def _ignore_signals_from_now_on() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


if __name__ == "__main__":
    run()
