"""docs/CLI.md, the command-line reference, generated from each command's --help (as huggingface_hub does).

    python -m moet_cache.cli.reference            # rewrite docs/CLI.md
    python -m moet_cache.cli.reference --check    # exit 1 when docs/CLI.md differs from --help

The help is rendered in this process at a fixed width of 80 columns without colour, exactly as
`COLUMNS=80 moet-cache COMMAND --help` prints it, so the file does not depend on the terminal that
generates it. tests/test_cli_reference.py fails when the checked-in file has drifted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

WIDTH = 80
DEFAULT_PATH = Path("docs/CLI.md")
REGENERATE = "python -m moet_cache.cli.reference"


def _help_text(command: Any, name: str, parent: Any) -> tuple[str, Any]:
    """The command's help at WIDTH columns, and its context (the parent of its subcommands' contexts)."""
    # click renders a terminal of N columns N - 2 wide; the command's own context settings give -h
    settings = {**command.context_settings, "terminal_width": WIDTH - 2, "max_content_width": WIDTH}
    ctx = command.context_class(command, info_name=name, parent=parent, **settings)
    return ctx.get_help(), ctx


def render() -> str:
    """The whole reference as Markdown: the top-level help, then every command's, in the CLI's order."""
    import typer.main

    from .app import COMMANDS, app
    root = typer.main.get_command(app)
    top, root_ctx = _help_text(root, "moet-cache", None)
    parts = ["# moet-cache command-line reference", "",
             f"<!-- Generated from `--help` by `{REGENERATE}`; do not edit by hand. -->", "",
             f"Each command's help as `COLUMNS={WIDTH} moet-cache COMMAND --help` prints it.", ""]
    sections = [("moet-cache", top)]
    for name in COMMANDS:
        text, _ = _help_text(root.commands[name], name, root_ctx)
        sections.append((f"moet-cache {name}", text))
    parts += [f"- [`{title}`](#{title.replace(' ', '-')})" for title, _ in sections] + [""]
    for title, text in sections:
        body = "\n".join(line.rstrip() for line in text.strip("\n").splitlines())
        parts += [f"## {title}", "", "```text", body, "```", ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    paths = [a for a in args if a != "--check"]
    path = Path(paths[0]) if paths else DEFAULT_PATH
    text = render()
    if check:
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            sys.stderr.write(f"{path} differs from the commands' --help; regenerate it with: {REGENERATE}\n")
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
