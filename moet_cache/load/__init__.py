"""The runtime loader (docs/LOADER.md), in layers:

- api.py       the public API: open_cache, Cache.load / load_dense, LoadedLayer; the verify gates
- options.py   LoadOptions: every argument of a load checked in one place (also the vLLM plugin's)
- plan.py      the checked manifests -> jobs of byte ranges (pure)
- engine.py    the I/O engine: worker threads, bounded bytes in flight, host reads, stop on error
- staging.py   CUDA staging: pinned slots, per-worker streams, one device buffer a job
- assemble.py  a read layer -> the tensors handed out (delta_experts, expand=True)
- shard.py     a rank's share of the experts (tensor/expert parallelism) as byte runs (pure)
- dense_select.py  which dense tensors a model reads: the target's part or the drafter's (pure)
"""

from .api import Cache, LoadedLayer, open_cache
from .assemble import DELTA_EXPERTS
from .options import DELTA_MODES, VERIFY_MODES, LoadOptions, Tuning, default_workers
from .shard import Shard

__all__ = ["Cache", "LoadedLayer", "open_cache", "DELTA_EXPERTS", "DELTA_MODES", "VERIFY_MODES", "LoadOptions",
           "Shard", "Tuning", "default_workers"]
