"""The cache's records (the contract with the runtime) and their strict JSON reading.

Every manifest is refused as a whole when anything is off: wrong type, number out of range,
unknown format version, a path that is absolute or climbs out of the cache. The JSON Schemas under
manifests/ describe the same documents; tests check that what we write validates against them.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from . import layout as L
from ..enums import BaseTable, ScaleForm, SourceLayout, StrEnum
from ..errors import InputError
from ..format.families import FAMILY_CLASSES, Family
from ..fsutil import atomic_write_json, read_json_file, safe_relpath
from ..format.modelconfig import ModelConfig
from ..stheader import DTYPES as _DTYPE_TABLE


def utc_now() -> str:
    """The one timestamp format of the cache's records (created, committed_at, verified_at): UTC, seconds, Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


FORMAT_VERSION = 1
CACHE_MANIFEST = "cache.json"
COMMIT_RECORD = "COMMIT.json"
VERIFIED_STATE = ".state/verified.json"
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
MAX_INT = 1 << 53
DTYPES = tuple(_DTYPE_TABLE)  # every safetensors dtype moet-cache carries (stheader.DTYPES)


class ManifestError(InputError):
    """A manifest is malformed (a cache that cannot be trusted; rebuild it)."""


def _fail(where: str, msg: str) -> ManifestError:
    return ManifestError(f"{where}: {msg}", "the cache manifest is damaged; run moet-cache build again")


