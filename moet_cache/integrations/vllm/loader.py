"""vLLM's model loader for `vllm serve MODEL --load-format moet --model-loader-extra-config '{"cache": DIR}'`.

`MoetModelLoader` (over vLLM's BaseModelLoader) is registered by plugin.register(); its work,
`load_into_model`, is plain torch and is tested against a fake model with vLLM's parameter names.

Mapping (docs/LOADER.md): each served layer's tensors go into the fused-MoE module of layer L
(`model.layers.{L}.mlp.experts.` in vLLM's DeepSeek-V3 models, `model.layers.{L}.ffn.experts.routed_experts.`
in its DeepSeek-V4 models, drafter blocks at L = num_hidden_layers + K). A stock NVFP4 model (it has `w13_weight`) gets the expanded
FP4 codes (expand=True); a plane-aware runtime (it has `w13_base`) gets the planes, and tensors
whose shapes depend on the tier (w13_delta, w2_delta, delta_experts) become buffers of the experts
module where the model declares no parameter for them. Dense tensors go through the model's own
`load_weights` (vLLM's name mapping: stacking of q/kv, gate/up, ...), or by name when it has none; each model
reads only its part of them (the draft model the drafter's, the target the rest: load/dense_select.py).
Under tensor or expert parallelism the `moet` method keeps each layer's share on its experts module
(`moet_shard`, a load.Shard); the layer's load reads only that share. Shapes are checked and a mismatch
is refused.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Collection, Mapping

import torch
from vllm.model_executor.model_loader import BaseModelLoader, register_model_loader

from ...enums import DeltaMode, VerifyMode
from ...errors import InputError
from ...format.families import Family
from ...load import DELTA_EXPERTS, Shard, open_cache
from ...load.assemble import MID_NAMES
from ...load.dense_select import in_part, part_of_layers
from ...load.options import check_delta, check_inflight, check_verify, check_workers
from .method import layer_index

LOAD_FORMAT = "moet"
_TIER_SHAPED = ("w13_delta", "w2_delta", DELTA_EXPERTS, *MID_NAMES)
_LAYER_IN_NAME = re.compile(r"(?:^|\.)layers\.\d+(?:\.|$)")


@dataclass(frozen=True)
class PluginOptions:
    """`--model-loader-extra-config` keys. expand: None = decide from the model's parameter names."""

    cache: str
    delta: str = DeltaMode.TIER
    verify: str = VerifyMode.BOOT
    workers: int = 4
    max_inflight: str = "2GiB"
    expand: bool | None = None

    @classmethod
    def from_extra(cls, extra: Any) -> PluginOptions:
        if not isinstance(extra, dict) or not isinstance(extra.get("cache"), str) or not extra["cache"]:
            raise InputError("--load-format moet needs the cache folder",
                             """pass --model-loader-extra-config '{"cache": "/path/to/cache"}'""")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InputError(f"unknown moet loader option {unknown[0]!r}", f"known options: {', '.join(sorted(known))}")
        opts = cls(**extra)
        # the loader's own checks (load/options.py), so a key means what the same argument of load means
        check_delta(opts.delta)
        check_verify(opts.verify)
        check_workers(opts.workers)
        check_inflight(opts.max_inflight)
        if opts.expand not in (None, True, False):
            raise InputError(f"expand must be true, false or absent, got {opts.expand!r}")
        return opts


@dataclass(frozen=True)
class LoadSummary:
    layers: tuple[int, ...]
    expanded: bool
    moe_bytes: int
    dense_tensors: int
    seconds: float


# vLLM's DeepSeek-V4 MTP draft model nests each block's decoder layer as `layers.{L}.mtp_block`
_EXPERTS = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(?:mtp_block\.)?(?:mlp|ffn)\.experts\.(?:routed_experts\.)?"
                      r"(?=w13_(?:base|weight)$)")


def experts_prefix(layer: int) -> str:
    """Where vLLM's DeepSeek-V3 models keep a layer's fused-MoE parameters."""
    return f"model.layers.{layer}.mlp.experts."


