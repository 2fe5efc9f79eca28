"""The `vllm.general_plugins` entry point (pyproject.toml): `register()` makes `--load-format moet`, the
quantization method `moet` and the `moet_deepseek` reasoning/tool parsers known to vLLM.

vLLM calls it in each of its processes, before it reads the model. This module imports without vLLM; the
modules it registers import vLLM, so it imports them when called, and where vLLM is installed but does not
import, it says so in one line (vLLM would only say later that `moet` is an invalid quantization method or
load format).
"""

from __future__ import annotations

import functools
import importlib.util
import logging

_log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _register_with_vllm() -> type:
    """Register the method, the parsers and the loader (once a process: vLLM warns on a loader registered
    again); returns the loader class. ImportError where vLLM does not import."""
    # they import vLLM, an optional dependency; the loader first, as vLLM's model loader is the import the
    # warning below tells how to check
    from . import loader, config, parsers

    config.register()
    parsers.register()
    return loader.register()


def vllm_installed() -> bool:
    """Whether a vLLM package is there to import (not hidden by a None in sys.modules): then an ImportError
    of its modules means it failed part-way (a compiled extension or a library it needs is missing)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def register() -> type | None:
    """Register `--load-format moet`, the quantization method `moet` and the parsers `moet_deepseek`;
    returns the loader class, None without vLLM. Registering again changes nothing."""
    try:
        return _register_with_vllm()
    except ImportError as e:
        if vllm_installed():
            _log.warning("moet-cache: vLLM is installed but does not import (%s: %s), so --load-format moet and "
                         "--quantization moet are not registered; reinstall the vLLM build that matches this "
                         "torch and GPU, and check with: python -c 'import vllm.model_executor.model_loader'",
                         type(e).__name__, str(e).replace("\n", " "))
        return None


__all__ = ["register", "vllm_installed"]
