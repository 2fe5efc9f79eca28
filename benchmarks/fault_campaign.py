"""The long form of the fault and bad-input campaign (tests/faults/ runs the CI sizes).

    python benchmarks/fault_campaign.py --rounds 10            # 200 kills, 2000 corruptions, 20000 fuzz cases
    python benchmarks/fault_campaign.py --kills 200 --corruptions 5000 --fuzz 50000
    python benchmarks/fault_campaign.py --only fuzz --kinds config,index --fuzz 20000 --seed 3

Prints the counts of each campaign as it finishes (one JSON line each, then a table) and exits 1
when a count that must be zero is not. The baseline of every rate is the CI run of the same
campaign (tests/faults), which uses the same code with the sizes in FUZZ_CI_EXAMPLES etc.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the campaign's machinery is the tests package `faults` (CI runs it too)

from faults.campaign import (FUZZ_CASES, FUZZ_CI_EXAMPLES, FuzzEnv, corruption_campaign,  # noqa: E402
                             crash_campaign, fuzz, window_campaign)

MUST_BE_ZERO = {
    "crash": ("wrongly_complete", "failed_resumes", "unexpected_exit", "leftover_temps", "verify_kill_broke_cache"),
    "corruption": ("full_missed", "crashes", "boot_said_verified_on_content"),
    "fuzz": ("crashes", "bad_exit_codes", "written_outside"),
    "windows": ("wrongly_complete", "failed_resumes", "leftover_temps", "export_inexact"),
}


def _scratch() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="moet-faults-", dir=shm if shm.is_dir() else None))


def _report(name: str, c: Counter, seconds: float, bad: list[str]) -> None:
    doc = {"campaign": name, "seconds": round(seconds, 1), **dict(sorted(c.items()))}
    print(json.dumps(doc), flush=True)
    for key in MUST_BE_ZERO[name]:
        if c.get(key, 0):
            bad.append(f"{name}: {key} = {c[key]}")
    if name == "corruption" and c.get("boot_detected_structural") != c.get("structural"):
        bad.append("corruption: the boot check missed structural damage")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="scale of the CI sizes (20 kills, 200 corruptions, 2000 fuzz cases)")
    ap.add_argument("--kills", type=int, help="build kills (default 20 x rounds)")
    ap.add_argument("--corruptions", type=int, help="corruption cases (default 200 x rounds)")
    ap.add_argument("--fuzz", type=int, help="fuzz cases in all (default 2000 x rounds), shared as in CI")
    ap.add_argument("--only", choices=["crash", "windows", "corruption", "fuzz"], action="append")
    ap.add_argument("--kinds", help="fuzz kinds, comma-separated (default all)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--show", type=int, default=10, help="failures to print")
    args = ap.parse_args()
    only = set(args.only or ["crash", "windows", "corruption", "fuzz"])
    kills = args.kills if args.kills is not None else 20 * args.rounds
    corruptions = args.corruptions if args.corruptions is not None else 200 * args.rounds
    fuzz_total = args.fuzz if args.fuzz is not None else 2000 * args.rounds
    bad: list[str] = []
    log: list[str] = []
    if "crash" in only:
        work = _scratch()
        t0 = time.perf_counter()
        c = crash_campaign(work, kills, seed=args.seed, log=log.append)
        _report("crash", c, time.perf_counter() - t0, bad)
        shutil.rmtree(work, ignore_errors=True)
    if "windows" in only:  # a kill at every commit window of build, rebuild, retier and export (deterministic)
        work = _scratch()
        t0 = time.perf_counter()
        c = window_campaign(work, log=log.append)
        _report("windows", c, time.perf_counter() - t0, bad)
        if c.get("killed_in_window") != c.get("cases"):
            bad.append("windows: a window was never reached")
        shutil.rmtree(work, ignore_errors=True)
    if "corruption" in only:
        work = _scratch()
        t0 = time.perf_counter()
        c = corruption_campaign(work, corruptions, seed=args.seed, log=log.append)
        _report("corruption", c, time.perf_counter() - t0, bad)
        shutil.rmtree(work, ignore_errors=True)
    if "fuzz" in only:
        kinds = args.kinds.split(",") if args.kinds else sorted(FUZZ_CASES)
        share = sum(FUZZ_CI_EXAMPLES[k] for k in kinds)
        work = _scratch()
        env = FuzzEnv(work)
        t0 = time.perf_counter()
        for kind in kinds:
            n = max(1, round(fuzz_total * FUZZ_CI_EXAMPLES[kind] / share))
            before = Counter(env.counts)
            t1 = time.perf_counter()
            fuzz(kind, env, n, seed=args.seed)
            delta = Counter({k: v - before.get(k, 0) for k, v in env.counts.items() if v - before.get(k, 0)})
            print(json.dumps({"fuzz_kind": kind, "seconds": round(time.perf_counter() - t1, 1), **dict(sorted(delta.items()))}),
                  flush=True)
        _report("fuzz", env.counts, time.perf_counter() - t0, bad)
        log += env.failures
        shutil.rmtree(work, ignore_errors=True)
    for line in log[: args.show]:
        print("failure:", line[-600:], file=sys.stderr)
    print("RESULT:", "all zero counts are zero" if not bad else "; ".join(bad), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