def experts_prefixes(names: Any, built_as: Mapping[str, str] | None = None) -> dict[int, str]:
    """Layer number -> the prefix of its fused-MoE parameters, from a model's parameter names (V3 and V4).

    built_as: module path + "." -> the layer name vLLM built that experts module with (its `layer_name`),
    whose number wins over the path's: vLLM's DSpark draft model keeps drafter block K at `model.layers.K`
    but builds it as layer num_hidden_layers + K (vllm/models/deepseek_v4/nvidia/dspark.py), the cache's
    number for mtp.K, as the moet method reads it (method.layer_index)."""
    out: dict[int, str] = {}
    for n in names:
        m = _EXPERTS.match(n)
        if m is not None:
            prefix = m.group(0)
            name = (built_as or {}).get(prefix)
            out.setdefault(layer_index(name) if name else int(m.group(1)), prefix)
    return out


def built_layer_names(model: torch.nn.Module) -> dict[str, str]:
    """Every module that carries the layer name vLLM built it with: its path + "." -> that name."""
    return {path + ".": m.layer_name for path, m in model.named_modules()
            if path and isinstance(getattr(m, "layer_name", None), str) and _LAYER_IN_NAME.search(m.layer_name)}


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
        raise InputError(f"{name}: the model wants {dst.dtype} {list(dst.shape)}, the cache has "
                         f"{src.dtype} {list(src.shape)}",
                         "the cache was built for another model (or, over several GPUs, the model does not use "
                         "the moet quantization method, which gives each rank its share)")
    with torch.no_grad():
        dst.copy_(src, non_blocking=False)


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it where it is a view of a larger buffer. A layer's tensors loaded onto a GPU are views of
    one device buffer (load/staging.py); a view kept as a layer's buffer would keep that whole buffer resident,
    the planes already copied into the layer's parameters included."""
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def load_into_model(model: torch.nn.Module, opts: PluginOptions) -> LoadSummary:
    """Fill a model's fused-MoE parameters and dense weights from the cache (the plugin's work)."""
    t0 = time.perf_counter()
    cache = open_cache(opts.cache)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    where = experts_prefixes(params, built_layer_names(model))
    # A model holds the main layers or (vLLM's draft model) the drafter blocks: each loads the cache's layers it
    # holds. One that holds none is refused below by its parameter names.
    layers = [x for x in cache.layers if x in where] or list(cache.layers)
    first = where.get(layers[0], experts_prefix(layers[0]))
    if opts.expand is None:
        if first + "w13_base" in params:
            expand = False
        elif first + "w13_weight" in params:
            expand = True
        elif first + "w13_base_x4" in params or first + "w13_base_tiled" in params:
            # runtime.layout: the planes were moved into the plane kernels' layout after the first load
            raise InputError("this model's base planes were moved into the plane kernels' layout when it "
                             "loaded, so moet-cache cannot load weights into it again",
                             "restart vLLM to load the cache again (a weight reload into a live model on a "
                             "GPU is not supported)")
        else:
            raise InputError(f"the model has no fused-MoE parameters under {first}",
                             "the moet loader serves DeepSeek-style MoE models")
    else:
        expand = opts.expand
    device = params[first + ("w13_weight" if expand else "w13_base")].device
    modules = dict(model.named_modules())
    moe_bytes = 0
    for layer in _load_shards(cache, layers, modules, where, opts, device, expand):
        prefix = where.get(layer.index, experts_prefix(layer.index))
        wanted = {n for n in params if n.startswith(prefix) and "." not in n[len(prefix):]}
        for name, t in layer.tensors.items():
            p = params.get(prefix + name)
            if name in _TIER_SHAPED and not expand and (p is None or p.shape != t.shape):
                # the tier decides these shapes: the cache's tensor replaces any placeholder buffer
                modules[prefix[:-1]].register_buffer(name, own_storage(t), persistent=False)
                wanted.discard(prefix + name)
                continue
            if p is None:
                raise InputError(f"the model has no parameter {prefix + name} for the cache's tensor",
                                 "the cache was built for another model (or, over several GPUs, the model does not use "
                         "the moet quantization method, which gives each rank its share)")
            _copy(p.data, t, prefix + name)
            wanted.discard(prefix + name)
        left = sorted(n for n in wanted if n.rsplit(".", 1)[1].startswith(("w13_", "w2_"))
                      and n.rsplit(".", 1)[1] not in _TIER_SHAPED)  # no tier rows (delta="none"): stay empty
        if left:
            raise InputError(f"the cache gives no value for {left[0]}",
                             "the model expects tensors the cache does not hold (e.g. input scales)")
        moe_bytes += layer.nbytes
    dense = 0
    loader = getattr(model, "load_weights", None)

    def counted(it: Any) -> Any:
        nonlocal dense
        for item in it:
            dense += 1
            yield item
    weights = counted(cache.load_dense(device="cpu", verify=VerifyMode.NONE if opts.verify == VerifyMode.BOOT else opts.verify,
                                       workers=opts.workers, max_inflight=opts.max_inflight,
                                       only=dense_filter(model, cache.view.family, [x for x in cache.layers if x in where],
                                                         params.keys())))
    if callable(loader):
        loader(weights)
    else:
        for name, t in weights:
            p = params.get(name)
            if p is None:
                raise InputError(f"the model has no parameter {name} (and no load_weights to map it)")
            _copy(p.data, t.to(p.device), name)
    return LoadSummary(tuple(layers), expand, moe_bytes, dense, time.perf_counter() - t0)


