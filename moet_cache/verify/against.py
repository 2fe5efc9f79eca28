"""The check against the source (verify --against): every expert's planes, scales and tables rebuilt from the
source checkpoint and compared bit for bit, every dense tensor compared, the first mismatch named."""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cache import layout as L
from ..cache.cacheview import CacheView, ListedFileError
from ..cancel import CancelToken, check as check_cancel
from ..enums import TensorKind
from ..errors import InputError, VerificationError
from ..cache.manifest import CACHE_MANIFEST
from ..progress import NullProgress, Progress
from .boot import boot_view
from .report import CORRUPT, VERIFIED, Check, Problem, ProblemKind, VerifyReport


def cache_read_errors(fn: Any) -> Any:
    """A cache file that safetensors cannot read although its manifest passed is a damaged cache (exit 1)."""
    import functools

    from safetensors import SafetensorError

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SafetensorError as e:
            raise VerificationError(f"a cache file is not readable safetensors: {e}",
                                    "run moet-cache verify --full, then build the cache again") from None
    return wrapper


def _against_listed(cf: CacheView) -> list[Problem]:
    """What --against needs the cache to list: its source map and model config, both readable."""
    problems: list[Problem] = []
    if cf.manifest.file(L.Role.SOURCE_MAP) is None:
        problems.append(Problem(ProblemKind.COVERAGE, CACHE_MANIFEST,
                                "the cache lists no source map (source-map.json)"))
    if not any(f.role == L.Role.AUX and f.path.rsplit("/", 1)[-1] == "config.json" for f, _ in cf.files):
        problems.append(Problem(ProblemKind.COVERAGE, CACHE_MANIFEST,
                                f"the cache lists no model config ({L.AUX_DIR}/config.json)"))
    try:
        cf.delta_index, cf.source_map  # noqa: B018 - read (and checked) now, so damage is reported here
    except ListedFileError as e:
        problems.append(Problem(ProblemKind.DIGEST, e.path, e.message))
    return problems


def _differs(got: Any, want: Any) -> bool:
    """Whether two arrays (or scalars) differ in any byte."""
    import numpy as np
    a, b = (np.ascontiguousarray(np.asarray(v).reshape(-1)).view(np.uint8) for v in (got, want))
    return not np.array_equal(a, b)


