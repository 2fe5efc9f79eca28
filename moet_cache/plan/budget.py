"""The VRAM budget of serving a cache on one GPU (or the fullest of several, parallel.py): what it holds, what
is left for the KV cache, what fits, and the nearest changes that fit when it does not.

Every figure is in bytes here and printed in GiB (2^30). The weights come from the footprint (measure.py), the
KV term from the model's attention dims (kv.py, docs/SERVING.md). The CUDA-graph and activation reserves are
documented estimates (settings.py); the user can override both.
"""

from __future__ import annotations

import os
from dataclasses import replace

from .drafter_vram import DrafterLayout, draft_layers, drafter_need
from ..errors import InputError
from .kv_v4 import BLOCK_SIZE_V4, KV_DTYPES_V4, v4_kv
from .parallel import Parallel, allowed_sizes
from .parallel import check as check_parallel
from ..units import GIB
from .attention import SPARSE_ONLY, AttentionKind, attention_refusal, kv_bytes_per_token_layer
from .footprint import Footprint, rank_footprint
from .gpus import GPU_PRESETS
from .kv import KvTerm, max_position_embeddings, round_up
from .measure import read_footprint
from .record import CACHE, CARD, GPUS, Plan, Suggestion, thin_margin
from .settings import COMM_RESERVE, CUDAGRAPH_PER_SIZE, PlanSettings, Speculative, activation_reserve, cudagraph_reserve


