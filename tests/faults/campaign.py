"""The fault and bad-input campaign: the machinery shared by tests/faults/ and benchmarks/fault_campaign.py.

Every round works on real files: real SIGKILLs of real processes (forked from a warm server so a
kill costs milliseconds, not a torch import), real bytes flipped, real commands run through
moet_cache.cli.app.main. Each campaign returns a Counter; the tests assert on it, the benchmark
script prints it.
"""

from __future__ import annotations

import functools
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Callable, Iterable

from moet_cache import BuildOptions, build_cache, make_checkpoint, small_spec
from moet_cache.source.checkpoint import MODELOPT
from moet_cache.hashing import xxh3_hex
from moet_cache.cache.manifest import CACHE_MANIFEST, COMMIT_RECORD, VERIFIED_STATE
from moet_cache.source.synthetic import SyntheticSpec
from moet_cache.verify import CORRUPT, INCOMPLETE, VERIFIED, boot_check, full_verify, load_cache_files

HERE = Path(__file__).resolve().parent
SERVER = HERE / "_forkserver.py"
OK_CODES = (0, 1, 2)


def tiny_spec(layout: str = MODELOPT, seed: int = 0, **over: Any) -> SyntheticSpec:
    """A checkpoint of two MoE layers and four experts: a build takes a fraction of a second."""
    args = dict(n_routed_experts=4, hidden_size=128, moe_intermediate_size=64, intermediate_size=256,
                vocab_size=256, num_hidden_layers=3, seed=seed)
    args.update(over)
    return small_spec(layout, **args)


def make_tiny(path: Path, layout: str = MODELOPT, seed: int = 0, **over: Any) -> Path:
    return make_checkpoint(path, tiny_spec(layout, seed, **over))


def make_tiny_v4(path: Path, variant: str = "hybrid", seed: int = 0, **over: Any) -> Path:
    """A DeepSeek-V4 checkpoint of two main layers and a drafter block, two experts each, tiny attention."""
    from moet_cache.source.synthetic import make_v4_checkpoint, small_v4_spec
    args = dict(n_routed_experts=2, num_experts_per_tok=1, hidden_size=64, moe_intermediate_size=32,
                num_hidden_layers=2, vocab_size=64, num_attention_heads=2, head_dim=64, q_lora_rank=32,
                o_lora_rank=16, index_n_heads=2, index_head_dim=32, index_topk=8, hc_mult=2, seed=seed)
    args.update(over)
    return make_v4_checkpoint(path, small_v4_spec(variant, **args))


# --- in-process CLI ---------------------------------------------------------------------------------
def run_main(argv: Iterable[str]) -> tuple[int, str, str]:
    """Run `moet-cache ARGV` in this process through main(); returns (exit code, stdout, stderr)."""
    from moet_cache.cli.app import main
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def run_console(argv: Iterable[str], timeout: float = 120) -> tuple[int, str, str]:
    """Run the real console script in a subprocess."""
    exe = shutil.which("moet-cache") or str(Path(sys.executable).with_name("moet-cache"))
    p = subprocess.run([exe, *map(str, argv)], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    return p.returncode, p.stdout, p.stderr


def is_crash(rc: int, err: str) -> bool:
    """A traceback, an internal error, or an exit code that is not 0/1/2."""
    return rc not in OK_CODES or "Traceback" in err or "internal error" in err


def tree_snapshot(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, tuple[int, int, bool]]:
    """Every entry under root (links not followed) with size, mtime and link-ness; `skip` subtrees left out."""
    out: dict[str, tuple[int, int, bool]] = {}
    skip_s = {str(s) for s in skip}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in skip_s]
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, name)
            if p in skip_s:
                continue
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns, os.path.islink(p))
    return out


def link_copy(src: Path, dst: Path) -> Path:
    """Copy a cache by hard links (same inodes and times, so its boot check still says verified).

    Safe because every library write is a temp file renamed over the name; the campaign itself
    breaks the link of a file before changing its bytes (`private`).
    """
    shutil.copytree(src, dst, copy_function=os.link)
    state = dst / VERIFIED_STATE
    if state.exists():
        data = state.read_bytes()
        state.unlink()
        state.write_bytes(data)
        os.utime(state, ns=(os.stat(src / VERIFIED_STATE).st_atime_ns, os.stat(src / VERIFIED_STATE).st_mtime_ns))
    return dst


