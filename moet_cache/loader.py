"""The runtime loader's old module path: the loader lives in moet_cache/load/ (docs/LOADER.md).

Kept so that `from moet_cache.loader import open_cache` (docs, tests, the vLLM plugin, users) and the
engine names the benchmark and tests reach keep working; nothing is defined here.
"""

from __future__ import annotations

from .load.api import Cache, LoadedLayer, open_cache
from .load.assemble import DELTA_EXPERTS
from .load.engine import Pipeline as _Pipeline
from .load.options import DELTA_MODES, VERIFY_MODES, LoadOptions, Tuning, default_workers
from .load.plan import read_cache_header as parse_header

__all__ = ["open_cache", "Cache", "LoadedLayer", "DELTA_EXPERTS", "DELTA_MODES", "VERIFY_MODES", "parse_header",
           "LoadOptions", "Tuning", "default_workers"]
