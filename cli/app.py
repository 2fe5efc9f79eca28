"""The moet-cache console script: the typer app, and main(), which maps errors to exit codes."""

from __future__ import annotations

import os
import sys
import traceback

import typer

from moet_cache.version import __version__

from . import build, demo, export, inspect_cmd, verify
from . import plan, serve
from ._errors import EXIT_USAGE, exit_code_for, message_for
from ._signals import InterruptGate

HELP = """Turn an NVFP4 MoE checkpoint into a verified 2-bit base-plane + FP4 delta-tier cache, and serve it.

Exit codes: 0 ok; 1 verification found a problem; 2 bad input or usage; 3 environment (lock held, disk full, interrupted). Add --debug (or MOET_CACHE_DEBUG=1) for tracebacks."""

app = typer.Typer(help=HELP, no_args_is_help=True, pretty_exceptions_enable=False,
                  add_completion=False, context_settings={"help_option_names": ["-h", "--help"]})
app.command("build")(build.build)
app.command("verify")(verify.verify)
app.command("inspect")(inspect_cmd.inspect)
app.command("export")(export.export)
app.command("retier")(build.retier)
app.command("demo")(demo.demo)
app.command("plan")(plan.plan)
app.command("serve")(serve.serve)


def _version_callback(value: bool) -> None:
    if value:
        print(f"moet-cache {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    pass


def _split_debug(args: list[str]) -> tuple[list[str], bool]:
    """Take --debug out of the arguments (not after a bare --, which belongs to vLLM)."""
    cut = args.index("--") if "--" in args else len(args)
    head = [a for a in args[:cut] if a != "--debug"]
    return head + args[cut:], len(head) != cut


def main(argv: list[str] | None = None) -> int:
    args, debug = _split_debug(list(sys.argv[1:] if argv is None else argv))
    gate = InterruptGate() if argv is None else None  # the console script, not an in-process call
    if gate is not None:
        gate.install()  # progress_for() finds it as the SIGINT handler
    debug = debug or os.environ.get("MOET_CACHE_DEBUG", "") not in ("", "0")
    try:
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
            return EXIT_USAGE if e.exit_code == 2 else e.exit_code
        if debug:
            traceback.print_exc()
        if code is None:
            sys.stderr.write(f"Error: internal error: {type(e).__name__}: {e}\n"
                             "This is a bug in moet-cache; rerun with --debug and report the traceback.\n")
            return 70
        sys.stderr.write(f"Error: {message_for(e)}\n")
        return code
    finally:
        if gate is not None:  # the outcome is decided: a signal now (shutdown, finalizers) is held, not raised
            gate.deferring = True


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