def _obj(v: Any, where: str, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A JSON object; with `keys`, one that holds no other key (the schemas close every object we write:
    a key this version does not know is a cache it cannot read right, not one to guess at)."""
    if not isinstance(v, dict):
        raise _fail(where, "expected a JSON object")
    if keys is not None:
        unknown = sorted(k for k in v if k not in keys)
        if unknown:
            raise _fail(where, f"unknown key {unknown[0]!r}")
    return v


def _int(d: dict[str, Any], key: str, where: str, lo: int = 0, hi: int = MAX_INT) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _fail(where, f"{key} must be an integer in [{lo}, {hi}], found {v!r}")
    return v


def _float(d: dict[str, Any], key: str, where: str) -> float:
    v = d.get(key)
    # A range check, not math.isfinite (which raises OverflowError on 10**400); it also refuses NaN and inf.
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e300:
        raise _fail(where, f"{key} must be a finite non-negative number, found {v!r}")
    return float(v)


def _str(d: dict[str, Any], key: str, where: str, optional: bool = False) -> str:
    v = d.get(key)
    if v is None and optional:
        return ""
    if not isinstance(v, str) or len(v) > 4096:
        raise _fail(where, f"{key} must be a string, found {type(v).__name__}")
    return v


def _hex(d: dict[str, Any], key: str, where: str) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not _HEX32.match(v):
        raise _fail(where, f"{key} must be a 32-digit xxh3-128 hex digest")
    return v


def _list(d: dict[str, Any], key: str, where: str, max_len: int = 1 << 22) -> list[Any]:
    v = d.get(key)
    if not isinstance(v, list) or len(v) > max_len:
        raise _fail(where, f"{key} must be a list")
    return v


def _path(d: dict[str, Any], key: str, where: str) -> str:
    v = d.get(key)
    try:
        return safe_relpath(v, f"{where}: {key}")
    except InputError as e:
        raise ManifestError(e.message, "the cache manifest names a path outside the cache; rebuild it") from None


def _version(d: dict[str, Any], fmt: str, where: str) -> None:
    if d.get("format") != fmt:
        raise _fail(where, f"format must be {fmt!r}, found {d.get('format')!r}")
    if isinstance(d.get("format_version"), bool) or d.get("format_version") != FORMAT_VERSION:  # True == 1
        raise ManifestError(
            f"{where}: format_version {d.get('format_version')!r} is not supported (this moet-cache reads {FORMAT_VERSION})",
            "rebuild the cache with this version of moet-cache")


def _enum(d: dict[str, Any], key: str, where: str, kind: type[StrEnum]) -> Any:
    v = d.get(key)
    if not isinstance(v, str) or v not in kind.names():
        raise _fail(where, f"{key} must be one of {', '.join(kind.names())}, found {v!r}")
    return kind(v)


# --- records -----------------------------------------------------------------------------------
class LayerKind(StrEnum):
    MOE = "moe"    # a layer of the main model
    MTP = "mtp"    # a multi-token-prediction (drafter) layer


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    xxh3: str
    role: L.Role

    @classmethod
    def parse(cls, d: Any, where: str) -> FileEntry:
        d = _obj(d, where, ("path", "size", "xxh3", "role"))
        return cls(_path(d, "path", where), _int(d, "size", where), _hex(d, "xxh3", where),
                   _enum(d, "role", where, L.Role))


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    xxh3: str

    @classmethod
    def parse(cls, d: Any, where: str) -> TensorEntry:
        d = _obj(d, where, ("name", "file", "dtype", "shape", "begin", "end", "xxh3"))
        shape = _list(d, "shape", where, 8)
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_INT for x in shape):
            raise _fail(where, "shape must be a list of non-negative integers")
        dtype = _str(d, "dtype", where)
        if dtype not in DTYPES:
            raise _fail(where, f"unknown dtype {dtype!r}")
        t = cls(_str(d, "name", where), _path(d, "file", where), dtype, tuple(shape),
                _int(d, "begin", where), _int(d, "end", where), _hex(d, "xxh3", where))
        if t.end < t.begin:
            raise _fail(where, f"tensor {t.name} ends before it begins")
        return t

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclass(frozen=True)
class LayerManifest:
    """One served layer: its plane files, its tensors and each expert's base-only error."""

    layer: int
    kind: LayerKind
    n_experts: int
    hidden_size: int
    intermediate_size: int
    build_key: str                  # digest of what the layer's bytes depend on (source, format)
    expert_delta_bytes: int         # the delta planes of one expert (w13 + w2)
    source_bytes: int               # the source's bytes of this layer's routed experts
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    sq_error: tuple[float, ...]     # per expert: sum of (FP4 - base-only)^2 over w13 and w2
    energy: tuple[float, ...]       # per expert: sum of FP4 weight^2, for relative errors
    source_format: str = ""         # the source's expert format (formats.FORMATS); "" = the cache's layout's
    scale_forms: tuple[tuple[str, ScaleForm], ...] = ()  # (block-scale tensor, form); () = e4m3-16 for both
    mid_sq_error: tuple[float, ...] = ()  # per expert: sum of (FP4 - 3-bit)^2; () in caches from before the mid tier

    def scale_form(self, tensor: str) -> ScaleForm:
        return dict(self.scale_forms).get(tensor, ScaleForm.E4M3_16)

    def geometry(self) -> Any:
        """The layer's shapes and byte counts (geometry.LayerGeometry)."""
        from .geometry import LayerGeometry
        names = {t.name for t in self.tensors}
        return LayerGeometry(self.n_experts, self.hidden_size, self.intermediate_size,
                             self.scale_form(L.W13_SCALE), self.scale_form(L.W2_SCALE),
                             L.W13_INPUT_SCALE in names)

    def to_dict(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.source_format:
            extra["source_format"] = self.source_format
        if self.scale_forms:
            extra["scale_forms"] = dict(self.scale_forms)
        if self.mid_sq_error:
            extra["mid_sq_error"] = list(self.mid_sq_error)
        return {**extra, 
            "format": "moet-cache-layer", "format_version": FORMAT_VERSION,
            "layer": self.layer, "kind": self.kind, "n_experts": self.n_experts,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "build_key": self.build_key, "expert_delta_bytes": self.expert_delta_bytes,
            "source_bytes": self.source_bytes,
            "files": [asdict(f) for f in self.files],
            "tensors": [t.to_dict() for t in self.tensors],
            "sq_error": list(self.sq_error), "energy": list(self.energy),
        }

    @classmethod
    def parse(cls, d: Any, where: str) -> LayerManifest:
        d = _obj(d, where, ("format", "format_version", "layer", "kind", "n_experts", "hidden_size",
                            "intermediate_size", "build_key", "expert_delta_bytes", "source_bytes", "files",
                            "tensors", "sq_error", "energy", "source_format", "scale_forms", "mid_sq_error"))
        _version(d, "moet-cache-layer", where)
        kind = _enum(d, "kind", where, LayerKind)
        n = _int(d, "n_experts", where, 1, 1 << 16)
        files = tuple(FileEntry.parse(x, where) for x in _list(d, "files", where, 64))
        tensors = tuple(TensorEntry.parse(x, where) for x in _list(d, "tensors", where, 4096))
        names = {f.path for f in files}
        for t in tensors:
            if t.file not in names:
                raise _fail(where, f"tensor {t.name} is in {t.file}, which the layer does not list")
        err = [_float({"v": v}, "v", where) for v in _list(d, "sq_error", where)]
        energy = [_float({"v": v}, "v", where) for v in _list(d, "energy", where)]
        if len(err) != n or len(energy) != n:
            raise _fail(where, "sq_error and energy need one entry per expert")
        mid_err = [_float({"v": v}, "v", where) for v in _list(d, "mid_sq_error", where)] if "mid_sq_error" in d else []
        if mid_err and len(mid_err) != n:
            raise _fail(where, "mid_sq_error needs one entry per expert")
        from ..format.formats import FORMATS  # here: formats imports numpy, which the CLI does not load
        fmt = d.get("source_format", "")
        if not isinstance(fmt, str) or (fmt != "" and fmt not in FORMATS):  # a list or object: no crash
            raise _fail(where, f"source_format must be one of {sorted(FORMATS)}, found {fmt!r}")
        forms = d.get("scale_forms", {})
        if not isinstance(forms, dict) or len(forms) > 8 or not all(
                isinstance(k, str) and isinstance(v, str) and v in ScaleForm.names() for k, v in forms.items()):
            raise _fail(where, f"scale_forms must map block-scale tensors to one of {list(ScaleForm.names())}")
        return cls(_int(d, "layer", where, 0, 1 << 16), kind, n,
                   _int(d, "hidden_size", where, 1), _int(d, "intermediate_size", where, 1),
                   _hex(d, "build_key", where), _int(d, "expert_delta_bytes", where),
                   _int(d, "source_bytes", where), files, tensors, tuple(err), tuple(energy),
                   fmt, tuple(sorted((k, ScaleForm(v)) for k, v in forms.items())), tuple(mid_err))


@dataclass(frozen=True)
class LayerRef:
    layer: int
    manifest: str
    size: int
    xxh3: str


@dataclass(frozen=True)
class BuildParams:
    layers: tuple[int, ...]
    include_mtp: bool
    lossless: bool
    delta_budget_bytes: int
    profile_xxh3: str | None
    base_table: BaseTable = BaseTable.FITTED  # every base table's form; written for x4 only (absent: fitted)
    mid_budget_bytes: int = 0  # the mid tier's budget; written only when > 0 (absent: no mid tier)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = list(self.layers)
        if not self.mid_budget_bytes:
            del d["mid_budget_bytes"]
        # written only for x4: a fitted cache's manifest stays what older moet-cache versions read
        if self.base_table == BaseTable.FITTED:
            del d["base_table"]
        else:
            d["base_table"] = str(self.base_table)
        return d


@dataclass(frozen=True)
class ShardFingerprint:
    name: str
    size: int
    mtime_ns: int
    header_xxh3: str


@dataclass(frozen=True)
class SourceFingerprint:
    """What identifies a source checkpoint: its shards' sizes, times and header digests, its config."""

    shards: tuple[ShardFingerprint, ...]
    config_xxh3: str
    index_xxh3: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"config_xxh3": self.config_xxh3, "index_xxh3": self.index_xxh3,
                "shards": [asdict(s) for s in self.shards]}

    @classmethod
    def parse(cls, d: Any, where: str) -> SourceFingerprint:
        d = _obj(d, where, ("config_xxh3", "index_xxh3", "shards"))
        shards = []
        for x in _list(d, "shards", where, 1 << 20):
            x = _obj(x, where, ("name", "size", "mtime_ns", "header_xxh3"))
            mtime = x.get("mtime_ns")
            if isinstance(mtime, bool) or not isinstance(mtime, int):  # any integer: a clock may be before 1970
                raise _fail(where, f"mtime_ns must be an integer, found {mtime!r}")
            shards.append(ShardFingerprint(_str(x, "name", where), _int(x, "size", where), mtime,
                                           _hex(x, "header_xxh3", where)))
        if "index_xxh3" not in d:  # always written (null for a single-file checkpoint)
            raise _fail(where, "index_xxh3 is missing")
        index = None if d["index_xxh3"] is None else _hex(d, "index_xxh3", where)
        return cls(tuple(shards), _hex(d, "config_xxh3", where), index)


_MODEL_KEYS = tuple(f.name for f in fields(ModelConfig))


@dataclass(frozen=True)
class CacheModel:
    """The model a cache serves: its config keys and (since the V4 family) its naming family."""

    config: ModelConfig
    family: Family | None = None    # None: caches from before the record (then the V3 family, exporter)

    def to_dict(self) -> dict[str, Any]:
        return {**self.config.to_dict(), **({"family": self.family.to_dict()} if self.family else {})}

    @classmethod
    def parse(cls, d: Any, where: str) -> CacheModel:
        d = _obj(d, where, (*_MODEL_KEYS, "family"))
        if not isinstance(d.get("model_type", ""), str):  # config.json may hold anything there; we write a string
            raise _fail(where, "model_type must be a string")
        try:
            config = ModelConfig.from_dict({k: v for k, v in d.items() if k != "family"})
        except InputError as e:  # its message names config.json: say where it really was
            msg = e.message.replace("config.json: ", "").replace("config.json", "the model record")
            raise _fail(where, msg) from None
        if "family" not in d:
            return cls(config)
        fam = _obj(d["family"], where + ": family", ("name", "moe_layers", "mtp_layers"))
        name = fam.get("name")
        kind = FAMILY_CLASSES.get(name) if isinstance(name, str) else None
        if kind is None:
            raise _fail(where, f"family.name must be one of {', '.join(FAMILY_CLASSES)}, found {fam.get('name')!r}")
        layers = [tuple(_layer_numbers(fam, key, where + ": family")) for key in ("moe_layers", "mtp_layers")]
        return cls(config, kind(name, config.num_hidden_layers, *layers))


def _layer_numbers(d: dict[str, Any], key: str, where: str) -> list[int]:
    v = _list(d, key, where, 1 << 16)
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 16 for x in v):
        raise _fail(where, f"{key} must be a list of layer numbers")
    return v


