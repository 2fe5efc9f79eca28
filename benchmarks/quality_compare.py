"""Whether two quality-ladder results carry the same figures: every row's, and every model's.

    python benchmarks/quality_compare.py benchmarks/results/quality.json /tmp/run/quality.json

Compares what a run measured, not how long it took: per model, every row (name, path, series, bits a
weight, PPL, KL, top-1, greedy, routes_max_abs_diff: the JSON's values, written to 6 significant digits)
and the model's own figures (default_kl at full precision, the sim check, the delta bytes, the table
form), and the evaluation's settings. Equality is exact on the values the JSON holds. Exit 0: the same
figures; 1: they differ (each difference printed, one a line).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TIMING = ("seconds", "cpu_seconds")   # how long a run took: not a figure of the ladder


def figures(doc: dict) -> dict:
    """A results file's figures (its "result", or the object itself for --json-only output), timing left out."""
    result = doc.get("result", doc)
    return {k: v for k, v in result.items() if k not in TIMING}


def differences(a: dict, b: dict) -> list[str]:
    """One line for each figure that is not the same in the two results (empty: the same figures)."""
    fa, fb = figures(a), figures(b)
    out = [f"{k}: {fa.get(k)!r} != {fb.get(k)!r}" for k in sorted(set(fa) | set(fb))
           if k != "models" and fa.get(k) != fb.get(k)]
    models_a, models_b = fa.get("models", {}), fb.get("models", {})
    if sorted(models_a) != sorted(models_b):
        out.append(f"models: {sorted(models_a)} != {sorted(models_b)}")
    for model in sorted(set(models_a) & set(models_b)):
        ma, mb = models_a[model], models_b[model]
        out += [f"{model}: {k}: {ma.get(k)!r} != {mb.get(k)!r}" for k in sorted(set(ma) | set(mb))
                if k != "rows" and ma.get(k) != mb.get(k)]
        rows_a, rows_b = ma.get("rows", []), mb.get("rows", [])
        if len(rows_a) != len(rows_b):
            out.append(f"{model}: {len(rows_a)} rows != {len(rows_b)} rows")
        for ra, rb in zip(rows_a, rows_b):
            out += [f"{model}: {ra.get('name')!r}: {k}: {ra.get(k)!r} != {rb.get(k)!r}"
                    for k in sorted(set(ra) | set(rb)) if ra.get(k) != rb.get(k)]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    a, b = (json.loads(Path(p).read_text()) for p in argv)
    diffs = differences(a, b)
    for line in diffs:
        print(line)
    rows = sum(len(m.get("rows", [])) for m in figures(a).get("models", {}).values())
    print(f"{'the same figures' if not diffs else f'{len(diffs)} differences'} ({rows} rows compared)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
