"""The layers of docs/ARCHITECTURE.md, checked: every module of moet_cache imports cold (no import cycle),
and a module imports only modules of its own layer or below. LAYERS below is the source of truth; the
architecture page's table says the same. The project's own modules are imported at the top of a module;
an import inside a function is allowed only where LAZY lists it with its reason."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# where each package's files are (pyproject's [tool.setuptools.package-dir])
PACKAGE_DIRS = {"moet_cache": ROOT / "moet_cache", "moet_cache.cli": ROOT / "cli",
                "moet_cache.manifests": ROOT / "manifests"}

SEAMS, FORMATS, CODEC, CACHE, COMMANDS, INTEGRATIONS, CLI = range(7)
LAYER_NAMES = ("seams", "formats", "codec", "the cache", "commands", "integrations", "cli")
# a module's layer: its own entry, else its package's (the root package `moet_cache` counts only for itself).
# A folder's modules share its layer (verify's and source's named apart); the root's modules are the seams.
LAYERS = {
    # seams: no knowledge of models or caches
    **dict.fromkeys(["errors", "fsutil", "hashing", "stheader", "stwriter", "window", "cancel", "progress", "units",
                     "machine", "version", "enums", "_preads"], SEAMS),
    # formats: what a checkpoint's bytes and names mean
    "format": FORMATS,
    # the codec: each FP4 code split into planes and joined again
    "codec": CODEC,
    # the cache: its records and files, the commit, what it holds; the source checkpoint it is built from (the
    # reader's fingerprint is a manifest record) and the verify records, the recorded verified state and the boot
    # check (a commit records and proves with them)
    **dict.fromkeys(["cache", "manifests", "source", "verify.report", "verify.state", "verify.boot"], CACHE),
    # commands: what the CLI and vLLM call (the package's API loads them lazily); the exporter checks the bytes it
    # reads as verify.against does
    **dict.fromkeys(["", "build", "load", "runtime", "parsers", "verify", "plan", "serve", "source.exporter"],
                    COMMANDS),
    # integrations: the glue a serving program (vLLM) imports through its plugins; it may import vLLM
    "integrations": INTEGRATIONS,
    "cli": CLI,
}
LAYERS = {("moet_cache." + k).rstrip("."): v for k, v in LAYERS.items()}

# upward imports, each with its reason
UPWARD: dict[tuple[str, str], str] = {}

# the project's modules imported inside functions: importer -> (imported, reason)
_LIGHT_CLI = "numpy, torch and safetensors stay out of the CLI's start (`moet-cache verify`, `--help`)"
_CUDA = "loaded where a CUDA launch happens"
LAZY: dict[str, tuple[frozenset[str], str]] = {
    "moet_cache.cache.manifest": (frozenset({"moet_cache.cache.geometry", "moet_cache.format.formats"}), _LIGHT_CLI),
    "moet_cache.verify.against": (frozenset({"moet_cache.source.checkpoint", "moet_cache.format.formats",
                                             "moet_cache.cache.stread", "moet_cache.cache.geometry",
                                             "moet_cache.codec.planes"}), "--against: " + _LIGHT_CLI),
    "moet_cache.verify.boot": (frozenset({"moet_cache.source.checkpoint"}), "a rewritten source shard: " + _LIGHT_CLI),
    "moet_cache.plan.measure": (frozenset({"moet_cache.stwriter", "moet_cache.cache.geometry",
                                           "moet_cache.source.checkpoint", "moet_cache.cache.tiering"}),
                        "a plan from a checkpoint: " + _LIGHT_CLI),
    "moet_cache.serve.command": (frozenset({"moet_cache.cache.cacheview", "moet_cache.verify.boot",
                                            "moet_cache.verify.report"}), _LIGHT_CLI),
    "moet_cache.integrations.vllm.plugin": (frozenset({"moet_cache.integrations.vllm.config",
                                                       "moet_cache.integrations.vllm.loader",
                                                       "moet_cache.integrations.vllm.parsers"}),
                                            "they import vLLM, an optional dependency: the entry point "
                                            "imports without it and says where vLLM fails to import"),
    "moet_cache.runtime.triton_experts": (frozenset({"moet_cache.runtime.triton_moe"}),
                                          "triton is optional: " + _CUDA),
    "moet_cache.cli._common": (frozenset({"moet_cache.cache.commit", "moet_cache.version"}), _LIGHT_CLI),
    "moet_cache.cli.build": (frozenset({"moet_cache", "moet_cache.build.options", "moet_cache.codec.planes"}),
                             _LIGHT_CLI),
    "moet_cache.cli.demo": (frozenset({"moet_cache", "moet_cache.source.synthetic", "moet_cache.serve",
                                       "moet_cache.plan", "moet_cache.cli.plan", "moet_cache.cli.inspect_cmd"}),
                            _LIGHT_CLI),
    "moet_cache.cli.export": (frozenset({"moet_cache"}), _LIGHT_CLI),
    "moet_cache.cli.reference": (frozenset({"moet_cache.cli.app"}), "app imports every command"),
}
# third-party packages a module may lack: a cold import that fails on one of them is not a failure here
OPTIONAL = {"vllm", "triton", "matplotlib", "cuda"}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    in_function: bool


def project_modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if package == "moet_cache" and parts[0] in ("cli", "manifests"):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def layer_of(module: str) -> int:
    name = module
    while name:
        if name in LAYERS and (name != "moet_cache" or module == "moet_cache"):
            return LAYERS[name]
        name = name.rpartition(".")[0]
    raise KeyError(f"{module} has no layer in LAYERS")


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: set[str]) -> None:
        self.module, self.is_package, self.known = module, is_package, known
        self.depth, self.edges = 0, []

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _add(self, target: str, line: int) -> None:
        if target == "moet_cache" or target.startswith("moet_cache."):
            self.edges.append(Edge(self.module, target, line, self.depth > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.module.split(".")
            if not self.is_package:
                package = package[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
        for alias in node.names:  # `from . import layout` depends on the module layout, not on the package
            sub = f"{base}.{alias.name}"
            extension = sub in ("moet_cache.codec._kernels", "moet_cache._preads")
            self._add(sub if sub in self.known or extension else base, node.lineno)


def import_edges() -> list[Edge]:
    modules = project_modules()
    edges = []
    for module, path in modules.items():
        visitor = _Imports(module, path.name == "__init__.py", set(modules))
        visitor.visit(ast.parse(path.read_text()))
        edges += visitor.edges
    return edges


def test_every_module_has_a_layer_and_the_edges_are_seen() -> None:
    modules = project_modules()
    for module in modules:
        layer_of(module)
    edges = import_edges()
    assert len(modules) > 90 and len(edges) > 300
    # the forms the visitor must resolve: a relative submodule, a parent package's name, an in-function import
    assert Edge("moet_cache.cache.commit", "moet_cache.cache.layout", 29, False) in edges
    assert any(e.importer == "moet_cache.load.api" and e.imported == "moet_cache.verify.boot" for e in edges)
    assert any(e.importer == "moet_cache.serve.command" and e.imported == "moet_cache.verify.boot" and e.in_function
               for e in edges)


def test_imports_go_down_the_layers() -> None:
    upward = sorted({f"{e.importer}:{e.line} ({LAYER_NAMES[layer_of(e.importer)]}) imports {e.imported} "
                     f"({LAYER_NAMES[layer_of(e.imported)]})" for e in import_edges()
                     if layer_of(e.imported) > layer_of(e.importer) and (e.importer, e.imported) not in UPWARD})
    assert not upward, "\n".join(upward)


def import_circles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """The import circles of a graph of (importer, imported) edges: its strongly connected components of more
    than one module (Tarjan's algorithm), each sorted."""
    graph: dict[str, set[str]] = {}
    for importer, imported in edges:
        if importer != imported:
            graph.setdefault(importer, set()).add(imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph.get(module, ())):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_import_circles_are_found() -> None:
    """The finder on small graphs: a circle through a third module, a self-import (none), a tree (none)."""
    assert import_circles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]
    assert import_circles([("a", "a"), ("a", "b"), ("b", "c"), ("a", "c")]) == []


