"""DeepSeek-V4's KV cache as vLLM 0.34 allocates it (moet_cache/plan/kv_v4.py).

The pinned figures were read off vLLM 0.34.0's own planning functions (`get_kv_cache_groups`,
`_get_kv_cache_bytes_per_block`, `_max_memory_usage_bytes_from_groups`) on the same layer specs;
tests/test_kv_v4_vllm.py redoes that comparison whenever vLLM is installed.
"""

from __future__ import annotations

import pytest

from moet_cache.errors import InputError
from moet_cache.plan.kv_v4 import V4Attention, groups, layer_specs, longest_context, v4_kv
from moet_cache.plan import attention_from_config

FLASH = tuple([0, 0] + [4, 128] * 20 + [4])          # V4-Flash: 43 main layers (compress_ratios' first 43)
FLASH_CFG = {"model_type": "deepseek_v4", "num_hidden_layers": 43, "head_dim": 512, "qk_rope_head_dim": 64,
             "sliding_window": 128, "index_head_dim": 128, "index_topk": 512, "num_nextn_predict_layers": 1,
             "compress_ratios": list(FLASH) + [0]}


def test_pages_are_the_records_rounded_to_576_bytes() -> None:
    pages = {s.name.split(" ", 2)[2]: s.page for s in layer_specs(V4Attention(FLASH)) if s.name.startswith(("layer 2 ", "layer 3 "))}
    assert pages["window"] == 37440                   # 64 tokens x 584 = 37376 -> 65 x 576
    assert pages["compressed"] in (37440, 1728)       # ratio 4: 64 x 584 -> 37440; ratio 128: 2 x 584 = 1168 -> 1728
    assert pages["indexer"] == 8640                   # 64 x 132 = 8448 -> 15 x 576
    assert pages["compressor state"] == 32832         # 4 x (2 x 2 x 512 x 4 B) = 32768 -> 57 x 576


def test_v4_flash_at_260k_is_vllms_own_figure() -> None:
    k = v4_kv(V4Attention(FLASH), 260_000, 1, max_num_batched_tokens=8192, async_scheduling=True)
    assert k.groups == 5 and k.bytes_per_block == 1_002_240            # 21 x 37440 + 21 x 8640 + 20 x 1728
    assert k.blocks_per_seq == 7698 and k.window_blocks_per_seq == 6682
    assert k.blocks_per_seq * k.bytes_per_block == 7_715_243_520       # vLLM's max_memory_usage for one request
    assert k.allocated == 7_716_245_760                                 # + the null block
    assert k.raw_per_token == pytest.approx(3850.25)                    # 21 x 716 / 4 + 20 x 584 / 128
    assert k.raw == 1_016_494_176                                       # 0.947 GiB of records at 260,000 tokens
    # The windows are reserved for the tokens in flight: 2 x 2048 instead of 2 x 8192 frees 4.7 GiB.
    small = v4_kv(V4Attention(FLASH), 260_000, 1, 2048, True)
    assert small.blocks_per_seq == 2706 and small.allocated == 2_713_063_680
    assert v4_kv(V4Attention(FLASH), 260_000, 1, 8192, False).blocks_per_seq == 4370
    # The drafter blocks (window only) fill the 22-layer window group's padding: no extra bytes.
    assert v4_kv(V4Attention(FLASH, mtp_layers=3), 260_000, 1, 8192, True, True).allocated == k.allocated
    two = v4_kv(V4Attention(FLASH), 260_000, 2)
    assert two.allocated == (2 * 7698 + 1) * 1_002_240


def test_groups_follow_vllms_repeat_pattern() -> None:
    gs = groups(layer_specs(V4Attention(FLASH)))
    assert sorted((g.bucket, g.page_sum) for g in gs) == [
        ((0, 256), 1_002_240),          # 62 full-attention caches: 21 + 21 ratio-4 pages, 20 ratio-128 pages
        ((8, 4), 21 * 32832 + 21 * 8640),
        ((128, 8), 20 * 32832),
        ((128, 64), 21 * 37440), ((128, 64), 22 * 37440)]   # 43 windows split 22 + 21
    tiny = groups(layer_specs(V4Attention((0, 4, 128))))
    assert len(tiny) == 6                                # repeats of 1: each window its own group (as vLLM)


def test_longest_context_is_the_last_length_that_fits() -> None:
    att = V4Attention(FLASH)
    room = 5 * 2**30
    n = longest_context(att, room, 1, 2048, True)
    assert v4_kv(att, n, 1, 2048, True).allocated <= room < v4_kv(att, n + 1, 1, 2048, True).allocated
    assert longest_context(att, 1000, 1, 2048, True) == 0


def test_attention_from_a_v4_config() -> None:
    att = attention_from_config(FLASH_CFG)
    assert att.kind == "deepseek_v4" and att.v4 is not None and att.v4.compress_ratios == FLASH
    assert att.layers == 43 and att.mtp_layers == 1 and att.kv_dtypes == ("fp8", "fp8_ds_mla")
    # vLLM's other spelling: compress_rates over layer_types (the upstream DeepseekV4Config)
    alt = {k: v for k, v in FLASH_CFG.items() if k != "compress_ratios"}
    alt |= {"layer_types": ["swa" if r == 0 else f"c{r}" for r in FLASH], "compress_rates": {"c4": 4, "c128": 128}}
    assert attention_from_config(alt).v4 == att.v4
    with pytest.raises(InputError, match="compress_ratios"):
        attention_from_config({**FLASH_CFG, "compress_ratios": [0, 3]})