@dataclass(frozen=True)
class CacheManifest:
    """The whole cache: where it came from, how it was built, every layer manifest and file."""

    tool_version: str
    created: str
    source_path: str
    source_layout: SourceLayout
    source_fingerprint: SourceFingerprint
    model: CacheModel
    build: BuildParams
    layers: tuple[LayerRef, ...]
    files: tuple[FileEntry, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "moet-cache", "format_version": FORMAT_VERSION,
            "tool_version": self.tool_version, "created": self.created,
            "source": {"path": self.source_path, "layout": self.source_layout,
                       "fingerprint": self.source_fingerprint.to_dict()},
            "model": self.model.to_dict(), "build": self.build.to_dict(),
            "layers": [asdict(r) for r in self.layers],
            "files": [asdict(f) for f in self.files],
        }

    def file(self, role: L.Role) -> FileEntry | None:
        return next((f for f in self.files if f.role == role), None)

    @classmethod
    def parse(cls, d: Any, where: str = CACHE_MANIFEST) -> CacheManifest:
        d = _obj(d, where, ("format", "format_version", "tool_version", "created", "source", "model", "build",
                            "layers", "files"))
        _version(d, "moet-cache", where)
        src = _obj(d.get("source"), where + ": source", ("path", "layout", "fingerprint"))
        build = _obj(d.get("build"), where + ": build", tuple(f.name for f in fields(BuildParams)))
        layers_sel = _layer_numbers(build, "layers", where + ": build")
        for key in ("include_mtp", "lossless"):
            if not isinstance(build.get(key), bool):
                raise _fail(where, f"build.{key} must be true or false")
        if "profile_xxh3" not in build:  # always written (null without a routing profile)
            raise _fail(where, "build.profile_xxh3 is missing")
        prof = build["profile_xxh3"]
        if prof is not None:
            _hex(build, "profile_xxh3", where)
        # base_table: written for x4 caches only; a cache without it was built with fitted tables.
        form = _enum(build, "base_table", where, BaseTable) if "base_table" in build else BaseTable.FITTED
        mid_budget = _int(build, "mid_budget_bytes", where, 1) if "mid_budget_bytes" in build else 0
        params = BuildParams(tuple(layers_sel), build["include_mtp"], build["lossless"],
                             _int(build, "delta_budget_bytes", where), prof, form, mid_budget)
        refs = []
        for x in _list(d, "layers", where, 1 << 16):
            x = _obj(x, where, tuple(f.name for f in fields(LayerRef)))
            refs.append(LayerRef(_int(x, "layer", where, 0, 1 << 16), _path(x, "manifest", where),
                                 _int(x, "size", where), _hex(x, "xxh3", where)))
        if len({r.layer for r in refs}) != len(refs):
            raise _fail(where, "a layer is listed twice")
        files = tuple(FileEntry.parse(x, where) for x in _list(d, "files", where, 1 << 20))
        paths = [f.path for f in files] + [r.manifest for r in refs]
        if len(set(paths)) != len(paths):
            raise _fail(where, "a file is listed twice")
        return cls(_str(d, "tool_version", where), _str(d, "created", where),
                   _str(src, "path", where), _enum(src, "layout", where, SourceLayout),
                   SourceFingerprint.parse(src.get("fingerprint"), where + ": source.fingerprint"),
                   CacheModel.parse(d.get("model"), where + ": model"), params, tuple(refs), files)


