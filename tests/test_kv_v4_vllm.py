"""Optional: kv_v4's arithmetic against vLLM's own KV planning functions (needs vLLM 0.34 installed).

The probe runs in vLLM's interpreter (MOET_CACHE_VLLM_BIN or `vllm` on PATH, as tests/test_serve_vllm.py),
builds each V4 cache spec the way vLLM 0.34's DeepseekV4Attention, DeepseekV4IndexerCache,
DeepseekV4SWACache and CompressorStateCache build them, and asks vLLM for the groups, the bytes a block
and the bytes one request needs.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import vllm_cpu_env

from moet_cache.plan.kv_v4 import V4Attention, v4_kv
from moet_cache.serve import vllm_python

pytestmark = pytest.mark.vllm

PROBE = r'''
import json, sys, torch
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec, get_kv_quant_mode
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.core import kv_cache_planning as P
from types import SimpleNamespace as NS
q = get_kv_quant_mode("fp8_ds_mla")
out = []
for ratios, mtp, L, batched, inflight in json.loads(sys.stdin.read()):
    s = {}
    for i, r in enumerate(ratios + [1] * mtp):
        r = max(1, r); p = f"l{i}"
        s[p + "swa"] = SlidingWindowMLASpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=512,
            dtype=torch.uint8, sliding_window=128, cache_dtype_str="fp8_ds_mla", state_content_bytes=584,
            alignment=576, model_version="deepseek_v4", kv_quant_mode=q)
        if r > 1:
            s[p] = MLAAttentionSpec(block_size=256, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8,
                tokens_per_state=r, cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4",
                kv_quant_mode=q, state_content_bytes=584)
            c = 1 + (r == 4)
            s[p + "st"] = SlidingWindowMLASpec(block_size=4 if r == 4 else 8, num_kv_heads=1, max_tp_shards=1,
                head_size=2 * c * 512, dtype=torch.float32, sliding_window=c * r, alignment=576)
        if r == 4:
            s[p + "ix"] = MLAAttentionSpec(block_size=256, num_kv_heads=1, max_tp_shards=1, head_size=132,
                dtype=torch.uint8, tokens_per_state=4, alignment=576)
            s[p + "ixst"] = SlidingWindowMLASpec(block_size=4, num_kv_heads=1, max_tp_shards=1, head_size=512,
                dtype=torch.float32, sliding_window=8, alignment=576)
    layout = KVCacheLayout.BLHNC
    cc = NS(block_size=256, cache_dtype="fp8_ds_mla", num_gpu_blocks_override=None, prefix_cache_retention_interval=None,
            get_resolved_kv_cache_layout=lambda: layout, enable_extensible_kv_cache=False, mamba_cache_mode="none")
    vc = NS(model_config=NS(max_model_len=L, original_max_model_len=L), cache_config=cc,
            parallel_config=NS(decode_context_parallel_size=1, prefill_context_parallel_size=1, tensor_parallel_size=1),
            scheduler_config=NS(max_num_batched_tokens=batched, disable_hybrid_kv_cache_manager=False),
            attention_config=NS(hisparse_config=None), max_in_flight_tokens=inflight, speculative_config=None)
    g = P.get_kv_cache_groups(vc, s)
    out.append([len(g), P._get_kv_cache_bytes_per_block(g, layout),
                P._max_memory_usage_bytes_from_groups(P.DefaultKVCacheConfigBuilder(), vc, g)])
print("MOET_KV " + json.dumps(out))
'''


def _python() -> str:
    return vllm_python(vllm_cpu_env.vllm034_exe())


def test_kv_v4_matches_vllms_planning() -> None:
    flash = [0, 0] + [4, 128] * 20 + [4]
    cases = [(r, mtp, L, b, asy) for r in (flash, [0, 4, 128], [0, 0, 128, 128], [4, 4, 4], [128] * 5)
             for mtp in (0, 1, 3) for L in (1, 4096, 260_000, 1_048_576) for b, asy in ((8192, True), (2048, False))]
    doc = json.dumps([[r, mtp, L, b, b * (2 if asy else 1)] for r, mtp, L, b, asy in cases])
    env = dict(os.environ, VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cpu"))
    p = subprocess.run([_python(), "-c", PROBE], input=doc, capture_output=True, text=True, timeout=600, env=env)
    line = next((x for x in p.stdout.splitlines() if x.startswith("MOET_KV ")), None)
    assert line is not None, p.stderr[-2000:]
    for (r, mtp, L, b, asy), (n, bpb, need) in zip(cases, json.loads(line[len("MOET_KV "):])):
        k = v4_kv(V4Attention(tuple(r), mtp_layers=mtp), L, 1, b, asy, with_mtp=bool(mtp))
        assert (k.groups, k.bytes_per_block, k.blocks_per_seq * k.bytes_per_block) == (n, bpb, need), (r, mtp, L, b)