def test_no_module_is_in_an_import_circle() -> None:
    """No circle of modules importing each other, imports inside functions included: a circle that only a
    function-level import keeps from failing at start is still one."""
    circles = import_circles([(e.importer, e.imported) for e in import_edges()])
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def test_the_projects_modules_are_imported_at_the_top_unless_listed() -> None:
    unlisted = sorted({f"{e.importer}:{e.line} imports {e.imported} inside a function" for e in import_edges()
                       if e.in_function and e.imported not in LAZY.get(e.importer, (frozenset(),))[0]})
    assert not unlisted, "move the import to the top, or list it in LAZY with the reason:\n" + "\n".join(unlisted)


def test_only_the_integrations_import_the_integrations() -> None:
    """The engine and the CLI never import moet_cache.integrations (it imports vLLM, an optional dependency);
    serve names its modules as strings and finds them without importing them."""
    edges = import_edges()
    assert any(e.importer == "moet_cache.integrations.vllm.config" and
               e.imported == "moet_cache.integrations.vllm.method" for e in edges)  # the visitor sees them
    outside = sorted({f"{e.importer}:{e.line} imports {e.imported}" for e in edges
                      if e.imported.startswith("moet_cache.integrations")
                      and not e.importer.startswith("moet_cache.integrations")})
    assert not outside, "\n".join(outside)


