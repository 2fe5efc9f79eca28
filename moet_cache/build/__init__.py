"""The build: a cache from an NVFP4/MXFP4 checkpoint, and retier (a new delta tier without the source).

    options  BuildOptions (what), BuildTuning (how it uses the machine), the results
    plan     BuildPlan: what the checkpoint and the options make of the cache (pure)
    dense    the copies: model folder, dense shards (ring of reused buffers), source map
    layers   the per-layer pipeline: read, split, write, commit on the committer thread
    tier     the delta tier: choose, write the pack, its index and part record
    parts    file entries of bytes just written, the resume check of a part, counters
    written  what a build proves it wrote (.written.json and its records), the sweep, is_cache_folder
    run      build_cache, the script;  retier  retier_cache
Both commands change the cache through moet_cache.cache.commit (uncommit, write, commit, record, restore).
"""

from __future__ import annotations

from .options import BuildOptions, BuildResult, BuildTuning, RetierResult
from .parts import file_matches
from .retier import retier_cache
from .run import build_cache

__all__ = ["BuildOptions", "BuildResult", "BuildTuning", "RetierResult", "build_cache", "file_matches", "retier_cache"]
