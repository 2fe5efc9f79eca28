"""Old path of the build (moet_cache.build): the names tests, benchmarks and users import from here."""

from __future__ import annotations

from .build.dense import AUX_MAX_BYTES, aux_files, chunks
from .build.layers import measure_scales, multiply_convention
from .build.options import BuildOptions, BuildResult, BuildTuning, RetierResult, plane_device, plane_workers, \
    read_window
from .build.parts import file_matches, sweep
from .build.plan import make_plan
from .build.retier import retier_cache
from .build.run import build_cache
from .build.tier import TIER_PART, TIER_ROLES, DeltaReader, tier_candidates, tier_key, write_delta_pack
from .checkpoint import SourceReader
from .fsutil import read_json_file
from .progress import NullProgress

# the old private names, for scripts that reached them (benchmarks/run.py: _plane_workers)
_plane_workers = plane_workers
_read_window = read_window

__all__ = ["BuildOptions", "BuildResult", "BuildTuning", "RetierResult", "build_cache", "file_matches",
           "read_json_file", "retier_cache"]
