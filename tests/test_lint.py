"""The project's Python passes ruff with the rules of pyproject's [tool.ruff.lint]; no test changes sys.path
(pyproject's pytest `pythonpath` puts tests/ and benchmarks/ on it, so helpers import by name)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINTED = ["moet_cache", "cli", "tests", "benchmarks", "manifests"]
PATH_CHANGES = {"insert", "append", "extend", "remove", "clear", "pop"}


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def sys_path_changes(source: str) -> list[int]:
    """Lines of `sys.path.insert(...)`-style calls and of assignments to sys.path."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in PATH_CHANGES and _is_sys_path(node.func.value)):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            lines += [node.lineno for t in targets if _is_sys_path(t)]
    return sorted(lines)


def test_the_check_sees_each_form_of_sys_path_change() -> None:
    src = "import sys\nsys.path.insert(0, 'a')\nsys.path.append('b')\nsys.path = []\nsys.path += ['c']\nx = sys.path\n"
    assert sys_path_changes(src) == [2, 3, 4, 5]


def test_no_test_changes_sys_path() -> None:
    found = [f"{p.relative_to(ROOT)}:{line}" for p in sorted((ROOT / "tests").rglob("*.py"))
             for line in sys_path_changes(p.read_text())]
    assert not found, f"tests change sys.path (use pytest's pythonpath in pyproject.toml): {found}"


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (pip install -e '.[test]')")
def test_ruff_finds_nothing() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *LINTED],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff check {' '.join(LINTED)}:\n{proc.stdout}{proc.stderr}"
