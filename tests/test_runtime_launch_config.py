"""The tuned launch steps as data (runtime/launch_config.py, runtime/configs/<device>.json): the H200's file
holds the steps the runtime has run on it, a device without a file takes the short defaults, a malformed
file is refused with one line, and a sweep's timings become a file that loads back."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from moet_cache.errors import InputError
from moet_cache.runtime import launch, launch_config
from moet_cache.runtime.launch import Config, config_named
from moet_cache.runtime.launch_config import CONFIG_DIR, PrefillLater, TunedSteps, device_file_name
from moet_cache.runtime.mma_moe import Mma
from moet_cache.runtime.mma_prefill import Prefill

H200_FILE = CONFIG_DIR / "NVIDIA_H200.json"
BENCH_MOE = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_moe.py"

# The H200's steps as launch.py held them in code (MMA_STEPS, MMA_STEPS_X4, MMA_STEPS_X4_BASE, MMA_STEPS_X4_E4M3,
# PREFILL_STEPS, PREFILL_LATER), written out literally.
SPLIT_SUM = Mma(1, 2, 2, direct=True, pdl=True, sum_in_w2=True)
WHOLE = Mma(1, 1, 1, direct=True, pdl=True)
SPLIT = Mma(1, 2, 2, direct=True, pdl=True)
LEAN = Mma(1, 2, 2, direct=True, lean=True, pdl=True)
SORTED = Mma(1, 2, 2, lean=True, pdl=True)
H200_MMA = ((0, SPLIT_SUM), (12, WHOLE), (18, SPLIT), (36, WHOLE), (288, SORTED))
H200_MMA_X4 = ((0, SPLIT_SUM), (12, WHOLE), (18, SPLIT), (24, LEAN), (224, SORTED))
H200_MMA_X4_BASE = ((0, SPLIT_SUM), (12, WHOLE), (18, SPLIT), (24, WHOLE), (72, LEAN), (224, SORTED))
H200_MMA_X4_E4M3 = ((0, SPLIT_SUM), (12, WHOLE), (18, SPLIT), (24, WHOLE), (224, SORTED))
H200_PREFILL = ((1536, Prefill(4, 4, 2, pipe=True, ctas=2)), (8192, Prefill(8, 4, 2, pipe=True, ctas=2)),
                (17408, Prefill(16, 4, 2, pipe=True, ctas=1)))
H200_PREFILL_LATER = PrefillLater(x4=0, tier=112, e4m3=160)


def test_h200_file_holds_the_steps_the_runtime_ran() -> None:
    """The packaged H200 file gives exactly the steps launch.py held in code, and a CUDA device named as
    torch names the H200 runs with them."""
    steps = launch_config.load(H200_FILE)
    assert steps == TunedSteps(mma=H200_MMA, mma_x4=H200_MMA_X4, mma_x4_base=H200_MMA_X4_BASE,
                               mma_x4_e4m3=H200_MMA_X4_E4M3, prefill=H200_PREFILL,
                               prefill_later=H200_PREFILL_LATER)
    h200 = config_named("NVIDIA H200")
    assert (h200.mma, h200.mma_x4, h200.mma_x4_base, h200.mma_x4_e4m3) == (
        H200_MMA, H200_MMA_X4, H200_MMA_X4_BASE, H200_MMA_X4_E4M3)
    assert h200.prefill == H200_PREFILL and h200.prefill_later == H200_PREFILL_LATER
    assert h200 == launch.DEFAULT
    assert device_file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert device_file_name(" NVIDIA RTX PRO 6000 Blackwell (96GB) ") == "NVIDIA_RTX_PRO_6000_Blackwell__96GB_.json"


def test_unknown_device_takes_the_short_defaults() -> None:
    """A device without a file (an RTX PRO 6000, an H100) gets launch.Config's defaults: one decode ladder for
    every layer form, the four-warp prefill steps, no form-dependent delay of the first prefill step."""
    for name in ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA H100 80GB HBM3"):
        assert launch_config.for_device(name) is None
        assert config_named(name) == Config()
    short = Config()
    assert short != launch.DEFAULT
    assert short.mma == short.mma_x4 == short.mma_x4_base == short.mma_x4_e4m3 == (
        (0, SPLIT_SUM), (12, WHOLE), (18, SPLIT), (224, SORTED))
    assert short.prefill == H200_PREFILL and short.prefill_later == PrefillLater()
    # CPU tensors (the Triton interpreter) take the defaults too; the decode and prefill kernels never run there
    assert launch.config_for(torch.device("cpu")) == short


def _write(folder: Path, text: str) -> Path:
    path = folder / device_file_name("NVIDIA H200")
    path.write_text(text)
    return path


def _edited(**changes: object) -> str:
    raw = json.loads(H200_FILE.read_text())
    for key, value in changes.items():
        if value is None:
            del raw[key]
        else:
            raw[key] = value
    return json.dumps(raw)


MALFORMED = {
    "not JSON": "{\"format\": ",
    "a list": "[]",
    "another format": _edited(format="moet-cache-manifest"),
    "a newer version": _edited(format_version=2),
    "an unknown key": _edited(extra=1),
    "no prefill steps": _edited(prefill=None),
    "an empty ladder": _edited(mma=[]),
    "a step that is not an object": _edited(mma=[[0, 1, 2, 2]]),
    "a step without its pair count": _edited(mma=[{"nt": 1, "ks13": 2, "ks2": 2}]),
    "a decode ladder not from 0": _edited(mma=[{"from": 6, "nt": 1, "ks13": 2, "ks2": 2}]),
    "descending steps": _edited(mma=[{"from": 0, "nt": 1, "ks13": 2, "ks2": 2},
                                     {"from": 24, "nt": 1, "ks13": 1, "ks2": 1},
                                     {"from": 12, "nt": 1, "ks13": 2, "ks2": 2}]),
    "a string for a count": _edited(mma=[{"from": 0, "nt": "1", "ks13": 2, "ks2": 2}]),
    "a bool for a count": _edited(mma=[{"from": 0, "nt": True, "ks13": 2, "ks2": 2}]),
    "a count for a bool": _edited(mma=[{"from": 0, "nt": 1, "ks13": 2, "ks2": 2, "pdl": 1}]),
    "an unknown block field": _edited(mma=[{"from": 0, "nt": 1, "ks13": 2, "ks2": 2, "warps": 4}]),
    "a block Mma refuses": _edited(mma=[{"from": 0, "nt": 2, "ks13": 2, "ks2": 2, "direct": True}]),
    "a prefill block Prefill refuses": _edited(prefill=[{"from": 1536, "nt": 4, "warps": 2}]),
    "a negative delay": _edited(prefill_later={"x4": 0, "tier": -1, "e4m3": 0}),
    "an unknown delay": _edited(prefill_later={"x4": 0, "tier": 1, "e4m3": 0, "fp8": 3}),
}


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_malformed_file_is_refused_with_one_line(tmp_path: Path, what: str) -> None:
    """Each malformation is one InputError that names the file and says what to do, never a traceback from
    deep inside, nor steps half taken."""
    path = _write(tmp_path, MALFORMED[what])
    with pytest.raises(InputError) as e:
        launch_config.for_device("NVIDIA H200", tmp_path)
    message = str(e.value)
    assert "\n" not in message and path.name in message
    assert e.value.hint  # regenerate or remove


def test_the_file_read_as_it_is_loads(tmp_path: Path) -> None:
    """The checks above refuse edits of the packaged file, not the file itself: an unedited copy loads."""
    shutil.copy(H200_FILE, tmp_path / H200_FILE.name)
    assert launch_config.for_device("NVIDIA H200", tmp_path) == launch_config.load(H200_FILE)
    assert launch_config.load(_write(tmp_path, _edited())) == launch_config.load(H200_FILE)


def _sweep_points() -> dict[str, list[tuple[int, object, float]]]:
    """A sweep result as bench_moe.py --sweep --write-config gathers it: (pairs, block, µs) of every candidate
    at each T (top-6), each form's winners set by hand where the H200's steps put them."""
    Tokens = (1, 2, 3, 4, 8, 16, 32, 48, 64, 256, 272, 288, 320, 1024, 1536, 2048, 4096)
    candidates = [SPLIT_SUM, WHOLE, SPLIT, LEAN, SORTED] + [block for _, block in H200_PREFILL]
    winners = {  # (from pairs, block) of each form's fastest candidate
        "mma": ((0, SPLIT_SUM), (12, WHOLE), (18, SPLIT), (48, WHOLE), (288, SORTED), (1536, H200_PREFILL[0][1])),
        "mma_x4": ((0, SPLIT_SUM), (12, WHOLE), (18, SPLIT), (24, LEAN), (1536, SORTED),
                   (1632, H200_PREFILL[0][1])),
        "mma_x4_base": ((0, SPLIT_SUM), (12, WHOLE), (18, SPLIT), (24, WHOLE), (96, LEAN), (1536, H200_PREFILL[0][1]),
                        (9216, H200_PREFILL[1][1]), (24576, H200_PREFILL[2][1])),
        "mma_x4_e4m3": ((0, SPLIT_SUM), (12, WHOLE), (18, SPLIT), (24, WHOLE), (1536, SORTED),
                        (1728, H200_PREFILL[0][1])),
    }
    points: dict[str, list[tuple[int, object, float]]] = {}
    for form, steps in winners.items():
        points[form] = []
        for T in Tokens:
            pairs = 6 * T
            best = [block for start, block in steps if pairs >= start][-1]
            points[form] += [(pairs, block, 100.0 + pairs if block == best else 200.0 + pairs + i)
                             for i, block in enumerate(candidates)]
    return points


def test_sweep_result_becomes_a_file_that_loads(tmp_path: Path) -> None:
    """bench_moe.py --sweep --write-config's writing path on a given sweep result: each form's fastest block
    from the pair count where it first wins, the prefill steps and their delays by form, written atomically
    and read back by the loader as the runtime reads it."""
    steps = launch_config.steps_from_sweep(_sweep_points())
    assert steps.mma == ((0, SPLIT_SUM), (12, WHOLE), (18, SPLIT), (48, WHOLE), (288, SORTED))
    assert steps.mma_x4 == ((0, SPLIT_SUM), (12, WHOLE), (18, SPLIT), (24, LEAN), (1536, SORTED))
    assert steps.mma_x4_base == ((0, SPLIT_SUM), (12, WHOLE), (18, SPLIT), (24, WHOLE), (96, LEAN))
    assert steps.mma_x4_e4m3 == ((0, SPLIT_SUM), (12, WHOLE), (18, SPLIT), (24, WHOLE), (1536, SORTED))
    assert steps.prefill == ((1536, H200_PREFILL[0][1]), (9216, H200_PREFILL[1][1]), (24576, H200_PREFILL[2][1]))
    # a tier's first prefill win comes 1632 - 1536 pairs later, e4m3 scales' another 1728 - 1632
    assert steps.prefill_later == PrefillLater(x4=0, tier=96, e4m3=96)
    path = tmp_path / device_file_name("NVIDIA Test GPU")
    launch_config.write(path, steps, "NVIDIA Test GPU", "a test sweep")
    assert launch_config.for_device("NVIDIA Test GPU", tmp_path) == steps
    assert json.loads(path.read_text())["device"] == "NVIDIA Test GPU"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left
    # the H200's steps written and read back are the same steps
    h200 = launch_config.load(H200_FILE)
    launch_config.write(tmp_path / "h200.json", h200, "NVIDIA H200", "copy")
    assert launch_config.load(tmp_path / "h200.json") == h200


def test_sweep_missing_a_form_is_refused() -> None:
    points = _sweep_points()
    del points["mma_x4_e4m3"]
    with pytest.raises(InputError, match="mma_x4_e4m3"):
        launch_config.steps_from_sweep(points)
    only_prefill = {name: [(6 * 4096, H200_PREFILL[2][1], 1.0)] for name in launch_config.DECODE_LADDERS}
    with pytest.raises(InputError, match="no decode block"):
        launch_config.steps_from_sweep(only_prefill)
    only_decode = {name: [(6, SPLIT_SUM, 1.0)] for name in launch_config.DECODE_LADDERS}
    with pytest.raises(InputError, match="no prefill block"):
        launch_config.steps_from_sweep(only_decode)


def test_bench_moe_write_config_writes_the_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """bench_moe.py's --write-config step itself, on a given sweep (no GPU here): the file it writes is the
    loader's steps for that sweep, named for the device, saying which command and commit measured it."""
    spec = importlib.util.spec_from_file_location("bench_moe", BENCH_MOE)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_moe", bench)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA Test GPU")
    monkeypatch.setattr(sys, "argv", ["bench_moe.py", "--sweep", "--write-config", str(tmp_path / "t.json")])
    args = argparse.Namespace(write_config=str(tmp_path / "t.json"), harness=["write", "stream"])
    bench.write_config(args, _sweep_points())
    assert launch_config.load(tmp_path / "t.json") == launch_config.steps_from_sweep(_sweep_points())
    raw = json.loads((tmp_path / "t.json").read_text())
    assert raw["device"] == "NVIDIA Test GPU"
    assert raw["source"].startswith("benchmarks/bench_moe.py --sweep --write-config") and "commit" in raw["source"]
    assert set(bench.SWEEP_FORMS) == set(launch_config.DECODE_LADDERS)


def test_a_cuda_device_runs_the_steps_of_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """launch.config_for, as fused_moe_cuda, warm_up and the layout call it: the device's name picks the file
    (torch.cuda.get_device_name stood in for, no GPU here), once a device."""
    asked: list[int] = []
    for name, want in (("NVIDIA H200", launch.DEFAULT), ("NVIDIA RTX PRO 6000 Blackwell Server Edition", Config())):
        launch._config_of_index.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index, name=name: asked.append(index) or name)
        assert launch.config_for(torch.device("cuda", 1)) == want
        assert launch.config_for(torch.device("cuda", 1)) == want
    launch._config_of_index.cache_clear()
    assert asked == [1, 1]  # asked once a device, not on every call