def make_plan(fp: Footprint, s: PlanSettings, advise: bool = True) -> Plan:
    """The whole budget: terms, verdict, which term decides, what the free bytes buy or what would fit
    (`advise` False: no suggestions, for planning a suggestion's own settings)."""
    s.check()
    check_parallel(fp.model, s.parallel)
    fp = rank_footprint(fp, s.parallel)
    notes: list[str] = []
    att = fp.attention
    if s.parallel.expert and fp.tier_layers is None and fp.tier_experts:
        notes.append("expert parallel: which experts the tier holds is chosen at build, so the fullest rank is "
                     "counted with as many tier experts as could land on it; plan the built cache for the exact figure")
    spec = s.speculative != Speculative.NONE
    layout = fp.drafter.layout if fp.drafter is not None else DrafterLayout.MTP
    if spec and not fp.mtp_bytes:
        raise InputError(f"--speculative {s.speculative}: this model has no drafter (no mtp.* blocks, "
                         "num_nextn_predict_layers is 0)", "use --speculative none")
    if spec and s.speculative != layout:
        raise InputError(f"--speculative {s.speculative}: this model's drafter is {layout} "
                         f"({'the DSpark head stack' if layout == DrafterLayout.DSPARK else 'no DSpark head stack'} "
                         "in its mtp.* tensors)", f"use --speculative {layout}")
    layers = att.layers or fp.served_layers
    mtp_layers = draft_layers(layout, fp.model) if fp.mtp_bytes else 0
    kv_layers = layers + (mtp_layers if spec else 0)
    v4 = att.v4 if s.kv_bytes_per_token is None else None
    if s.kv_bytes_per_token is not None:
        per_layer = s.kv_bytes_per_token
        notes.append(f"KV: {per_layer} B per token per layer as given (--kv-bytes-per-token)")
    elif v4 is not None:
        per_layer = 0
        if s.kv_cache_dtype not in KV_DTYPES_V4:
            raise InputError(f"DeepSeek-V4 runs only with FP8 KV in vLLM 0.34, not --kv-cache-dtype {s.kv_cache_dtype}",
                             "use --kv-cache-dtype fp8_ds_mla (vLLM turns fp8 into it)")
        if s.block_size != BLOCK_SIZE_V4:
            raise InputError(f"DeepSeek-V4's attention in vLLM 0.34 takes only --block-size {BLOCK_SIZE_V4}, "
                             f"not {s.block_size}")
    else:
        per_layer = kv_bytes_per_token_layer(att, s.kv_cache_dtype)
        if att.note:
            notes.append(att.note)
        if s.kv_cache_dtype in SPARSE_ONLY and not att.index_head_dim:
            notes.append(f"{s.kv_cache_dtype} runs only on vLLM's sparse-MLA backends (DeepSeek V3.2 and later); "
                         "this config has no sparse indexer, so vLLM may refuse it")
    mpe = max_position_embeddings(fp.model)
    past_positions = mpe is not None and mpe < s.max_model_len   # vLLM refuses it: no memory makes it fit
    if past_positions:
        notes.append(f"--max-model-len {s.max_model_len} exceeds the model's max_position_embeddings {mpe}: "
                     "vLLM refuses it unless the rope scaling allows it (or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)")
    kvm = KvTerm(fp, s, per_layer, kv_layers, spec, mtp_layers)
    v4f = kvm.v4_figures(s.max_num_seqs, s.max_model_len) if v4 is not None else None
    seq_tokens = s.max_model_len if v4 is not None else round_up(s.max_model_len, s.block_size)
    kv_tokens = seq_tokens * s.max_num_seqs
    kv = kvm.bytes(s.max_num_seqs, s.max_model_len)
    budget = int(s.gpu.total_bytes * s.utilization)
    graphs = s.cudagraph_reserve if s.cudagraph_reserve is not None else cudagraph_reserve(len(s.cudagraph_sizes))
    acts = s.activation_reserve if s.activation_reserve is not None else \
        activation_reserve(fp.model, s.batched_tokens)
    drafter = None
    if fp.drafter is not None and v4 is not None:
        args = (replace(v4, mtp_layers=mtp_layers), s.max_model_len, s.max_num_seqs, s.batched_tokens,
                s.async_scheduling)
        drafter = drafter_need(fp.drafter, fp.model, s.batched_tokens, s.cudagraph_sizes, acts,
                               0 if s.cudagraph_reserve is not None else CUDAGRAPH_PER_SIZE,
                               v4_kv(*args, True).allocated - v4_kv(*args).allocated)
    mtp_w = (drafter.weights + drafter.copies if drafter is not None else fp.mtp_bytes) if spec else 0
    reserves = drafter.buffers + drafter.workspace + drafter.graphs if spec and drafter is not None else 0
    if spec and not fp.mtp_exact:
        notes.append("the MTP layer's weights are an estimate (the cache holds no MTP planes)")
    elif spec and fp.drafter is not None and not fp.drafter.planed:
        notes.append("the cache holds the drafter's tensors but no planes for its routed experts: the moet method "
                     "cannot serve it; build the cache with --include-drafter")
    comm = COMM_RESERVE if s.parallel.size > 1 else 0
    static = fp.base_bytes + fp.delta_tier_bytes + fp.dense_bytes + mtp_w + reserves + graphs + acts + comm
    need = static + kv
    margin = budget - need
    kv_room = budget - static
    refused = attention_refusal(att, s.gpu)
    fits = margin >= 0 and not past_positions and refused is None
    if refused is not None:
        deciding = refused
    elif past_positions:
        deciding = (f"context: --max-model-len {s.max_model_len:,} is past the model's {mpe:,} positions "
                    "(max_position_embeddings)")
    elif static > budget:
        terms = {"base planes": fp.base_bytes, "dense weights": fp.dense_bytes, "delta tier": fp.delta_tier_bytes,
                 "drafter weights": mtp_w, "drafter reserves": reserves, "CUDA-graph reserve": graphs,
                 "activation reserve": acts, "communication reserve": comm}
        top = max(terms, key=terms.__getitem__)
        alone = " (it alone exceeds the budget)" if terms[top] > budget else ""
        deciding = (f"weights and reserves exceed the budget before any KV: the largest term is {top}, "
                    f"{terms[top] / GIB:.3f} GiB{alone}")
    elif not fits and drafter is not None and spec and margin + drafter.total >= 0:
        deciding = (f"the {layout} drafter: {drafter.total / GIB:.3f} GiB with its KV; without it the rest fits "
                    f"with {(margin + drafter.total) / GIB:.3f} GiB to spare")
    elif not fits:
        deciding = "KV cache: the weights fit, the KV cache for these settings does not"
    else:
        deciding = "KV cache: the headroom is what the KV cache leaves"
    room = max(0, kv_room)
    max_per_layer = room // (kv_tokens * kv_layers) if v4 is None and kv_tokens and kv_layers else 0
    longest = kvm.longest(room, s.max_num_seqs)
    limit = min(longest, mpe) if mpe is not None else longest
    extra_seqs = max(0, kvm.most_seqs(room) - s.max_num_seqs) if fits else 0
    extra_experts = min(max(0, margin) // fp.expert_delta_bytes if fp.expert_delta_bytes else 0,
                        fp.total_experts - fp.tier_experts)
    # a mid tier is served on one GPU only (load/plan.py): more of it is offered there, where the cache has one
    # (a --delta-budget planned over the built tier can leave fewer experts outside it than the mid tier holds)
    extra_mid = max(0, min(max(0, margin) // fp.expert_mid_bytes,
                           fp.total_experts - fp.tier_experts - fp.mid_experts)) \
        if fp.mid_experts and fp.expert_mid_bytes and s.parallel.size == 1 else 0
    if not fp.mtp_bytes:
        mtp_need = 0
    elif drafter is not None:
        mtp_need = drafter.total
    elif v4 is not None:  # the drafter's attention is a sliding window only (compress ratio 1 in vLLM)
        args = (replace(v4, mtp_layers=mtp_layers), s.max_model_len, s.max_num_seqs, s.batched_tokens,
                s.async_scheduling)
        mtp_need = fp.mtp_bytes + v4_kv(*args, True).allocated - v4_kv(*args).allocated
    else:
        mtp_need = fp.mtp_bytes + mtp_layers * per_layer * kv_tokens
    mtp_fits = bool(fp.mtp_bytes) and not past_positions and (fits if spec else margin >= mtp_need)
    thin = fits and margin < thin_margin(budget)
    if fits or not advise:
        suggestions: tuple[Suggestion, ...] = ()
    elif refused is not None:
        suggestions = _cards_it_runs_on(fp, s)
    elif past_positions:
        suggestions = _within_positions(fp, s, kvm, budget, static, acts, mpe)
    else:
        suggestions = _suggestions(fp, s, kvm, budget, static, acts, mpe)
    return Plan(fp, s, budget, fp.base_bytes, fp.delta_tier_bytes, fp.dense_bytes, mtp_w, graphs, acts,
                per_layer, kv_layers, kv_tokens, kv, static, need, fits, margin, deciding, kv_room,
                max_per_layer, longest, extra_seqs, extra_experts, mtp_need, mtp_fits, suggestions,
                tuple(notes), v4f.raw if v4f is not None else kv, v4f, thin, limit, comm, drafter, reserves,
                extra_mid)


