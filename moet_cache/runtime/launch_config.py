"""The tuned launch steps as data: `runtime/configs/<device>.json`, one file a device, as vLLM keeps its
fused_moe block sizes (`fused_moe/configs/E=...,device_name=NVIDIA_H200.json`).

A file holds the decode steps of each layer form and the prefill steps, each step the pair count
P = T * top_k it takes over from and its block. `benchmarks/bench_moe.py --sweep --write-config` measures
the candidates on the device at hand and writes its file (`steps_from_sweep`, `write`); `launch.config_for`
reads the device's file and falls back to `launch.Config`'s short defaults where there is none.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..fsutil import atomic_write_bytes, read_json_file
from .mma_moe import Mma
from .mma_prefill import Prefill

#: the packaged files, one a device
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
FORMAT = "moet-cache-launch-config"
FORMAT_VERSION = 1
#: the decode ladders a file holds, by launch.Config's field names: fitted tables (the build's default); x4
#: tables with e8m0 scales and a tier; the same without a tier; x4 tables with e4m3 scales
DECODE_LADDERS = ("mma", "mma_x4", "mma_x4_base", "mma_x4_e4m3")
_HINT = "regenerate it with benchmarks/bench_moe.py --sweep --write-config, or remove it to run on the defaults"


@dataclass(frozen=True)
class PrefillLater:
    """The pairs by which a layer form's first prefill step comes after `Config.prefill`'s: the prefill
    blocks' time grows more than the sorted lean decode blocks' with the x4 layout, a tier and e4m3 scales."""

    x4: int = 0
    tier: int = 0
    e4m3: int = 0

    def of(self, x4: bool, e4m3: bool, tier: bool) -> int:
        return self.x4 * x4 + self.tier * tier + self.e4m3 * e4m3


Steps = tuple[tuple[int, Any], ...]  # (from P, block), ascending, the first from 0


@dataclass(frozen=True)
class TunedSteps:
    """One device's steps: launch.Config's fields of the same names."""

    mma: Steps
    mma_x4: Steps
    mma_x4_base: Steps
    mma_x4_e4m3: Steps
    prefill: Steps
    prefill_later: PrefillLater

    def fields(self) -> dict[str, Any]:
        """The values by field name, as launch.Config takes them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def device_file_name(device_name: str) -> str:
    """The file of a device named `device_name` (torch.cuda.get_device_name): blanks and anything but letters,
    digits, '.' and '-' as '_', as vLLM names its configs ("NVIDIA H200" -> "NVIDIA_H200.json")."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", device_name.strip()) + ".json"


def _block_json(block: Mma | Prefill) -> dict[str, Any]:
    return dataclasses.asdict(block)


def _steps_json(steps: Steps) -> list[dict[str, Any]]:
    return [{"from": start, **_block_json(block)} for start, block in steps]


def to_json(steps: TunedSteps, device: str, source: str) -> dict[str, Any]:
    """The file's content: `device` as torch names it, `source` how the steps were measured."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "device": device, "source": source,
            **{name: _steps_json(getattr(steps, name)) for name in DECODE_LADDERS},
            "prefill": _steps_json(steps.prefill), "prefill_later": dataclasses.asdict(steps.prefill_later)}


def dumps(obj: dict[str, Any]) -> str:
    """The file's text: one step a line, so that a diff of two sweeps shows the steps that moved."""
    def value(v: Any) -> str:
        if isinstance(v, list):
            return "[\n" + ",\n".join(f"  {json.dumps(item)}" for item in v) + "\n ]"
        return json.dumps(v)
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {value(v)}" for k, v in obj.items()) + "\n}\n"


def write(path: Path, steps: TunedSteps, device: str, source: str) -> None:
    """Write the file atomically (a reader sees the old file or the new one); it is read back and checked."""
    atomic_write_bytes(path, dumps(to_json(steps, device, source)).encode())
    load(path)


def _refuse(path: Path, what: str) -> InputError:
    return InputError(f"launch config {path.name}: {what}", _HINT)


def _ints(path: Path, where: str, obj: Mapping[str, Any], kinds: Mapping[str, type]) -> dict[str, Any]:
    """obj's values checked against kinds (bool is not taken for int, nor int for bool); missing keys take
    the dataclass default."""
    if unknown := sorted(set(obj) - set(kinds)):
        raise _refuse(path, f"{where} has unknown keys {unknown}")
    for key, value in obj.items():
        if type(value) is not kinds[key]:
            raise _refuse(path, f"{where}: {key} must be {kinds[key].__name__}, not {json.dumps(value)[:40]}")
    return dict(obj)