@dataclass(frozen=True)
class _LayerAgainst:
    """One served layer's cache files, open, and what comparing an expert's projection needs of them."""

    layer: int
    lm: Any              # LayerManifest
    geo: Any             # its LayerGeometry, once a layer
    base_path: str
    base: Any            # the base file, a stread.TensorFile (pread, no map)
    all_path: str | None
    all: Any             # the lossless delta file (a TensorFile), or None
    pack: Any            # the tier pack (a TensorFile), or None
    tier: list[int]
    checked: dict[str, int]
    names: frozenset[str] = frozenset()  # the base file's tensor names
    form: str = "fitted"                 # the cache's base-table form (enums.BaseTable): the tables are refit in it
    mid: tuple[int, ...] = ()            # the layer's mid-tier experts (their planes and tables in the pack)

    def expert(self, ck: Any, e: int, want_fmt: Any, progress: Progress) -> list[Problem]:
        """Every projection of expert e against the source, in order; the first one's problems, or none."""
        from ..source.checkpoint import PROJECTIONS
        for j, proj in enumerate(PROJECTIONS):
            x = ck.read_raw_expert(self.layer, e, proj)
            if want_fmt is not None and x.fmt is not want_fmt:
                return [Problem(ProblemKind.MISMATCH, self.base_path, f"expert {e} {proj}: the source is "
                                f"{x.fmt.name}, the cache was built from {want_fmt.name}", self.layer)]
            problems = self.projection(e, j, proj, x)
            progress.advance(x.codes.nbytes)
            ck.release(x.codes)
            if problems:
                return problems
        return []

    def projection(self, e: int, j: int, proj: str, x: Any) -> list[Problem]:
        """Expert e's projection `proj` (j-th) in the cache against the source's raw tensors x."""
        import numpy as np

        from ..format.formats import stored_scales
        from ..cache.geometry import is_w13, names_of
        from ..codec.planes import code_histogram, fit_base_table, fit_mid_table, mid_plane, split_planes
        problems: list[Problem] = []
        name = f"expert {e} {proj}"

        def mismatch(what: str, tensor: str, path: str = self.base_path) -> None:
            problems.append(Problem(ProblemKind.MISMATCH, path, f"{name}: {what} differs from the source",
                                    self.layer, tensor))
        bf, base, delta = self.base, *split_planes(x.codes)
        base_name, delta_name, scale_name = names_of(proj)
        rows, w13 = self.geo.rows(proj), is_w13(proj)
        at = (e, j) if w13 else (e,)
        if _differs(bf.row(base_name, e)[rows], base):
            mismatch("base plane", base_name)
        try:
            want_scale = stored_scales(x.scale_bytes, x.fmt.scale_form, self.lm.scale_form(scale_name))
        except InputError:
            want_scale = None
        if want_scale is None or _differs(bf.row(scale_name, e)[rows], want_scale):
            mismatch("block scales", scale_name)
        s2 = L.W13_SCALE_2 if w13 else L.W2_SCALE_2
        if _differs(bf.array(s2)[at], np.float32(x.scale_2)):
            mismatch("global scale", s2)
        tname = L.W13_TABLE if w13 else L.W2_TABLE
        if _differs(bf.array(tname)[at], fit_base_table(code_histogram(x.codes), self.form)):
            mismatch(f"{self.form} table (recomputed from the source's codes)", tname)
        iname = L.W13_INPUT_SCALE if w13 else L.W2_INPUT_SCALE
        if (x.input_scale is None) != (iname not in self.names):
            mismatch("presence of an input scale", iname)
        elif x.input_scale is not None and _differs(bf.array(iname)[at],
                                                    np.float32(x.fmt.multiply(x.input_scale))):
            mismatch("input scale", iname)
        self.checked["scales"] += 1 + (x.global_scale is not None) + (x.input_scale is not None)
        self.checked["tables"] += 1
        deltas = []
        if self.all is not None:
            deltas.append((self.all_path, delta_name, self.all.row(delta_name, e)[rows]))
            for kind, t in ((TensorKind.GLOBAL_SCALE, x.global_scale), (TensorKind.INPUT_SCALE, x.input_scale)):
                raw = L.source_scalar(proj, kind)
                if t is not None and _differs(self.all.row(raw, e), t):
                    mismatch(f"source {kind.replace('_', ' ')}", raw, self.all_path)
        if e in self.tier:
            which = L.pack_tensor(self.layer, delta_name)
            deltas.append((L.PACK, which, self.pack.row(which, self.tier.index(e))[rows]))
        for path, tensor, got in deltas:
            self.checked["delta_planes"] += 1
            if _differs(got, delta):
                problems.append(Problem(ProblemKind.MISMATCH, path, f"{name}: delta plane differs from the source",
                                        self.layer, tensor))
        if e in self.mid:
            k = self.mid.index(e)
            plane, table = (L.W13_MID, L.W13_MID_TABLE) if w13 else (L.W2_MID, L.W2_MID_TABLE)
            plane, table = L.pack_tensor(self.layer, plane), L.pack_tensor(self.layer, table)
            self.checked["mid_planes"] += 1
            if _differs(self.pack.row(plane, k)[rows], mid_plane(delta)):
                mismatch("mid plane", plane, L.PACK)
            if _differs(self.pack.array(table)[(k, j) if w13 else (k,)], fit_mid_table(code_histogram(x.codes))):
                mismatch("mid table (recomputed from the source's codes)", table, L.PACK)
        return problems


def _layer_against(root: Path, cf: CacheView, layer: int, ck: Any, pack: Any, checked: dict[str, int],
                   progress: Progress, cancel: CancelToken | None) -> list[Problem]:
    """Every expert of one served layer against the source; the first problems found, or none."""
    from ..format.formats import FORMATS
    from ..cache.stread import TensorFile
    lm = cf.layers[layer]
    base_fe = next(f for f in lm.files if f.role == L.Role.BASE)
    all_fe = next((f for f in lm.files if f.role == L.Role.DELTA_ALL), None)
    want_fmt = FORMATS.get(lm.source_format) if lm.source_format else None
    with TensorFile(root, base_fe.path) as bf, ExitStack() as stack:
        allf = stack.enter_context(TensorFile(root, all_fe.path)) if all_fe else None
        la = _LayerAgainst(layer, lm, lm.geometry(), base_fe.path, bf, all_fe.path if all_fe else None, allf,
                           pack, list(cf.tier_experts(layer)), checked, frozenset(bf.keys()),
                           cf.manifest.build.base_table, cf.mid_experts(layer))
        for e in range(lm.n_experts):
            check_cancel(cancel)
            problems = la.expert(ck, e, want_fmt, progress)
            checked["experts"] += 1  # the expert that failed counts as checked, as it always did
            if problems:
                return problems
    return []