def test_the_lists_name_only_what_is_there() -> None:
    edges = {(e.importer, e.imported) for e in import_edges()}
    lazy = {(e.importer, e.imported) for e in import_edges() if e.in_function}
    assert set(UPWARD) <= edges
    stale = [(importer, imported) for importer, (names, _) in LAZY.items() for imported in names
             if (importer, imported) not in lazy]
    assert not stale, stale



# the serve subpackage's own order: each module imports only the ones listed for it
SERVE_ORDER = {"flags": set(), "presets": {"flags"}, "vllm_env": {"flags"},
               "command": {"flags", "presets", "vllm_env"}}


# the plan subpackage's: each module imports only the ones below it that it names
PLAN_ORDER = {"gpus": set(), "attention": {"gpus"}, "footprint": {"attention"},
              "measure": {"attention", "footprint"}, "settings": {"attention", "gpus"},
              "record": {"footprint", "settings"}, "kv": {"footprint", "settings"},
              "budget": {"attention", "footprint", "gpus", "kv", "measure", "record", "settings"}}


def subpackage_imports(package: str, order: dict[str, set[str]]) -> dict[str, set[str]]:
    found = {name: set() for name in order}
    for e in import_edges():
        importer, imported = e.importer.removeprefix(package + "."), e.imported.removeprefix(package + ".")
        if importer in order and imported in order:
            found[importer].add(imported)
    return found


def test_the_serve_modules_import_in_their_order() -> None:
    assert subpackage_imports("moet_cache.serve", SERVE_ORDER) == SERVE_ORDER


def test_the_plan_modules_import_in_their_order() -> None:
    assert subpackage_imports("moet_cache.plan", PLAN_ORDER) == PLAN_ORDER


# the verify subpackage's own order
VERIFY_ORDER = {"report": set(), "state": {"report"}, "boot": {"report", "state"},
                "full": {"report", "state", "boot"}, "against": {"report", "boot"}}


def test_the_verify_modules_import_in_their_order() -> None:
    found: dict[str, set[str]] = {name: set() for name in VERIFY_ORDER}
    for e in import_edges():
        importer, imported = e.importer.removeprefix("moet_cache.verify."), e.imported.removeprefix("moet_cache.verify.")
        if importer in VERIFY_ORDER and imported in VERIFY_ORDER:
            found[importer].add(imported)
    assert found == VERIFY_ORDER


def test_the_architecture_page_names_each_module_in_its_layer() -> None:
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = page[page.index("## Layers"):].split("```")[1]
    rows = table.split("---+")  # cli, integrations, commands, the cache, codec, formats, seams: top to bottom
    assert len(rows) == len(LAYER_NAMES)
    text_of = {layer: rows[len(LAYER_NAMES) - 1 - layer] for layer in range(len(LAYER_NAMES))}
    for layer, name in enumerate(LAYER_NAMES):
        assert f" {name} " in text_of[layer] or f" {name}/ " in text_of[layer], (name, text_of[layer][:80])
    missing = []
    for module, layer in LAYERS.items():
        short = module.removeprefix("moet_cache.") if module != "moet_cache" else "moet_cache"
        if not re.search(rf"(?<![\w.]){re.escape(short)}(?![\w])", text_of[layer]):
            missing.append(f"{short} ({LAYER_NAMES[layer]})")
    assert not missing, f"docs/ARCHITECTURE.md's layer table does not name: {missing}"

# Each module imported first in a fresh process (forked after the third-party packages are loaded, so
# that only the project's modules are cold): an import cycle fails wherever it is entered first.
_COLD = """
import importlib, json, os, sys, traceback
for heavy in ("numpy", "torch", "safetensors", "xxhash", "typer", "rich"):
    try:
        importlib.import_module(heavy)
    except ImportError:
        pass
optional, failed, imported = set(sys.argv[2].split(",")), {}, 0
for module in sys.argv[1].split(","):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(module)
            code, text = 0, ""
        except ModuleNotFoundError as e:
            missing = (e.name or "").split(".")[0]
            code, text = (2, "") if missing in optional else (1, traceback.format_exc())
        except BaseException:
            code, text = 1, traceback.format_exc()
        os.write(write, text.encode()[-4000:])
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        text = f.read().decode()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        imported += 1
    elif code != 2:
        failed[module] = text or f"exit {code}"
print(json.dumps({"imported": imported, "failed": failed}))
"""


def test_every_module_imports_cold() -> None:
    modules = sorted(project_modules())
    proc = subprocess.run([sys.executable, "-c", _COLD, ",".join(modules), ",".join(sorted(OPTIONAL))],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert not result["failed"], "\n".join(f"{m}:\n{t}" for m, t in result["failed"].items())
    assert result["imported"] >= len(modules) - 5, result  # only the few that need an optional package skip