def _cards_it_runs_on(fp: Footprint, s: PlanSettings) -> tuple[Suggestion, ...]:
    """The smallest preset card the attention runs on that fits the same settings, GPU for GPU."""
    whole = fp.whole or fp
    for g in sorted(GPU_PRESETS.values(), key=lambda g: g.total_bytes):
        if attention_refusal(fp.attention, g) is None:
            p = make_plan(whole, replace(s, gpu=g))
            if p.fits:
                each = f", {s.parallel.size} of them" if s.parallel.size > 1 else ""
                return (Suggestion("gpu", f"--gpu {g.name} ({g.note}{each})", p.margin, CARD),)
    return ()


def _within_positions(fp: Footprint, s: PlanSettings, kvm: KvTerm, budget: int, static: int, acts: int,
                      mpe: int) -> tuple[Suggestion, ...]:
    """A context past the model's positions: the longest context within them that fits, else the changes that
    make the model's whole context fit, each with that --max-model-len."""
    within = replace(s, max_model_len=mpe)
    kvm_within = replace(kvm, s=within)
    left = budget - static - kvm_within.bytes(s.max_num_seqs, mpe)
    if left >= 0:
        return (Suggestion("context", f"--max-model-len {mpe}", left),)
    out = []
    for x in _suggestions(fp, within, kvm_within, budget, static, acts, mpe):
        if "--max-model-len" in x.setting:
            out.append(x)
        elif x.where == CARD:
            out.append(replace(x, setting=f"{x.setting}, with --max-model-len {mpe}"))
        else:
            out.append(replace(x, setting=f"{x.setting} --max-model-len {mpe}"))
    return tuple(out)


