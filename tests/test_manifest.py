"""The manifests we write validate against the JSON Schemas in manifests/, and the strict reader refuses bad ones."""

import json
from pathlib import Path

import jsonschema
import pytest

from moet_cache.cache.manifest import (CacheManifest, CommitRecord, DeltaIndex, LayerManifest, ManifestError,
                                      PartManifest)

SCHEMAS = Path(__file__).resolve().parents[1] / "manifests"


def schema(name: str) -> dict:
    return json.loads((SCHEMAS / f"{name}.v1.schema.json").read_text())


def check(doc: dict, name: str) -> None:
    jsonschema.validate(doc, schema(name), cls=jsonschema.Draft202012Validator)


def test_written_manifests_validate(built_cache: Path) -> None:
    cache = built_cache
    check(json.loads((cache / "cache.json").read_text()), "cache-manifest")
    check(json.loads((cache / "COMMIT.json").read_text()), "commit")
    check(json.loads((cache / "delta/tier.json").read_text()), "delta-index")
    check(json.loads((cache / "delta/tier.part.json").read_text()), "part-manifest")
    check(json.loads((cache / "source-map.json").read_text()), "source-map")
    layers = sorted((cache / "layers").glob("layer-*.json"))
    assert len(layers) == 3
    for p in layers:
        check(json.loads(p.read_text()), "layer-manifest")
    for p in (cache / "dense").glob("*.json"):
        check(json.loads(p.read_text()), "part-manifest")


def test_packaged_schemas_match_repo() -> None:
    """The schemas import as moet_cache.manifests. Under the editable install this reads the repository's own
    files, so it cannot show what a wheel leaves out: tests/test_packaging.py builds one and checks that."""
    from importlib import resources
    names = sorted(p.name for p in SCHEMAS.glob("*.json"))
    assert len(names) == 7
    for n in names:
        assert resources.files("moet_cache.manifests").joinpath(n).read_text() == (SCHEMAS / n).read_text()


def _layer_doc(cache: Path) -> dict:
    return json.loads((cache / "layers/layer-001.json").read_text())


@pytest.mark.parametrize("path", ["../outside.safetensors", "/etc/passwd", "layers/../../x", "a//b", "./a", "a\\b", ""])
def test_bad_paths_refused_by_reader_and_schema(built_cache: Path, path: str) -> None:
    doc = _layer_doc(built_cache)
    doc["files"][0]["path"] = path
    with pytest.raises(ManifestError):
        LayerManifest.parse(doc, "layer")
    with pytest.raises(jsonschema.ValidationError):
        check(doc, "layer-manifest")


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(n_experts=2**40), "n_experts"),
    (lambda d: d.update(layer="1"), "layer must be an integer"),
    (lambda d: d.update(format_version=2), "format_version 2 is not supported"),
    (lambda d: d["tensors"][0].update(shape=[1, -1]), "shape"),
    (lambda d: d["tensors"][0].update(dtype="OBJ"), "unknown dtype"),
    (lambda d: d["tensors"][0].update(end=0, begin=5), "ends before it begins"),
    (lambda d: d["files"][0].update(xxh3="zz"), "xxh3"),
    (lambda d: d.update(sq_error=[1.0]), "one entry per expert"),
    (lambda d: d.update(sq_error=[float("nan")] * 16), "finite"),
    (lambda d: d["tensors"][0].update(file="layers/other.safetensors"), "does not list"),
])
def test_layer_manifest_refused_as_a_whole(built_cache: Path, mutate, match: str) -> None:
    doc = _layer_doc(built_cache)
    mutate(doc)
    with pytest.raises(ManifestError, match=match):
        LayerManifest.parse(doc, "layer")


def test_cache_manifest_roundtrip_and_refusals(built_cache: Path) -> None:
    cache = built_cache
    doc = json.loads((cache / "cache.json").read_text())
    m = CacheManifest.parse(doc)
    assert m.to_dict() == doc
    dup = json.loads(json.dumps(doc))
    dup["files"].append(dup["files"][0])
    with pytest.raises(ManifestError, match="listed twice"):
        CacheManifest.parse(dup)
    bad = json.loads(json.dumps(doc))
    bad["build"]["lossless"] = "yes"
    with pytest.raises(ManifestError, match="lossless must be true or false"):
        CacheManifest.parse(bad)


def test_other_records_roundtrip(built_cache: Path) -> None:
    cache = built_cache
    for rel, cls in (("COMMIT.json", CommitRecord), ("delta/tier.json", DeltaIndex), ("delta/tier.part.json", PartManifest)):
        doc = json.loads((cache / rel).read_text())
        assert cls.parse(doc, rel).to_dict() == doc
    idx = json.loads((cache / "delta/tier.json").read_text())
    idx["layers"][0]["experts"] = [3, 1]
    with pytest.raises(ManifestError, match="sorted list"):
        DeltaIndex.parse(idx)


def test_build_base_table_is_optional_and_closed(built_cache: Path) -> None:
    doc = json.loads((built_cache / "cache.json").read_text())
    assert "base_table" not in doc["build"]  # fitted, the default: written as before the field, for older readers
    check(doc, "cache-manifest")
    assert CacheManifest.parse(doc).build.base_table == "fitted"
    doc["build"]["base_table"] = "x4"
    check(doc, "cache-manifest")
    assert CacheManifest.parse(doc).build.base_table == "x4"
    doc["build"]["base_table"] = "x8"
    with pytest.raises(jsonschema.ValidationError):
        check(doc, "cache-manifest")
    with pytest.raises(ManifestError, match="base_table must be one of fitted, x4"):
        CacheManifest.parse(doc)
