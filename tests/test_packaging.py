"""What a user's `pip install moet-cache` gets: build the wheel from this tree and read its file list.

The test suite itself runs against an editable install, where the package data *is* the repository's
files, so only a real wheel can show a schema, a subpackage or an entry point left out of the build.
"""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: repository folder -> where its files land in the installed package (pyproject's package-dir)
PACKAGE_DIRS = {"moet_cache": "moet_cache", "cli": "moet_cache/cli", "manifests": "moet_cache/manifests"}


def _source_files() -> list[str]:
    """The files a fresh clone has: git's list where this is a checkout, else the tree less build output."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=REPO, capture_output=True, check=True).stdout
        return [p for p in out.decode().split("\0") if p and (REPO / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".venv", ".git", "__pycache__", "build", "dist", ".pytest_cache", ".hypothesis"}
        return [str(p.relative_to(REPO)) for p in REPO.rglob("*")
                if p.is_file() and not skip & set(p.relative_to(REPO).parts) and p.suffix not in (".so", ".pyc")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for rel in _source_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                        "-w", str(tmp / "out"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"building the wheel failed:\n{r.stdout}\n{r.stderr}"
    (whl,) = (tmp / "out").glob("moet_cache-*.whl")
    return zipfile.ZipFile(whl)


def test_wheel_carries_every_schema_byte_for_byte(wheel: zipfile.ZipFile) -> None:
    schemas = sorted((REPO / "manifests").glob("*.schema.json"))
    assert len(schemas) == 7
    names = set(wheel.namelist())
    missing = [p.name for p in schemas if f"moet_cache/manifests/{p.name}" not in names]
    assert not missing, f"the wheel leaves out {missing}: see [tool.setuptools.package-data] in pyproject.toml"
    for p in schemas:
        assert wheel.read(f"moet_cache/manifests/{p.name}") == p.read_bytes(), p.name


def test_wheel_carries_the_quality_curve(wheel: zipfile.ZipFile) -> None:
    """plan and inspect read moet_cache/cache/quality_curve.json (moet_cache.cache.quality_curve.packaged_curve)."""
    curve = REPO / "moet_cache" / "cache" / "quality_curve.json"
    assert wheel.read("moet_cache/cache/quality_curve.json") == curve.read_bytes()


def test_wheel_carries_every_module(wheel: zipfile.ZipFile) -> None:
    """Every .py (and .cu) of moet_cache/, cli/ and manifests/ lands where pyproject maps it; no top-level
    `cli`."""
    names = set(wheel.namelist())
    want = set()
    for folder, target in PACKAGE_DIRS.items():
        # the CUDA sources are read at run time (NVRTC compiles them at first use)
        for p in [*(REPO / folder).rglob("*.py"), *(REPO / folder).rglob("*.cu")]:
            want.add(f"{target}/{p.relative_to(REPO / folder).as_posix()}")
    missing = sorted(want - names)
    assert not missing, f"the wheel leaves out {missing}: see [tool.setuptools] packages in pyproject.toml"
    assert not any(n.startswith("cli/") for n in names)


def test_wheel_names_the_console_script_and_the_vllm_plugin(wheel: zipfile.ZipFile) -> None:
    (ep,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    cp = configparser.ConfigParser()
    cp.read_string(wheel.read(ep).decode())
    assert cp["console_scripts"]["moet-cache"] == "moet_cache.cli.app:run"
    assert cp["vllm.general_plugins"]["moet_cache"] == "moet_cache.integrations.vllm.plugin:register"


def test_every_runtime_dependency_is_imported() -> None:
    """A dependency the library never imports is a spare one (tqdm and zstandard were, once)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("-", "_") for d in deps]
    source = "\n".join(p.read_text() for folder in PACKAGE_DIRS for p in (REPO / folder).rglob("*.py"))
    spare = [n for n in names if not re.search(rf"^\s*(import|from) {n}\b", source, re.M)]
    assert not spare, f"runtime dependencies nothing in moet_cache imports: {spare} (drop them from pyproject.toml)"