def _suggestions(fp: Footprint, s: PlanSettings, kvm: KvTerm, budget: int, static: int, acts: int,
                 mpe: int | None) -> tuple[Suggestion, ...]:
    """The nearest single changes that fit, each with the margin it leaves. Only changes vLLM and the model
    accept: no context beyond max_position_embeddings, no KV dtype the attention cannot use; a tier change is
    a change to the cache (`where` CACHE), never offered as a serve flag."""
    out: list[Suggestion] = []
    room = budget - static
    n, L = s.max_num_seqs, s.max_model_len

    def context(room_: int) -> int:
        longest = kvm.longest(room_, n)
        return min(longest, mpe) if mpe is not None else longest

    if room > 0:
        longest = context(room)
        if longest >= min(s.block_size, L):
            out.append(Suggestion("context", f"--max-model-len {longest}", room - kvm.bytes(n, longest)))
        if n > 1:
            most = kvm.most_seqs(room)
            if most >= 1:
                out.append(Suggestion("sequences", f"--max-num-seqs {most}", room - kvm.bytes(most, L)))
        if kvm.v4 is not None:  # V4's windows are reserved for the tokens in flight: fewer batched tokens help
            for b in (4096, 2048, 1024, 512):
                if b >= s.batched_tokens:
                    continue
                m = make_plan(fp.whole or fp, replace(s, batched_tokens=b), advise=False).margin  # every term that scales with b
                if m >= 0:
                    out.append(Suggestion("batched-tokens", f"--max-num-batched-tokens {b}", m))
                    break
    if s.speculative != Speculative.NONE:
        m = make_plan(fp.whole or fp, replace(s, speculative=Speculative.NONE), advise=False).margin
        if m >= 0:
            out.append(Suggestion("no-drafter", "--no-speculative", m))
    kv = kvm.bytes(n, L)
    short = static + kv - budget
    # Expert parallelism: which rank a tier expert lands on depends on the build's choice, so no smaller tier
    # is named (base-only is); tensor parallelism: a rank holds 1/N of each tier expert, the cache all of it.
    whole_edb = (fp.whole or fp).expert_delta_bytes
    has_mid = fp.mid_experts > 0   # retier drops a mid tier: the advice is a build
    if fp.delta_tier_bytes and short <= fp.delta_tier_bytes:
        keep = (fp.delta_tier_bytes - short) // fp.expert_delta_bytes * fp.expert_delta_bytes
        if keep > 0 and not s.parallel.expert:
            experts = keep // fp.expert_delta_bytes
            # Exact bytes: a rounded GiB figure could round up past what fits.
            out.append(Suggestion("tier", f"--delta-budget {experts * whole_edb} ({experts} experts, "
                                          f"{experts * whole_edb / GIB:.3f} GiB)",
                                  budget - (static - fp.delta_tier_bytes + keep + kv), CACHE, experts, has_mid))
        out.append(Suggestion("base-only", "--delta-budget 0", budget - (static - fp.delta_tier_bytes + kv), CACHE, 0,
                              has_mid))
    elif fp.delta_tier_bytes:  # dropping the tier is not enough alone: base-only and a shorter context
        room0 = room + fp.delta_tier_bytes
        longest = context(room0)
        if longest >= min(s.block_size, L):
            out.append(Suggestion("base-only+context", f"--delta-budget 0 --max-model-len {longest}",
                                  room0 - kvm.bytes(n, longest), CACHE, 0, has_mid))
    if s.kv_bytes_per_token is None and fp.attention.kind == AttentionKind.MLA:
        for dtype in ("fp8_ds_mla", "fp8"):
            if dtype not in fp.attention.kv_dtypes:
                continue
            p = kv_bytes_per_token_layer(fp.attention, dtype)
            if p < kvm.per_layer:
                m = budget - (static + round_up(L, s.block_size) * n * p * kvm.kv_layers)
                if m >= 0:
                    out.append(Suggestion("kv-cache-dtype", f"--kv-cache-dtype {dtype}", m))
                    break
    if not out:
        out.append(Suggestion("gpu", f"a card with {short / GIB:.2f} GiB more usable memory", 0, CARD))
        need = static + kv
        for g in sorted(GPU_PRESETS.values(), key=lambda g: g.total_bytes):
            m = int(g.total_bytes * s.utilization) - need
            if m >= 0 and g.total_bytes > s.gpu.total_bytes and attention_refusal(fp.attention, g) is None:
                out.append(Suggestion("gpu", f"--gpu {g.name} ({g.note})", m, CARD))
                break
    more = _more_gpus(fp, s)
    return tuple(out) + ((more,) if more is not None else ())


def _more_gpus(fp: Footprint, s: PlanSettings) -> Suggestion | None:
    """The fewest more GPUs of the same card that make the same settings fit (a size the model allows)."""
    whole = fp.whole or fp
    if not whole.model.get("n_routed_experts"):   # a footprint without the model's dims: no split to check
        return None
    for n in allowed_sizes(whole.model, s.parallel.expert):
        if n <= s.parallel.size:
            continue
        p = make_plan(whole, replace(s, parallel=Parallel(n, s.parallel.expert)))
        if p.fits:
            more = n - s.parallel.size
            return Suggestion("gpus", f"{' '.join(p.settings.parallel.flags())} ({more} more GPU"
                                      f"{'s' if more > 1 else ''}, {n} in all)", p.margin, GPUS)
    return None


def plan_for(path: str | os.PathLike[str], settings: PlanSettings, delta_budget: str | None = None) -> Plan:
    """Read a cache or checkpoint and plan it (the library entry point of `moet-cache plan`)."""
    return make_plan(read_footprint(path, delta_budget), settings)