@dataclass(frozen=True)
class CommitRecord:
    """Written last and atomically: the cache is complete exactly when this names the manifest's digest."""

    manifest: str
    manifest_size: int
    manifest_xxh3: str
    committed_at: str

    def to_dict(self) -> dict[str, Any]:
        return {"format": "moet-cache-commit", "format_version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def parse(cls, d: Any, where: str = COMMIT_RECORD) -> CommitRecord:
        d = _obj(d, where, ("format", "format_version", "manifest", "manifest_size", "manifest_xxh3", "committed_at"))
        _version(d, "moet-cache-commit", where)
        return cls(_path(d, "manifest", where), _int(d, "manifest_size", where),
                   _hex(d, "manifest_xxh3", where), _str(d, "committed_at", where))


@dataclass(frozen=True)
class DeltaIndex:
    """Which (layer, expert) delta planes the tier pack holds; one entry per served layer."""

    pack: str
    budget_bytes: int
    used_bytes: int
    weighted_by_profile: bool
    layers: tuple[tuple[int, tuple[int, ...]], ...]
    # The mid tier, in the same pack: its budget, bytes used (planes and tables) and experts per served layer;
    # mid_layers None: no mid tier (the keys are not written, as in caches from before it).
    mid_budget_bytes: int = 0
    mid_used_bytes: int = 0
    mid_layers: tuple[tuple[int, tuple[int, ...]], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        mid = {} if self.mid_layers is None else {
            "mid_budget_bytes": self.mid_budget_bytes, "mid_used_bytes": self.mid_used_bytes,
            "mid_layers": [{"layer": layer, "experts": list(ex)} for layer, ex in self.mid_layers]}
        return {
            "format": "moet-cache-delta-index", "format_version": FORMAT_VERSION,
            "pack": self.pack, "budget_bytes": self.budget_bytes, "used_bytes": self.used_bytes,
            "weighted_by_profile": self.weighted_by_profile,
            "layers": [{"layer": layer, "experts": list(ex)} for layer, ex in self.layers], **mid,
        }

    def experts_of(self, layer: int) -> tuple[int, ...] | None:
        return next((ex for lyr, ex in self.layers if lyr == layer), None)

    def mid_experts_of(self, layer: int) -> tuple[int, ...]:
        """The layer's mid-tier experts (none without a mid tier)."""
        return next((ex for lyr, ex in self.mid_layers or () if lyr == layer), ())

    @classmethod
    def parse(cls, d: Any, where: str = "delta index") -> DeltaIndex:
        mid_keys = ("mid_budget_bytes", "mid_used_bytes", "mid_layers")
        d = _obj(d, where, ("format", "format_version", "pack", "budget_bytes", "used_bytes", "weighted_by_profile",
                            "layers", *mid_keys))
        _version(d, "moet-cache-delta-index", where)
        if not isinstance(d.get("weighted_by_profile"), bool):
            raise _fail(where, "weighted_by_profile must be true or false")
        layers = _expert_lists(d, "layers", where)
        present = [k in d for k in mid_keys]
        if any(present) and not all(present):
            raise _fail(where, "a mid tier needs mid_budget_bytes, mid_used_bytes and mid_layers together")
        mid = (_int(d, "mid_budget_bytes", where), _int(d, "mid_used_bytes", where),
               _expert_lists(d, "mid_layers", where)) if all(present) else (0, 0, None)
        return cls(_path(d, "pack", where), _int(d, "budget_bytes", where), _int(d, "used_bytes", where),
                   d["weighted_by_profile"], layers, *mid)


def _expert_lists(d: dict[str, Any], key: str, where: str) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """[{layer, experts}] -> ((layer, sorted distinct experts), ...)."""
    layers = []
    for x in _list(d, key, where, 1 << 16):
        x = _obj(x, where, ("layer", "experts"))
        ex = _list(x, "experts", where, 1 << 16)
        if not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < 1 << 16 for e in ex) \
                or sorted(set(ex)) != ex:
            raise _fail(where, "experts must be a sorted list of distinct expert numbers")
        layers.append((_int(x, "layer", where, 0, 1 << 16), tuple(ex)))
    return tuple(layers)


def loads_record(data: bytes, where: str) -> Any:
    """Decode a manifest's bytes; junk, bad UTF-8 or absurd nesting is a ManifestError, never a crash."""
    import json
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ManifestError(f"{where} is not valid JSON", "the cache manifest is damaged; run moet-cache build again") from None


def load_record(path: Path, parser: Any, where: str | None = None) -> Any:
    """Read a JSON manifest file and parse it strictly; any problem is a ManifestError."""
    try:
        data = read_json_file(path)
    except InputError as e:
        raise ManifestError(e.message, "the cache manifest is damaged; run moet-cache build again") from None
    return parser(data, where or path.name)


def write_record(path: Path, record: Any) -> bytes:
    return atomic_write_json(path, record.to_dict())


@dataclass(frozen=True)
class PartManifest:
    """A finished piece of a build that is not a layer (a dense shard, a staged delta file), for resume."""

    build_key: str
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"format": "moet-cache-part", "format_version": FORMAT_VERSION, "build_key": self.build_key,
                "files": [asdict(f) for f in self.files], "tensors": [t.to_dict() for t in self.tensors],
                "metadata": self.metadata}

    @classmethod
    def parse(cls, d: Any, where: str) -> PartManifest:
        d = _obj(d, where, ("format", "format_version", "build_key", "files", "tensors", "metadata"))
        _version(d, "moet-cache-part", where)
        if "metadata" not in d:  # always written (null when there is none)
            raise _fail(where, "metadata is missing")
        meta = d.get("metadata")
        if meta is not None and not (isinstance(meta, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
            raise _fail(where, "metadata must map strings to strings")
        return cls(_hex(d, "build_key", where),
                   tuple(FileEntry.parse(x, where) for x in _list(d, "files", where, 64)),
                   tuple(TensorEntry.parse(x, where) for x in _list(d, "tensors", where, 1 << 20)), meta)
