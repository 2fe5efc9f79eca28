"""The reference model's text: Python 3.11's documentation sources, as Debian's python3.11-doc ships them.

python3.11-doc (Debian 12, 3.11.2-6+deb12u9; the Python Software Foundation License Version 2, examples
also under the Zero-Clause BSD license) installs the reStructuredText source of every page under
/usr/share/doc/python3.11/html/_sources/*.rst.txt: 497 files, about 11 MB of English prose with code.

Each file goes to one split, decided by its path alone (xxh3-64 of the path, mod 20): 0 is the held-out
evaluation split, 1 the calibration split (the routing profile's), the rest trains. The files of a split
are joined in path order, each followed by a blank line. Byte for byte the same output from the same
package; data.json records each split's size and sha256 so a rebuild can be checked.

    apt-get install python3.11-doc
    python benchmarks/quality_model/prepare_text.py            # writes benchmarks/quality_model/data/
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import xxhash

SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
HERE = Path(__file__).resolve().parent
SPLITS = ("train", "eval", "calib")
#: The committed slices of the held-out splits (what the ladder and its test read on any machine).
COMMITTED_BYTES = 1 << 17


def split_of(rel: str) -> str:
    k = xxhash.xxh3_64_intdigest(rel.encode()) % 20
    return "eval" if k == 0 else "calib" if k == 1 else "train"


def prepare(sources: Path, out: Path) -> dict[str, dict[str, object]]:
    files = sorted(p.relative_to(sources).as_posix() for p in sources.rglob("*.rst.txt"))
    if not files:
        raise SystemExit(f"no *.rst.txt under {sources}: apt-get install python3.11-doc")
    parts: dict[str, list[bytes]] = {s: [] for s in SPLITS}
    for rel in files:
        parts[split_of(rel)].append((sources / rel).read_bytes().rstrip() + b"\n\n")
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, dict[str, object]] = {}
    for split in SPLITS:
        data = b"".join(parts[split])
        (out / f"{split}.txt").write_bytes(data)
        record[split] = {"files": len(parts[split]), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        if split != "train":  # the slice that is committed, cut at a line end
            cut = data[:COMMITTED_BYTES]
            cut = cut[: cut.rfind(b"\n") + 1]
            (out / f"{split}-slice.txt").write_bytes(cut)
            record[f"{split}-slice"] = {"bytes": len(cut), "sha256": hashlib.sha256(cut).hexdigest()}
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", type=Path, default=SOURCES)
    ap.add_argument("--out", type=Path, default=HERE / "data")
    args = ap.parse_args()
    record = prepare(args.sources, args.out)
    record_path = args.out / "data.json"
    want = json.loads(record_path.read_text()) if record_path.exists() else None
    record_path.write_text(json.dumps({"package": "python3.11-doc 3.11.2-6+deb12u9",
                                       "license": "PSF-2.0 (examples also 0BSD)", "splits": record}, indent=1) + "\n")
    if want is not None and want["splits"] != record:
        raise SystemExit("the text differs from the recorded data.json (another package version?)")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