def dense_filter(model: torch.nn.Module, family: Family, held: list[int],
                 own: Collection[str]) -> Callable[[str], bool]:
    """The dense tensors a model reads: its part of the cache (load/dense_select.py: the draft model the
    drafter's, the target the rest, decided by the routed-expert layers it holds) and any tensor named as one
    of its own parameters (`own`; vLLM's V3 MTP model loads a top-level `model.embed_tokens.weight` when it has
    that parameter, vllm/model_executor/models/deepseek_mtp.py), less those its own
    `is_unused_checkpoint_weight` (vLLM's rule for the checkpoint names its load_weights drops) rejects."""
    part = part_of_layers(family, held)
    unused = getattr(model, "is_unused_checkpoint_weight", None)

    def reads(name: str) -> bool:
        return (in_part(part, family, name) or name in own) and not (callable(unused) and unused(name))
    return reads


def _load_shards(cache: Any, served: list[int], modules: dict[str, torch.nn.Module], where: dict[int, str],
                 opts: PluginOptions, device: torch.device, expand: bool) -> Any:
    """Every layer in `served` (the cache's layers this model holds), each read as the share its experts module
    holds (`moet_shard`, set by the moet method under tensor or expert parallelism; none: the whole layer); one
    load for each distinct share."""
    by_shard: dict[Shard, list[int]] = {}
    for x in served:
        module = modules.get(where.get(x, experts_prefix(x))[:-1])
        by_shard.setdefault(getattr(module, "moet_shard", None) or Shard(), []).append(x)
    for shard, layers in by_shard.items():
        yield from cache.load(device=device, delta=opts.delta, verify=opts.verify, workers=opts.workers,
                              max_inflight=opts.max_inflight, expand=expand, layers=layers, shard=shard)


class MoetModelLoader(BaseModelLoader):  # type: ignore[misc]
    """Loads a model's weights from a moet-cache folder instead of the checkpoint."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self.options = PluginOptions.from_extra(load_config.model_loader_extra_config)

    def download_model(self, model_config: Any) -> None:
        open_cache(self.options.cache)  # nothing to download: check the cache early instead

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        load_into_model(model, self.options)


def register() -> type:
    """Register MoetModelLoader as vLLM's `--load-format moet`."""
    return register_model_loader(LOAD_FORMAT)(MoetModelLoader)


__all__ = ["MoetModelLoader", "register", "load_into_model", "PluginOptions", "LoadSummary", "LOAD_FORMAT",
           "experts_prefix", "experts_prefixes", "built_layer_names", "dense_filter", "own_storage"]