@cache_read_errors
def verify_against(root: str | os.PathLike[str], src: str | os.PathLike[str],
                   progress: Progress | None = None, cancel: CancelToken | None = None) -> VerifyReport:
    """Every plane, block scale, global scale, input scale and table of every expert equals what the
    source gives (planes and scales bit for bit, tables recomputed from the source's codes); every dense
    tensor is there and equal; names the first mismatch. A cache the boot check finds incomplete or
    corrupt is reported as such (exit 1), as is one without its model config or source map."""
    # numpy, torch and safetensors are imported inside, not at the top: the boot check (every start of
    # `moet-cache verify`) needs none of them, and torch alone costs seconds of import time.
    from ..source.checkpoint import open_checkpoint
    from ..cache.stread import TensorFile
    t0 = time.perf_counter()
    root = Path(root)
    progress = progress or NullProgress()
    boot, cf = boot_view(root, check_source=False)
    if not boot.complete or cf is None:
        return VerifyReport(Check.AGAINST, boot.state, boot.problems, boot.files_checked, seconds=time.perf_counter() - t0)
    problems = _against_listed(cf)
    if problems:
        return VerifyReport(Check.AGAINST, CORRUPT, tuple(problems), len(cf.files), seconds=time.perf_counter() - t0)
    checked = {"experts": 0, "delta_planes": 0, "scales": 0, "tables": 0, "dense_tensors": 0}
    if cf.delta_index is not None and cf.delta_index.mid_layers is not None:
        checked["mid_planes"] = 0
    with open_checkpoint(src) as ck:
        if ck.layout != cf.manifest.source_layout:
            return VerifyReport(Check.AGAINST, CORRUPT, (Problem(ProblemKind.MISMATCH, CACHE_MANIFEST,
                                f"the source is {ck.layout}, the cache was built from {cf.manifest.source_layout}"),),
                                len(cf.files), seconds=time.perf_counter() - t0)
        with ExitStack() as stack:
            pack = stack.enter_context(TensorFile(root, L.PACK)) if cf.delta_index else None
            progress.start(sum(lm.source_bytes for lm in cf.layers.values()), "verify --against")
            for layer in sorted(cf.layers):
                problems = _layer_against(root, cf, layer, ck, pack, checked, progress, cancel)
                if problems:
                    break
        if not problems:
            problems = _dense_against(root, cf, ck, checked, cf.source_map)
    progress.finish()
    return VerifyReport(Check.AGAINST, CORRUPT if problems else VERIFIED, tuple(problems[:1]), len(cf.files),
                        seconds=time.perf_counter() - t0, details=checked)


def _dense_against(root: Path, cf: CacheView, ck: Any, checked: dict[str, int], smap: Any) -> list[Problem]:
    """Every tensor the source map lists that is not a plane of a served layer is in a dense file, equal."""
    from ..cache.stread import TensorFile
    planed = ck.expert_tensor_names(list(cf.manifest.build.layers))
    shards = smap.get("shards") if isinstance(smap, dict) else None
    listed = {t[0] for sh in (shards if isinstance(shards, list) else ()) if isinstance(sh, dict)
              for t in (sh.get("tensors") if isinstance(sh.get("tensors"), list) else ())
              if isinstance(t, list) and t and isinstance(t[0], str)}
    seen: set[str] = set()
    for f, _ in cf.files:
        if f.role != L.Role.DENSE:
            continue
        with TensorFile(root, f.path) as df:
            for name in df.keys():
                checked["dense_tensors"] += 1
                seen.add(name)
                ent, want = df.header.tensors[name], ck.tensors.get(name)
                if want is None or (ent.dtype, tuple(ent.shape)) != (want.dtype, tuple(want.shape)) \
                        or _differs(df.raw(name), ck.get_raw(name)):
                    return [Problem(ProblemKind.MISMATCH, f.path,
                                    f"dense tensor {name} differs from the source", None, name)]
    missing = sorted(listed - planed - seen)
    if missing:
        return [Problem(ProblemKind.MISSING, L.DENSE_DIR, f"dense tensor {missing[0]} of the source is in no dense file"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""), None, missing[0])]
    return []
