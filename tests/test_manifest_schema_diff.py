"""The two sources of truth for the manifest rules, compared: the hand parsers of moet_cache.cache.manifest and the
JSON Schemas of manifests/. Every field of each written record is deleted, set to a value of every JSON type,
or given an unknown key (the document itself too), and both judge the result.

The parsers never crash (a ManifestError, nothing else) and refuse exactly what the schemas refuse, except
the rules across fields in KNOWN, which the parsers alone can state (each with its reason). A new
disagreement fails, and so does one that has gone (take it out of KNOWN).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import jsonschema
import pytest

from moet_cache.cache.manifest import (CacheManifest, CommitRecord, DeltaIndex, LayerManifest, ManifestError,
                                      PartManifest)

SCHEMAS = Path(__file__).resolve().parents[1] / "manifests"
VALUES: list[Any] = ["x", -1, 0, None, [], {}, 1.5, True, 2**60]

RECORDS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "cache-manifest": ("cache.json", lambda d: CacheManifest.parse(d)),
    "commit": ("COMMIT.json", lambda d: CommitRecord.parse(d)),
    "delta-index": ("delta/tier.json", lambda d: DeltaIndex.parse(d)),
    "part-manifest": ("delta/tier.part.json", lambda d: PartManifest.parse(d, "part")),
    "layer-manifest": ("layers/layer-001.json", lambda d: LayerManifest.parse(d, "layer")),
}

# (record, field pattern, mutation, who refuses it): "parser" = only the parser refuses it. What is left are
# rules across fields, which a JSON Schema cannot state: sorted distinct experts, one sq_error and energy entry
# per expert, every tensor's file listed by its layer, a tensor's end not before its begin.
KNOWN = {
    ("delta-index", "layers.*.experts.*", "set 0", "parser"),
    ("layer-manifest", "energy", "set []", "parser"),
    ("layer-manifest", "sq_error", "set []", "parser"),
    ("layer-manifest", "files", "set []", "parser"),
    ("layer-manifest", "files.*.path", 'set "x"', "parser"),
    ("layer-manifest", "tensors.*.end", "set 0", "parser"),
    ("layer-manifest", "tensors.*.file", 'set "x"', "parser"),
}


def _paths(v: Any, p: tuple = ()) -> Iterator[tuple]:
    yield p
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, p + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v[:2]):
            yield from _paths(x, p + (i,))


def _at(d: Any, p: tuple) -> Any:
    for k in p:
        d = d[k]
    return d


def _pattern(p: tuple) -> str:
    return ".".join("*" if isinstance(k, int) else k for k in p) or "(root)"


def _mutants(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for p in _paths(doc):
        muts: list[tuple[str, Any]] = [("del", None)] if p and isinstance(p[-1], str) else []
        muts += [("set", v) for v in VALUES] if p else []
        if isinstance(_at(doc, p), dict):
            muts.append(("addkey", None))
        for kind, v in muts:
            d = copy.deepcopy(doc)
            if not p:  # the document itself: only an unknown key
                d["zz_unknown"] = 1
                yield _pattern(p), kind, d
                continue
            parent = _at(d, p[:-1])
            if kind == "del":
                del parent[p[-1]]
            elif kind == "set":
                parent[p[-1]] = copy.deepcopy(v)
            else:
                parent[p[-1]]["zz_unknown"] = 1
            yield _pattern(p), (f"set {json.dumps(v)}" if kind == "set" else kind), d


def _judge(doc: dict[str, Any], parse: Callable[[Any], Any],
           validator: jsonschema.Draft202012Validator) -> tuple[bool, bool]:
    try:
        parse(doc)
        parsed = True
    except ManifestError:
        parsed = False
    return validator.is_valid(doc), parsed


def test_parsers_and_schemas_disagree_only_where_written_down(built_cache: Path) -> None:
    found = set()
    for record, (rel, parse) in RECORDS.items():
        doc = json.loads((built_cache / rel).read_text())
        validator = jsonschema.Draft202012Validator(json.loads((SCHEMAS / f"{record}.v1.schema.json").read_text()))
        assert _judge(doc, parse, validator) == (True, True), record
        for pattern, mutation, mutant in _mutants(doc):
            schema_ok, parse_ok = _judge(mutant, parse, validator)  # any other exception fails here
            if schema_ok != parse_ok:
                found.add((record, pattern, mutation, "parser" if schema_ok else "schema"))
    new, gone = sorted(found - KNOWN), sorted(KNOWN - found)
    assert not new, f"the parser and the schema now disagree on {new}: make them agree (or add to KNOWN, with why)"
    assert not gone, f"these disagreements are gone, take them out of KNOWN: {gone}"


@pytest.mark.parametrize("field,value", [("source_format", []), ("source_format", {}),
                                         ("scale_forms", {"w13_weight_scale": []}),
                                         ("scale_forms", {"w13_weight_scale": {}})])
def test_a_value_of_the_wrong_type_is_refused_not_a_crash(built_cache: Path, field: str, value: Any) -> None:
    doc = json.loads((built_cache / "layers/layer-001.json").read_text())
    doc[field] = value
    with pytest.raises(ManifestError, match=field):
        LayerManifest.parse(doc, "layer")
