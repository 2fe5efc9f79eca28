"""build_cache: the build as the script it is.

Order of writes (each atomic): aux files, dense shards (+ part records), per layer the plane files
then its manifest, the delta pack and index, the source map, cache.json, and last COMMIT.json.
A killed (or cancelled) build is rerun: finished parts whose files still match their records are kept.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from functools import partial
from pathlib import Path

from ..cache import layout as L
from ..cache.cacheview import read_committed_manifest, read_delta_index
from ..cancel import CancelToken
from ..source.checkpoint import SourceReader, link_root, open_checkpoint
from ..cache.commit import changing
from ..errors import InputError
from ..fsutil import check_free_space, is_inside, refuse_overlap
from ..cache.manifest import BuildParams, CacheManifest, CacheModel, FileEntry, LayerRef, ManifestError, utc_now
from ..progress import NullProgress, Progress
from ..cache.tiering import RoutingProfile, check_profile, load_profile
from ..units import parse_budget
from ..verify.boot import boot_check
from ..verify.state import speed_sample
from ..version import __version__
from .dense import aux_files, copy_aux, copy_dense, planned_paths, served_config, source_map
from .layers import LayerResults, build_layers
from .options import BuildOptions, BuildResult
from .parts import Counters
from .plan import BuildPlan, make_plan
from .tier import build_tier
from .written import is_cache_folder, note_planned, sweep


def build_cache(src: str | os.PathLike[str], cache: str | os.PathLike[str], options: BuildOptions | None = None,
                progress: Progress | None = None, cancel: CancelToken | None = None) -> BuildResult:
    """Build (or resume, or confirm) the cache for `src` at `cache`.

    `cancel` (set from any thread) stops the build between units of work with Interrupted; the cache is
    then left uncommitted (or its previous commit restored), and the same call resumes it.
    """
    t0 = time.perf_counter()
    opts = options or BuildOptions()
    root = _cache_folder(Path(src), Path(cache))
    with changing(root, opts.wait, opts.kill_at) as commits, open_checkpoint(Path(src)) as ckpt:
        plan = make_plan(ckpt, opts)
        profile = _profile(plan)
        budget = parse_budget(opts.delta_budget, plan.total_delta_bytes, what="delta budget")
        mid_budget = parse_budget(opts.mid_budget, plan.total_mid_bytes, what="mid budget") if opts.mid_budget else 0
        params = plan.build_params(budget, profile.digest if profile else None, mid_budget)
        aux = aux_files(ckpt.root)  # a source file that cannot be carried is refused before any write
        done = _already_complete(root, plan, params)
        if done is not None:
            sweep(root, done)  # what a build killed after its commit left: the temp of .state/verified.json
            return _result(root, plan, done, None, 0, budget, t0)
        commits.uncommit()
        _check_space(root, plan, budget + mid_budget)
        note_planned(root, planned_paths(plan, aux))  # the sweep's proof, before the first cache file
        counters = Counters(progress or NullProgress(), cancel)
        counters.progress.start(plan.planed_bytes + plan.dense_bytes, "build")
        with closing(SourceReader(ckpt)) as reader:
            files = copy_aux(aux, root)
            # The dense copy (disk-bound) runs on its own thread beside the layers (CPU-bound).
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="moet-dense") as dense_pool:
                dense = [dense_pool.submit(copy_dense, plan, root, reader, counters, shard)
                         for shard in sorted(plan.dense_by_shard)]
                with counters.stopping_on_error():  # a failed layer stops the dense copy at its next chunk
                    layers = build_layers(plan, root, reader, counters)
                files += [fe for part in dense for fe in part.result()]
            files += build_tier(plan, root, reader, layers.done, budget, profile, cancel, mid_budget)
        files.append(source_map(ckpt, root, plan.omitted))
        files = served_config(root, files, {layer: lm for layer, (lm, _) in layers.done.items()})
        manifest = _manifest(plan, params, layers, files)
        counters.check()  # the last moment a cancel is taken: from here the commit runs to its end
        commits.commit(manifest, partial(sweep, root), speed_sample(*counters.hashed))
        counters.progress.finish()
        return _result(root, plan, manifest, layers, counters.read_bytes, budget, t0)


def _cache_folder(src: Path, root: Path) -> Path:
    """The cache folder, checked before anything is written: apart from the source (in both directions,
    links resolved: the sweep deletes and the writes replace files in the cache), and new, empty or a cache."""
    if root.exists() and not root.is_dir():
        raise InputError(f"{root} exists and is not a folder", "choose a new folder for the cache")
    refuse_overlap(link_root(src), "checkpoint folder", root, "cache folder")
    into = _link_into(src, root)
    if into is not None:
        raise InputError(f"{into} in the checkpoint is a link into the cache folder {root}",
                         "choose a cache folder that holds none of the checkpoint's files")
    if root.is_dir() and not is_cache_folder(root):
        raise InputError(f"{root} is not empty and holds no moet-cache cache; a build writes only into a new or "
                         "empty folder or its own cache", "choose a new or empty folder for the cache")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _link_into(src: Path, root: Path) -> Path | None:
    """A link in the source folder (its subfolders too, linked folders not entered) that leads into `root`."""
    if not src.is_dir():
        return None  # open_checkpoint says what is wrong with it
    for folder, dirs, names in os.walk(src):
        for name in (*dirs, *names):
            p = Path(folder) / name
            if not p.is_symlink():
                continue
            try:
                target = p.resolve()
            except (OSError, RuntimeError):  # a loop leads nowhere; aux_files or open_checkpoint name it
                continue
            if is_inside(root, target):
                return p
    return None


def _profile(plan: BuildPlan) -> RoutingProfile | None:
    """The routing profile the tier is weighted by, checked against the served layers."""
    if not plan.opts.profile:
        return None
    profile = load_profile(plan.opts.profile)
    check_profile(profile, {layer: plan.ckpt.model.n_routed_experts for layer in plan.served})
    return profile


def _manifest(plan: BuildPlan, params: BuildParams, layers: LayerResults, files: list[FileEntry]) -> CacheManifest:
    ck = plan.ckpt
    refs = tuple(LayerRef(layer, fe.path, fe.size, fe.xxh3) for layer, (_, fe) in sorted(layers.done.items()))
    return CacheManifest(__version__, utc_now(), str(ck.root.resolve()), ck.layout, plan.fingerprint,
                         CacheModel(ck.model, ck.family), params, refs, tuple(files))


def _already_complete(root: Path, plan: BuildPlan, params: BuildParams) -> CacheManifest | None:
    """The committed manifest if it is this very build (settings and source) and the boot check passes."""
    try:
        manifest = read_committed_manifest(root)
    except (ManifestError, InputError):
        return None
    if manifest is None or manifest.build != params or manifest.source_fingerprint != plan.fingerprint:
        return None
    return manifest if boot_check(root).ok else None


def _check_space(root: Path, plan: BuildPlan, budget: int) -> None:
    codes = plan.planed_bytes
    estimate = codes + min(budget, codes // 2) + plan.dense_bytes
    present = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    check_free_space(root, max(0, estimate - present))


def _result(root: Path, plan: BuildPlan, manifest: CacheManifest, layers: LayerResults | None, read_bytes: int,
            budget: int, t0: float) -> BuildResult:
    index = read_delta_index(root, manifest)
    assert index is not None  # every build writes one
    pack = manifest.file(L.Role.PACK)
    return BuildResult(
        cache=str(root), already_complete=layers is None, layers=tuple(plan.served),
        layers_built=tuple(layers.built) if layers else (), layers_reused=tuple(layers.reused) if layers else (),
        source_bytes=read_bytes, cache_bytes=sum(f.size for f in manifest.files) + sum(r.size for r in manifest.layers),
        tier_experts=sum(len(ex) for _, ex in index.layers), tier_bytes=index.used_bytes,
        tier_file_bytes=pack.size if pack else 0, budget_bytes=budget, seconds=time.perf_counter() - t0,
        mid_experts=sum(len(ex) for _, ex in index.mid_layers or ()), mid_bytes=index.mid_used_bytes)


__all__ = ["build_cache"]
