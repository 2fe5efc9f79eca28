"""The two sources of truth for the manifest rules, compared: the hand parsers of moet_cache.manifest and the
JSON Schemas of manifests/. Every field of each written record is deleted, set to a value of every JSON type,
or given an unknown key, and both judge the result.

The parsers never crash (a ManifestError, nothing else). Where the two disagree today, the disagreement is
written down in KNOWN, each with its reason; a new one fails, and so does one that has gone (take it out of
KNOWN), so the list can only shrink. Issue 14 asks for the two to agree or for the schemas to be enforced at
run time; until then this says exactly where they differ.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import jsonschema
import pytest

from moet_cache.manifest import CacheManifest, CommitRecord, DeltaIndex, LayerManifest, ManifestError, PartManifest

SCHEMAS = Path(__file__).resolve().parents[1] / "manifests"
VALUES: list[Any] = ["x", -1, 0, None, [], {}, 1.5, True, 2**60]
# Subtrees the cache manifest carries as plain dicts (issue 14, "records bypassed"): one row each.
COARSE = (("source", "fingerprint"), ("model",))

RECORDS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "cache-manifest": ("cache.json", lambda d: CacheManifest.parse(d)),
    "commit": ("COMMIT.json", lambda d: CommitRecord.parse(d)),
    "delta-index": ("delta/tier.json", lambda d: DeltaIndex.parse(d)),
    "part-manifest": ("delta/tier.part.json", lambda d: PartManifest.parse(d, "part")),
    "layer-manifest": ("layers/layer-001.json", lambda d: LayerManifest.parse(d, "layer")),
}

# (record, field pattern, mutation, who refuses it): "schema" = only the schema, "parser" = only the parser.
_SCHEMA_ONLY_TYPES = ['set "x"', "set -1", "set 0", "set 1.5", "set 1152921504606846976", "set []", "set null",
                      "set true", "set {}"]
KNOWN = {
    # The schemas close their objects (additionalProperties: false); the parsers ignore unknown keys.
    *{(r, f, "addkey", "schema") for r, f in (
        ("cache-manifest", "build"), ("cache-manifest", "files.*"), ("cache-manifest", "layers.*"),
        ("delta-index", "layers.*"), ("layer-manifest", "files.*"), ("layer-manifest", "tensors.*"),
        ("part-manifest", "files.*"))},
    # The cache manifest's source fingerprint and model are dicts the parser does not check (the verifier does).
    ("cache-manifest", "model", "set {}", "schema"),
    ("cache-manifest", "model.**", "del", "schema"),
    ("cache-manifest", "source.fingerprint", "set {}", "schema"),
    ("cache-manifest", "source.fingerprint.**", "del", "schema"),
    *{("cache-manifest", "source.fingerprint.**", m, "schema") for m in _SCHEMA_ONLY_TYPES},
    # Fields the schemas require and the parsers default.
    ("cache-manifest", "build.profile_xxh3", "del", "schema"),
    ("part-manifest", "metadata", "del", "schema"),
    # Rules across fields, which the schemas cannot state: sorted unique experts, one entry per expert,
    # a tensor's file listed, its end after its begin, listed paths that exist in the layout.
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
    g = tuple("*" if isinstance(k, int) else k for k in p)
    for c in COARSE:
        if g[:len(c)] == c and len(g) > len(c):
            g = c + ("**",)
    return ".".join(g)


def _mutants(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for p in list(_paths(doc))[1:]:
        muts: list[tuple[str, Any]] = [("del", None)] if isinstance(p[-1], str) else []
        muts += [("set", v) for v in VALUES]
        if isinstance(_at(doc, p), dict):
            muts.append(("addkey", None))
        for kind, v in muts:
            d = copy.deepcopy(doc)
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