def private(path: Path) -> bytes:
    """Break a hard link: give `path` its own inode (same bytes), return the bytes."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)
    return data


# --- crashes: a warm fork server --------------------------------------------------------------------
class ForkServer:
    """A process that imported moet_cache once and forks one child per command; we SIGKILL the child."""

    def __init__(self, warm: list[Any] | None = None) -> None:
        """`warm`: a command the server runs in itself once (e.g. a build in a scratch folder) before forking."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        extra = [json.dumps([str(a) for a in warm])] if warm else []
        self.proc = subprocess.Popen([sys.executable, str(SERVER), *extra], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self._read() == {"ready": True}

    def _read(self) -> Any:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError("the fork server died")
        return json.loads(line)

    def start(self, argv: list[Any], env: dict[str, str] | None = None) -> int:
        """Start `moet-cache ARGV` in a fresh child (with `env` added); returns its pid (then call finish())."""
        req = {"argv": [str(a) for a in argv], "env": env or {}}
        self.proc.stdin.write(json.dumps(req) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return int(self._read()["pid"])

    def finish(self) -> dict[str, Any]:
        """Wait for the child: {"rc": exit code or None, "signal": signal number or None}."""
        return self._read()

    def run(self, argv: list[Any], kill_after: float | None, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Run `moet-cache ARGV` in a fresh child; SIGKILL it after `kill_after` seconds (None: let it finish)."""
        t0 = time.perf_counter()
        pid = self.start(argv, env)
        if kill_after is not None:
            time.sleep(max(0.0, kill_after - (time.perf_counter() - t0)))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it finished first
        res = self.finish()
        res["seconds"] = time.perf_counter() - t0
        return res

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(timeout=30)

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _commit_digest(cache: Path) -> str | None:
    try:
        return json.loads((cache / COMMIT_RECORD).read_bytes())["manifest_xxh3"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def leftover_temps(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*.tmp-*"))


def crash_campaign(work: Path, kills: int, seed: int = 0, verify_kills: int | None = None,
                   log: Callable[[str], None] | None = None,
                   make_src: Callable[[Path, int], Path] | None = None, extra: tuple[str, ...] = ()) -> Counter:
    """SIGKILL builds (and full verifies) at random instants; after each, check, resume and verify.

    Counts: kills (child really died of SIGKILL), finished (it beat the kill), wrongly_complete (the
    boot check said complete but the cache did not verify: must be 0), clean_resumes, failed_resumes,
    commit_window (killed after cache.json was written and before COMMIT.json), leftover_temps.
    """
    rng = random.Random(seed)
    c: Counter = Counter()
    src = (make_src or (lambda p, s: make_tiny(p, seed=s)))(work / "src", seed)
    cache = work / "cache"
    budgets = ["10%", "30%", "60%", "0"]
    with ForkServer(warm=["build", src, work / "warm", "--quiet", *extra]) as fs:
        # The duration of a whole build, measured in a throw-away cache, sets the range of kill instants.
        t_build = min(fs.run(["build", src, work / f"warm{i}", "--quiet", *extra], None)["seconds"] for i in range(2))
        t_rebuild = fs.run(["build", src, work / "warm0", "--quiet", "--delta-budget", "10%", *extra], None)["seconds"]
        t_verify = fs.run(["verify", work / "warm0", "--full", "--quiet"], None)["seconds"]
        c["build_seconds_ms"] = int(t_build * 1000)
        c["rebuild_seconds_ms"] = int(t_rebuild * 1000)
        budget = budgets[0]
        for i in range(kills):
            fresh = rng.random() < 0.5 or not cache.exists()
            if fresh and cache.exists():
                shutil.rmtree(cache)  # half the rounds a fresh build, else a resume or a rebuild with new settings
            budget = rng.choice([b for b in budgets if b != budget])
            span = t_build if fresh else t_rebuild
            # A quarter of the kills aim at the end of the build, where cache.json and COMMIT.json are written.
            # The rest land inside the measured span: a resume is often shorter than it, and a kill
            # after the exit tests nothing.
            delay = span * (rng.uniform(0.8, 1.05) if rng.random() < 0.25 else rng.uniform(0.0, 0.85))
            t_round = time.time_ns()
            res = fs.run(["build", src, cache, "--delta-budget", budget, "--quiet", *extra], delay)
            c["kills" if res["signal"] == signal.SIGKILL else "finished"] += 1
            if res["signal"] is None and res["rc"] != 0:
                c["unexpected_exit"] += 1
            if not (cache / COMMIT_RECORD).exists() and (cache / CACHE_MANIFEST).exists() \
                    and (cache / CACHE_MANIFEST).stat().st_mtime_ns >= t_round:
                c["commit_window"] += 1
            rep = boot_check(cache) if cache.is_dir() else None
            if res["signal"] == signal.SIGKILL and (rep is None or not rep.complete):
                c["killed_mid_build"] += 1  # the kill left an unfinished cache: the interesting case
            if rep is not None and rep.complete:
                c["said_complete_after_kill"] += 1
                full = full_verify(cache)
                if not full.ok:
                    c["wrongly_complete"] += 1
                    if log:
                        log(f"round {i}: boot said {rep.state} but --full says {full.state}: {full.problems[:3]}")
            build_cache(src, cache, BuildOptions(delta_budget=budget, include_mtp="--include-mtp" in extra,
                                                 lossless="--lossless" in extra))
            full = full_verify(cache)
            c["clean_resumes" if full.ok else "failed_resumes"] += 1
            if not full.ok and log:
                log(f"round {i}: resume did not verify: {full.problems[:3]}")
            if leftover_temps(cache):
                c["leftover_temps"] += 1
                if log:
                    log(f"round {i}: temp files left: {leftover_temps(cache)}")
        for i in range(kills // 4 if verify_kills is None else verify_kills):
            res = fs.run(["verify", cache, "--full", "--quiet"], t_verify * rng.uniform(0.0, 1.1))
            c["verify_kills" if res["signal"] == signal.SIGKILL else "verify_finished"] += 1
            rep = boot_check(cache)
            if not rep.complete:
                c["verify_kill_broke_cache"] += 1
            full = full_verify(cache)
            if not full.ok:
                c["verify_kill_broke_cache"] += 1
    return c


def window_campaign(work: Path, log: Callable[[str], None] | None = None) -> Counter:
    """SIGKILL build (fresh and rebuild), retier and export at every window of their commit protocol
    (moet_cache.cache.commit.WINDOWS, EXPORT_WINDOWS), deterministically: the child kills itself there
    (MOET_CACHE_TEST_KILL_AT). After each kill: a boot check that says complete must be right; the same
    command must then finish (exit 0), verify --full (or, for export, every tensor equal to the source's),
    and leave no temp file.

    Counts: cases, killed_in_window (the child died of SIGKILL at the window: must equal cases),
    wrongly_complete, clean_resumes, failed_resumes, leftover_temps, export_inexact.
    """
    from moet_cache.cache.commit import EXPORT_WINDOWS, KILL_ENV, WINDOWS
    c: Counter = Counter()
    src = make_tiny(work / "src", seed=11)
    ref = work / "ref"
    build_cache(src, ref, BuildOptions(delta_budget="30%", lossless=True))
    cases = [(what, w) for w in WINDOWS for what in ("build", "rebuild", "retier")]
    cases += [("export", w) for w in EXPORT_WINDOWS]
    with ForkServer(warm=["build", src, work / "warm", "--quiet"]) as fs:
        for what, window in cases:
            cache, out = work / "cache", work / "out"
            for d in (cache, out):
                if d.exists():
                    shutil.rmtree(d)
            if what != "build":
                link_copy(ref, cache)
            argv = {"build": ["build", src, cache, "--lossless", "--delta-budget", "30%"],
                    "rebuild": ["build", src, cache, "--lossless", "--delta-budget", "10%"],
                    "retier": ["retier", cache, "--delta-budget", "10%"],
                    "export": ["export", cache, out]}[what] + ["--quiet"]
            c["cases"] += 1
            res = fs.run(argv, None, env={KILL_ENV: window})
            if res["signal"] == signal.SIGKILL:
                c["killed_in_window"] += 1
            elif log:
                log(f"{what} never reached {window}: {res}")
            if what != "export":
                rep = boot_check(cache)
                if rep.complete and not full_verify(cache).ok:
                    c["wrongly_complete"] += 1
                    if log:
                        log(f"{what} killed at {window}: boot check said {rep.state}, --full disagrees")
            again = fs.run(argv, None)
            good = again["rc"] == 0
            if what == "export":
                good = good and exported_equals_source(out, src)
                c["export_inexact"] += 0 if good else 1
                temps = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
            else:
                good = good and full_verify(cache).ok
                temps = leftover_temps(cache)
            c["clean_resumes" if good else "failed_resumes"] += 1
            if not good and log:
                log(f"{what} killed at {window}: the same command did not finish cleanly: {again}")
            if temps:
                c["leftover_temps"] += 1
                if log:
                    log(f"{what} killed at {window}: left {temps}")
    return c


def exported_equals_source(out: Path, src: Path) -> bool:
    """Every tensor of the source is in the export, in the same shard, with the same dtype, shape and bytes."""
    from safetensors import safe_open

    from moet_cache.source.checkpoint import tensor_bytes
    for shard in sorted(src.glob("*.safetensors")):
        if not (out / shard.name).is_file():
            return False
        with safe_open(str(shard), framework="pt") as a, safe_open(str(out / shard.name), framework="pt") as b:
            if set(a.keys()) != set(b.keys()) or a.metadata() != b.metadata():
                return False
            for k in a.keys():
                x, y = a.get_tensor(k), b.get_tensor(k)
                if x.dtype != y.dtype or x.shape != y.shape or tensor_bytes(x).tobytes() != tensor_bytes(y).tobytes():
                    return False
    return True


# --- corruption ---------------------------------------------------------------------------------------
STRUCTURAL = ("truncate", "extend", "delete", "rename", "swap-size", "commit-missing")
KINDS = ("bitflip", "truncate", "extend", "delete", "rename", "swap")


def cache_targets(cache: Path) -> list[str]:
    """Every file a committed cache consists of: the listed files, the layer manifests, cache.json, COMMIT.json."""
    cf = load_cache_files(cache)
    return sorted({f.path for f, _ in cf.files} | {CACHE_MANIFEST, COMMIT_RECORD})


def _commit_meaning(data: bytes) -> tuple[Any, ...] | None:
    try:
        d = json.loads(data)
        return (d["format"], d["format_version"], d["manifest"], d["manifest_size"], d["manifest_xxh3"],
                sorted(d))
    except (ValueError, KeyError, TypeError):
        return None


def corrupt_once(rng: random.Random, ref: Path, case: Path, targets: list[str]) -> tuple[str, str, bool]:
    """Damage one copy of `ref` at `case` in one random way; returns (kind, target, harmless)."""
    link_copy(ref, case)
    kind = rng.choice(KINDS)
    rel = rng.choice(targets)
    p = case / rel
    harmless = False
    if kind == "bitflip":
        data = bytearray(private(p))
        pos = rng.randrange(len(data))
        data[pos] ^= 1 << rng.randrange(8)
        p.write_bytes(bytes(data))
    elif kind == "truncate":
        private(p)
        os.truncate(p, rng.randrange(p.stat().st_size))
    elif kind == "extend":
        private(p)
        with open(p, "ab") as f:
            f.write(bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))))
    elif kind == "delete":
        p.unlink()
        if rel == COMMIT_RECORD:
            kind = "commit-missing"
    elif kind == "rename":
        p.rename(p.with_name(p.name + rng.choice([".bak", "~", ".old"])))
    elif kind == "swap":
        other = case / rng.choice([t for t in targets if t != rel])
        tmp = p.with_name(p.name + ".swap")
        p.rename(tmp)
        other.rename(p)
        tmp.rename(other)
        if p.stat().st_size != other.stat().st_size:
            kind = "swap-size"
    if rel == COMMIT_RECORD and kind in ("bitflip", "truncate", "extend"):
        # COMMIT.json carries no digest of itself: a change that keeps its meaning (the committed_at
        # text, the trailing newline) goes unnoticed and changes nothing (docs/GUARANTEES.md).
        harmless = _commit_meaning(p.read_bytes()) == _commit_meaning((ref / rel).read_bytes())
    return kind, rel, harmless


def corruption_campaign(work: Path, cases: int, seed: int = 0,
                        log: Callable[[str], None] | None = None) -> Counter:
    """Single random faults across every file of two reference caches (tiered, and --lossless).

    Counts: cases, full_detected, full_missed (must be 0 apart from harmless), harmless (a flip in
    COMMIT.json's committed_at text only), structural, boot_detected_structural (must equal
    structural), boot_said_verified_on_content (content-only damage the boot check saw as verified:
    possible only when the stat did not change; reported), crashes.
    """
    rng = random.Random(seed)
    c: Counter = Counter()
    src = make_tiny(work / "src", seed=seed)
    refs = []
    for name, opts in (("tiered", BuildOptions(delta_budget="40%")), ("lossless", BuildOptions(delta_budget="40%", lossless=True))):
        ref = work / f"ref-{name}"
        build_cache(src, ref, opts)
        assert full_verify(ref).ok
        refs.append((ref, cache_targets(ref)))
    for i in range(cases):
        ref, targets = refs[i % len(refs)]
        case = work / "case"
        if case.exists():
            shutil.rmtree(case)
        kind, rel, harmless = corrupt_once(rng, ref, case, targets)
        c["cases"] += 1
        c[f"kind_{kind}"] += 1
        try:
            boot = boot_check(case)
            full = full_verify(case)
        except Exception as e:  # noqa: BLE001 - counting crashes is the point
            c["crashes"] += 1
            if log:
                log(f"case {i}: {kind} {rel}: {type(e).__name__}: {e}")
            continue
        if full.ok:
            c["harmless" if harmless else "full_missed"] += 1
            if not harmless and log:
                log(f"case {i}: --full missed {kind} of {rel}")
        else:
            c["full_detected"] += 1
        if harmless:
            c["harmless_boot_" + boot.state] += 1
        elif kind in STRUCTURAL:
            c["structural"] += 1
            if boot.state in (CORRUPT, INCOMPLETE):
                c["boot_detected_structural"] += 1
            elif log:
                log(f"case {i}: boot check said {boot.state} after {kind} of {rel}")
        elif boot.state != VERIFIED:
            c["boot_flagged_content"] += 1
        else:
            c["boot_said_verified_on_content"] += 1
    return c


# --- bad input ---------------------------------------------------------------------------------------
class FuzzEnv:
    """Pristine inputs for fuzz cases (a tiny checkpoint, a --lossless cache of it) and the case folder."""

    def __init__(self, work: Path, make_src: Callable[[Path], Path] | None = None) -> None:
        self.work = work
        # One MoE layer of two experts: a fuzzed input that happens to be valid builds in ~0.1 s.
        self.src = make_src(work / "pristine-src") if make_src else make_tiny(
            work / "pristine-src", n_routed_experts=2, hidden_size=64, moe_intermediate_size=32,
            intermediate_size=64, vocab_size=64, num_hidden_layers=2)
        self.cache = work / "pristine-cache"
        build_cache(self.src, self.cache, BuildOptions(delta_budget="40%", lossless=True))
        assert full_verify(self.cache).ok
        self.counts: Counter = Counter()
        self.failures: list[str] = []
        self.n = 0

    def case(self, with_cache: bool = False) -> Path:
        """A fresh case folder: src/ (a copy), cache/ (a link copy, if asked), outside/ (a sentinel)."""
        self.n += 1
        case = self.work / "case"
        if case.exists():
            shutil.rmtree(case)
        case.mkdir()
        shutil.copytree(self.src, case / "src")
        if with_cache:
            link_copy(self.cache, case / "cache")
        (case / "outside").mkdir()
        (case / "outside" / "sentinel.bin").write_bytes(b"outside the cache" * 8)
        return case

    def check(self, case: Path, argv: list[str], what: str) -> int:
        """Run a command; count crashes and any file created or changed outside cache/ and export/."""
        skip = (case / "cache", case / "export")
        before = tree_snapshot(case, skip)
        via_main = self.n % MAIN_EVERY == 0
        self.counts["via_main" if via_main else "via_library"] += 1
        try:
            rc, _, err = run_main(argv) if via_main else run_library(argv)
        except BaseException as e:  # noqa: BLE001 - main() must never raise
            rc, err = -1, f"Traceback: main raised {type(e).__name__}: {e}"
        after = tree_snapshot(case, skip)
        self.counts["cases"] += 1
        self.counts[f"{what}_rc{rc}"] += 1
        if is_crash(rc, err):
            self.counts["crashes"] += 1
            self.failures.append(f"{what}: rc={rc} {argv[:1]}: {err.strip()[-400:]}")
        if rc not in OK_CODES:
            self.counts["bad_exit_codes"] += 1
        if before != after:
            self.counts["written_outside"] += 1
            diff = sorted(set(before.items()) ^ set(after.items()))[:4]
            self.failures.append(f"{what}: {argv[:1]} changed files outside the cache: {diff}")
        return rc


MAIN_EVERY = 10  # one case in ten goes through main() (typer parsing and output, 0.13 s); the rest call the library


def run_library(argv: list[Any]) -> tuple[int, str, str]:
    """What main(argv) does for the commands the campaign uses, minus typer's parsing (0.13 s a call).

    Exceptions become exit codes through the CLI's own table; one that the table does not know is
    the crash main() would report as an internal error (exit 70).
    """
    import traceback

    from moet_cache import BuildOptions, boot_check, build_cache, full_verify, inspect_cache, verify_against
    from moet_cache.build import retier_cache
    from moet_cache.cli._errors import exit_code_for
    from moet_cache.source.exporter import export_checkpoint
    a = [str(x) for x in argv if str(x) not in ("--quiet", "--json")]

    def opt(name: str) -> str | None:
        return a[a.index(name) + 1] if name in a else None
    try:
        if a[0] == "build":
            build_cache(a[1], a[2], BuildOptions(delta_budget=opt("--delta-budget") or "4.5GB",
                                                 profile=opt("--profile"), lossless="--lossless" in a))
            return 0, "", ""
        if a[0] == "verify":
            r = verify_against(a[1], opt("--against")) if "--against" in a else \
                full_verify(a[1]) if "--full" in a else boot_check(a[1])
            json.dumps(r.__dict__, default=str)  # what --json prints must be printable
            return (0 if r.ok else 1), "", ""
        if a[0] == "inspect":
            inspect_cache(a[1])
        elif a[0] == "export":
            export_checkpoint(a[1], a[2])
        elif a[0] == "retier":
            retier_cache(a[1], opt("--delta-budget") or "4.5GB", opt("--profile"))
        else:
            raise AssertionError(a)
        return 0, "", ""
    except BaseException as e:  # noqa: BLE001 - mapped exactly as main() maps it
        code = exit_code_for(e)
        if code is None:
            return 70, "", "internal error: " + "".join(traceback.format_exception(e))
        return code, "", f"Error: {e}"


def rewrite_json(path: Path, doc: Any) -> bytes:
    data = (json.dumps(doc, indent=1) + "\n").encode()
    if path.is_file():
        path.unlink()  # never write through a hard link into the pristine copy
    path.write_bytes(data)
    return data


def recommit(cache: Path, layer_manifest: str | None = None) -> None:
    """Re-seal cache.json (and a layer manifest's reference) so that a tampered manifest is parsed, not refused.

    This is what an attacker who can rewrite the manifests does; the parsers are the last line.
    """
    try:
        doc = json.loads((cache / CACHE_MANIFEST).read_bytes())
        if layer_manifest is not None and isinstance(doc, dict) and isinstance(doc.get("layers"), list):
            data = (cache / layer_manifest).read_bytes()
            for ref in doc["layers"]:
                if isinstance(ref, dict) and ref.get("manifest") == layer_manifest:
                    ref["size"], ref["xxh3"] = len(data), xxh3_hex(data)
            mdata = rewrite_json(cache / CACHE_MANIFEST, doc)
        else:
            mdata = (cache / CACHE_MANIFEST).read_bytes()
    except (OSError, ValueError, RecursionError):
        mdata = (cache / CACHE_MANIFEST).read_bytes() if (cache / CACHE_MANIFEST).is_file() else b""
    commit = json.loads((cache / COMMIT_RECORD).read_bytes())
    commit["manifest_size"], commit["manifest_xxh3"] = len(mdata), xxh3_hex(mdata)
    rewrite_json(cache / COMMIT_RECORD, commit)


# --- bad input: hypothesis strategies and cases --------------------------------------------------------
# Imported lazily so that the crash and corruption campaigns do not need hypothesis; built once.
@functools.lru_cache(maxsize=1)
def strategies() -> Any:
    from hypothesis import strategies as st
    scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
               | st.sampled_from([0, -1, 1, 2**31, 2**53, 2**63, 2**64, 10**30, 16, 4096])
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))

    def extend(ch: Any) -> Any:
        return st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=6), ch, max_size=3)
    values = st.recursive(scalars, extend, max_leaves=6)
    paths = st.sampled_from(["../outside/sentinel.bin", "..", ".", "", "/etc/passwd", "a/../../outside/sentinel.bin",
                             "layers/../../outside/sentinel.bin", "x\x00y", "layers\\x", "layers//x", "~/x",
                             "OUTSIDE_ABS", "layers/../cache.json", "a" * 5000, "layers/layer-001.base.safetensors",
                             ".state/verified.json", "COMMIT.json"]) | st.text(max_size=24)
    raw = st.sampled_from([b"", b"\x00" * 9, b"\xff\xfe", b"[" * 100000, b"{\"a\":" * 50000, b"nul",
                           b"\xef\xbb\xbf{}", b"NaN", b"1e999999", b"{\"format\": 1}"]) | st.binary(max_size=64)
    return st, scalars, values, paths, raw


def _set_path(doc: Any, path: list[Any], value: Any) -> Any:
    if not path:
        return value
    cur = doc
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return doc


def _del_path(doc: Any, path: list[Any]) -> Any:
    if not path:
        return doc
    cur = doc
    for k in path[:-1]:
        cur = cur[k]
    del cur[path[-1]]
    return doc


def json_paths(doc: Any, limit: int = 4000) -> list[list[Any]]:
    """Every place in a JSON document (root included), breadth first, at most `limit`."""
    out: list[list[Any]] = [[]]
    queue: list[tuple[list[Any], Any]] = [([], doc)]
    while queue and len(out) < limit:
        path, node = queue.pop(0)
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            out.append(path + [k])
            queue.append((path + [k], v))
    return out


def mutate_json(data: Any, doc: Any, case: Path) -> Any:
    """Replace, delete or retype one place of `doc` (drawn with hypothesis' `data`)."""
    st, scalars, values, paths, _ = strategies()
    places = json_paths(doc)
    path = places[data.draw(st.integers(0, len(places) - 1), label="place")]
    op = data.draw(st.sampled_from(["value", "path", "delete", "huge", "negate"]), label="op")
    if op == "delete" and path:
        return _del_path(doc, path)
    if op == "path":
        v = data.draw(paths, label="path")
        v = str(case / "outside" / "sentinel.bin") if v == "OUTSIDE_ABS" else v
    elif op == "huge":
        v = data.draw(st.sampled_from([2**53, 2**63, 2**64 + 1, 10**400, -(2**63), 1e308]), label="huge")
    elif op == "negate":
        v = data.draw(scalars, label="scalar")
    else:
        v = data.draw(values, label="value")
    return _set_path(doc, path, v)


def write_doc(data: Any, path: Path, doc: Any) -> None:
    """Write a (mutated) JSON document, or now and then raw junk in its place."""
    st, *_, raw = strategies()
    if data.draw(st.integers(0, 9), label="junk?") == 0:
        path.unlink(missing_ok=True)
        path.write_bytes(data.draw(raw, label="raw"))
    else:
        try:
            text = json.dumps(doc, indent=1)
        except (ValueError, OverflowError):
            text = "{}"
        path.unlink(missing_ok=True)
        path.write_text(text)


def case_config(data: Any, env: FuzzEnv) -> None:
    case = env.case()
    cfg = json.loads((case / "src" / "config.json").read_text())
    write_doc(data, case / "src" / "config.json", mutate_json(data, cfg, case))
    env.check(case, ["build", case / "src", case / "cache", "--quiet"], "config")


def case_index(data: Any, env: FuzzEnv) -> None:
    from moet_cache.source.checkpoint import INDEX_NAME
    case = env.case()
    idx = json.loads((case / "src" / INDEX_NAME).read_text())
    write_doc(data, case / "src" / INDEX_NAME, mutate_json(data, idx, case))
    env.check(case, ["build", case / "src", case / "cache", "--quiet"], "index")


def mutate_safetensors(data: Any, path: Path, case: Path) -> None:
    """Damage a safetensors file's header: its length prefix, offsets, dtypes, shapes, entries."""
    st, scalars, values, _, _ = strategies()
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    body = blob[8 + n:]
    names = [k for k in header if k != "__metadata__"]
    ops = ["prefix", "add", "metadata", "truncate"]
    if names:
        name = data.draw(st.sampled_from(names), label="tensor")
        ops += ["offsets", "overlap", "dtype", "shape", "delete", "json"]
    op = data.draw(st.sampled_from(ops), label="st-op")
    prefix = None
    if op == "prefix":
        prefix = data.draw(st.sampled_from([0, 1, 7, n - 1, n + 1, len(blob), 100 << 20, (100 << 20) + 1, 2**63, 2**64 - 1])
                           | st.integers(0, 2**64 - 1), label="prefix")
    elif op == "offsets":
        header[name]["data_offsets"] = [data.draw(st.integers(-(2**64), 2**65), label="b"),
                                        data.draw(st.integers(-(2**64), 2**65), label="e")]
    elif op == "overlap":
        other = header[data.draw(st.sampled_from(names), label="other")]["data_offsets"]
        b = data.draw(st.integers(other[0] - 4, other[1] + 4), label="ob")
        header[name]["data_offsets"] = [b, b + (header[name]["data_offsets"][1] - header[name]["data_offsets"][0])]
    elif op == "dtype":
        header[name]["dtype"] = data.draw(st.sampled_from(["U8", "F32", "F64", "BF16", "F4", "F8_E4M3", "I64", "bool",
                                                           "F8_E8M0", "U1", "", "float32"]) | scalars, label="dtype")
    elif op == "shape":
        header[name]["shape"] = data.draw(st.lists(st.integers(-(2**64), 2**64) | st.sampled_from([0, 2**32, 2**62, 2**63]),
                                                   max_size=9) | values, label="shape")
    elif op == "delete":
        del header[name]
    elif op == "add":
        header[data.draw(st.text(max_size=40), label="new")] = data.draw(values, label="entry")
    elif op == "metadata":
        header["__metadata__"] = data.draw(values, label="meta")
    elif op == "truncate":
        body = body[:data.draw(st.integers(0, max(0, len(body) - 1)), label="cut")]
    else:
        header[name] = data.draw(values, label="entry")
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    size = len(raw) if prefix is None else prefix
    path.unlink()
    path.write_bytes(size.to_bytes(8, "little") + raw + body)


def case_source_header(data: Any, env: FuzzEnv) -> None:
    from hypothesis import strategies as st
    case = env.case(with_cache=data.draw(st.booleans(), label="against?"))
    shard = sorted((case / "src").glob("*.safetensors"))[0]
    mutate_safetensors(data, shard, case)
    if (case / "cache").exists():
        env.check(case, ["verify", case / "cache", "--against", case / "src", "--quiet"], "src-header")
    else:
        env.check(case, ["build", case / "src", case / "cache", "--quiet"], "src-header")


def _reseal_file(cache: Path, rel: str) -> None:
    """After changing a listed file, write its new size and digest into the manifest that lists it."""
    data = (cache / rel).read_bytes() if (cache / rel).is_file() else b""
    try:
        cf_doc = json.loads((cache / CACHE_MANIFEST).read_bytes())
    except (OSError, ValueError, RecursionError):
        return
    for f in cf_doc.get("files", []):
        if f.get("path") == rel:
            f["size"], f["xxh3"] = len(data), xxh3_hex(data)
            rewrite_json(cache / CACHE_MANIFEST, cf_doc)
            recommit(cache)
            return
    for ref in cf_doc.get("layers", []):
        lpath = cache / ref["manifest"]
        lm = json.loads(lpath.read_bytes())
        for f in lm.get("files", []):
            if f.get("path") == rel:
                f["size"], f["xxh3"] = len(data), xxh3_hex(data)
                rewrite_json(lpath, lm)
                recommit(cache, ref["manifest"])
                return


COMMANDS = ("verify", "verify-full", "inspect", "export", "retier", "build", "against")


def _command(name: str, case: Path) -> list[Any]:
    c = case / "cache"
    return {"verify": ["verify", c], "verify-full": ["verify", c, "--full"], "inspect": ["inspect", c, "--json"],
            "export": ["export", c, case / "export"], "retier": ["retier", c, "--delta-budget", "10%"],
            "build": ["build", case / "src", c, "--lossless", "--delta-budget", "40%"],
            "against": ["verify", c, "--against", case / "src"]}[name] + ["--quiet"]


def case_cache_header(data: Any, env: FuzzEnv) -> None:
    from hypothesis import strategies as st
    case = env.case(with_cache=True)
    files = sorted(str(p.relative_to(case / "cache")) for p in (case / "cache").rglob("*.safetensors"))
    rel = data.draw(st.sampled_from(files), label="file")
    mutate_safetensors(data, case / "cache" / rel, case)
    _reseal_file(case / "cache", rel)
    env.check(case, _command(data.draw(st.sampled_from(COMMANDS), label="cmd"), case), "cache-header")


def case_profile(data: Any, env: FuzzEnv) -> None:
    from hypothesis import strategies as st
    case = env.case(with_cache=data.draw(st.booleans(), label="retier?"))
    doc = {"format": "moet-cache-routing-profile", "format_version": 1,
           "layers": [{"layer": 1, "counts": [1, 2]}]}
    prof = case / "outside" / "profile.json"
    write_doc(data, prof, mutate_json(data, doc, case))
    if (case / "cache").exists():
        env.check(case, ["retier", case / "cache", "--delta-budget", "20%", "--profile", prof, "--quiet"], "profile")
    else:
        env.check(case, ["build", case / "src", case / "cache", "--profile", prof, "--quiet"], "profile")


MANIFESTS = ("cache.json", "COMMIT.json", "layers/layer-001.json", "delta/tier.json",
             "delta/tier.part.json", "source-map.json", "dense/model-00001-of-00001.safetensors.json",
             ".state/verified.json")


def case_manifest(data: Any, env: FuzzEnv) -> None:
    from hypothesis import strategies as st
    case = env.case(with_cache=True)
    cache = case / "cache"
    op = data.draw(st.sampled_from(["edit"] * 6 + ["link-file", "link-dir", "link-manifest"]), label="m-op")
    if op == "edit":
        rel = data.draw(st.sampled_from(MANIFESTS), label="manifest")
        doc = json.loads((cache / rel).read_bytes())
        write_doc(data, cache / rel, mutate_json(data, doc, case))
        if rel.startswith("layers/"):
            recommit(cache, rel)
        elif rel == CACHE_MANIFEST:
            recommit(cache)
        elif rel not in (COMMIT_RECORD, VERIFIED_STATE):
            _reseal_file(cache, rel)
    elif op == "link-file":  # a listed file replaced by a link to an identical file outside the cache
        files = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file() and ".state" not in p.parts)
        rel = data.draw(st.sampled_from(files), label="file")
        target = case / "outside" / Path(rel).name
        shutil.copyfile(cache / rel, target)
        (cache / rel).unlink()
        (cache / rel).symlink_to(target)
    elif op == "link-dir":  # a whole folder of the cache replaced by a link to a copy outside
        d = data.draw(st.sampled_from(["layers", "dense", "delta", "model", ".state"]), label="dir")
        shutil.copytree(cache / d, case / "outside" / d)
        shutil.rmtree(cache / d)
        (cache / d).symlink_to(case / "outside" / d)
    else:
        rel = data.draw(st.sampled_from([CACHE_MANIFEST, COMMIT_RECORD]), label="manifest")
        shutil.copyfile(cache / rel, case / "outside" / rel)
        (cache / rel).unlink()
        (cache / rel).symlink_to(case / "outside" / rel)
    env.check(case, _command(data.draw(st.sampled_from(COMMANDS), label="cmd"), case), f"manifest-{op}")


FUZZ_CASES: dict[str, Callable[[Any, FuzzEnv], None]] = {
    "config": case_config, "index": case_index, "source-header": case_source_header,
    "cache-header": case_cache_header, "profile": case_profile, "manifest": case_manifest,
}
# The CI share of the >= 2000 cases; the long form scales these.
FUZZ_CI_EXAMPLES = {"config": 250, "index": 250, "source-header": 400, "cache-header": 200, "profile": 450,
                    "manifest": 450}


def fuzz_counted(kind: str, env: FuzzEnv, examples: int) -> dict[str, int]:
    """Run `examples` cases of one kind; the counts they added (cases, crashes, bad exit codes, writes outside)."""
    env.failures.clear()
    keys = ("cases", "crashes", "bad_exit_codes", "written_outside")
    before = {k: env.counts[k] for k in keys}
    fuzz(kind, env, examples)
    return {k: env.counts[k] - before[k] for k in keys}


def fuzz(kind: str, env: FuzzEnv, examples: int, seed: int | None = None) -> None:
    """Run `examples` hypothesis cases of one kind against `env` (counts land in env.counts)."""
    from hypothesis import HealthCheck, given, seed as hseed, settings
    from hypothesis import strategies as st
    fn = FUZZ_CASES[kind]

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is None,
              suppress_health_check=list(HealthCheck), phases=["generate"])
    @given(st.data())
    def run(data: Any) -> None:
        fn(data, env)

    if seed is not None:
        run = hseed(seed)(run)
    run()