def _parse_steps(path: Path, name: str, raw: Any, block_type: type) -> Steps:
    if not isinstance(raw, list) or not raw:
        raise _refuse(path, f"{name} must be a non-empty list of steps")
    kinds = {"from": int, **{f.name: f.type if isinstance(f.type, type) else
                             {"int": int, "bool": bool}[f.type] for f in dataclasses.fields(block_type)}}
    steps = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise _refuse(path, f"{name}[{i}] must be an object")
        values = _ints(path, f"{name}[{i}]", item, kinds)
        start = values.pop("from", None)
        if start is None or start < 0:
            raise _refuse(path, f"{name}[{i}] needs a 'from' pair count >= 0")
        try:
            steps.append((start, block_type(**values)))
        except (TypeError, ValueError) as e:
            raise _refuse(path, f"{name}[{i}]: {e}") from None
    starts = [start for start, _ in steps]
    if starts[0] != 0 and block_type is Mma:
        raise _refuse(path, f"{name} must start from 0 pairs")
    if any(b <= a for a, b in pairwise(starts)):
        raise _refuse(path, f"{name}'s 'from' pair counts must ascend")
    return tuple(steps)


def load(path: Path) -> TunedSteps:
    """Read and check one file; anything malformed is one InputError naming the file."""
    raw = read_json_file(path)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("format_version") != FORMAT_VERSION:
        raise _refuse(path, f"not a {FORMAT} file of version {FORMAT_VERSION}")
    known = {"format", "format_version", "device", "source", "prefill", "prefill_later", *DECODE_LADDERS}
    if unknown := sorted(set(raw) - known):
        raise _refuse(path, f"unknown keys {unknown}")
    if missing := sorted({"prefill", "prefill_later", *DECODE_LADDERS} - set(raw)):
        raise _refuse(path, f"missing {missing}")
    later = raw["prefill_later"]
    if not isinstance(later, dict):
        raise _refuse(path, "prefill_later must be an object")
    later = _ints(path, "prefill_later", later, {"x4": int, "tier": int, "e4m3": int})
    if any(v < 0 for v in later.values()):
        raise _refuse(path, "prefill_later's pair counts must be >= 0")
    steps = {name: _parse_steps(path, name, raw[name], Mma) for name in DECODE_LADDERS}
    return TunedSteps(**steps, prefill=_parse_steps(path, "prefill", raw["prefill"], Prefill),
                      prefill_later=PrefillLater(**later))


def for_device(device_name: str, folder: Path = CONFIG_DIR) -> TunedSteps | None:
    """The steps of the device named `device_name`, or None where `folder` has no file for it."""
    path = folder / device_file_name(device_name)
    return load(path) if path.is_file() else None


def _ladder(points: Iterable[tuple[int, Any, float]]) -> tuple[Steps, list[tuple[int, Any]]]:
    """The fastest block at each measured pair count, and the steps where the winner changes: (decode steps,
    (pairs, prefill block) of every point a prefill block won)."""
    best: dict[int, tuple[float, Any]] = {}
    for pairs, block, us in points:
        if pairs not in best or us < best[pairs][0]:
            best[pairs] = (us, block)
    decode: list[tuple[int, Any]] = []
    prefill: list[tuple[int, Any]] = []
    for pairs in sorted(best):
        block = best[pairs][1]
        out = prefill if isinstance(block, Prefill) else decode
        if not out or out[-1][1] != block:
            out.append((pairs, block))
    if decode:
        decode[0] = (0, decode[0][1])
    return tuple(decode), prefill


def steps_from_sweep(points: Mapping[str, Iterable[tuple[int, Any, float]]]) -> TunedSteps:
    """A device's steps from a sweep: for each of DECODE_LADDERS' forms, (pairs, block, µs) of every candidate
    timed (in `points`, by ladder name). Each form's decode steps are its fastest Mma block, a step where the winner changes (the first from
    0); the prefill steps are the x4 e8m0 base-only form's (`mma_x4_base`) fastest Prefill blocks from where
    each first wins; `prefill_later` is how many pairs later the first prefill block wins with a tier
    (`mma_x4` against `mma_x4_base`) and with e4m3 scales (`mma_x4_e4m3` against `mma_x4`); a form whose
    decode blocks win at every point measured counts as later by nothing. Forms the sweep did not time
    are refused."""
    if missing := [name for name in DECODE_LADDERS if name not in points]:
        raise InputError(f"the sweep timed no layer of the forms {missing}", "sweep every form the config holds")
    ladders = {name: _ladder(points[name]) for name in DECODE_LADDERS}
    if empty := [name for name, (decode, _) in ladders.items() if not decode]:
        raise InputError(f"no decode block won a point of {empty}", "sweep token counts down to T = 1")
    prefill = ladders["mma_x4_base"][1]
    if not prefill:
        raise InputError("no prefill block won a point of mma_x4_base", "sweep token counts up to T = 4096")
    first = {name: ladders[name][1][0][0] if ladders[name][1] else None for name in DECODE_LADDERS}

    def later(name: str, than: str) -> int:
        return max(0, first[name] - first[than]) if first[name] is not None and first[than] is not None else 0

    return TunedSteps(**{name: ladders[name][0] for name in DECODE_LADDERS}, prefill=tuple(prefill),
                      prefill_later=PrefillLater(x4=0, tier=later("mma_x4", "mma_x4_base"),
                                                 e4m3=later("mma_x4_e4m3", "mma_x4")))
