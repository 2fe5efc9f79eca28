"""A header-only, sparse, full-size DeepSeek-V4-Flash checkpoint: the real tensor names, dtypes and shapes.

Every shard is a real safetensors file whose header lists the tensors of the released checkpoint
(DEEPSEEK_V4.md's names; shapes from the config below, the layout of vLLM 0.34's and NeMo AutoModel's V4
loaders); the data region is a hole made by truncate, so ~150 GB of checkpoint costs a few MiB of disk.
Reading a tensor's bytes gives zeros, except the NVFP4 block scales: the -0731 release is a lossless cast
of MXFP4, every e4m3 scale a power of two equal in pairs, which the build stores compact (e8m0). All of a
shard's NVFP4 expert scales share one real 512 KiB region of 1.0s (safetensors allows a shared range), so
plan reads them as the release's. The fixture is for what headers and scales decide (plan, inspect of a
checkpoint), not for builds.

variant "mxfp4": the official release (MXFP4 routed experts, FP8 attention and shared experts with e8m0
  scales, one drafter block mtp.0);
variant "hybrid": the -0731-NVFP4 release (NVFP4 main-layer experts in the ModelOpt layout, MXFP4 drafter
  experts, three drafter blocks): the DSpark drafter, its head stack named and shaped as vLLM 0.34's
  `vllm/models/deepseek_v4/nvidia/dspark.py` builds it (`main_proj`/`main_norm` on mtp.0, the context
  combiner; `norm`, `hc_head_*`, `markov_head`, `confidence_head` on the last block). Its DSpark config
  values (DSPARK) are this fixture's: vLLM 0.34 reads them from the checkpoint and ships none for V4.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterator

from moet_cache.stwriter import TensorSpec, header_bytes

FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "hidden_size": 4096, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "num_hidden_layers": 43, "num_hash_layers": 3, "num_nextn_predict_layers": 1,
    "vocab_size": 129280, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8, "sliding_window": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "expert_dtype": "fp4",
}
RATIOS = [0, 0] + [4, 128] * 20 + [4]
# The DSpark drafter's config keys (DSparkDeepseekV4Model, DSparkSpeculatorConfig): three target layers feed
# main_proj, a rank-256 Markov head, 4 tokens drafted a step, three draft layers.
DSPARK = {"dspark_target_layer_ids": [2, 22, 42], "dspark_markov_rank": 256, "dspark_block_size": 4,
          "n_mtp_layers": 3, "enable_confidence_head": True}


def _fp8(name: str, out: int, inp: int) -> list[TensorSpec]:
    """An FP8 linear with one e8m0 scale per 128 x 128 block (the official release's attention and shared experts)."""
    return [TensorSpec(f"{name}.weight", "F8_E4M3", (out, inp)),
            TensorSpec(f"{name}.scale", "F8_E8M0", (-(-out // 128), -(-inp // 128)))]


def _expert(p: str, out: int, inp: int, fmt: str) -> list[TensorSpec]:
    if fmt == "mxfp4":
        return [TensorSpec(f"{p}.weight", "I8", (out, inp // 2)), TensorSpec(f"{p}.scale", "F8_E8M0", (out, inp // 32))]
    return [TensorSpec(f"{p}.weight", "U8", (out, inp // 2)), TensorSpec(f"{p}.weight_scale", "F8_E4M3", (out, inp // 16)),
            TensorSpec(f"{p}.weight_scale_2", "F32", ()), TensorSpec(f"{p}.input_scale", "F32", ())]


def _block(c: dict, p: str, idx: int, ratio: int, fmt: str) -> list[TensorSpec]:
    H, hc, hd, nh, q, o, g = (c["hidden_size"], c["hc_mult"], c["head_dim"], c["num_attention_heads"],
                              c["q_lora_rank"], c["o_lora_rank"], c["o_groups"])
    mix = (2 + hc) * hc
    t = [TensorSpec(f"{p}.attn_norm.weight", "BF16", (H,)), TensorSpec(f"{p}.ffn_norm.weight", "BF16", (H,))]
    for part in ("attn", "ffn"):
        t += [TensorSpec(f"{p}.hc_{part}_fn", "F32", (mix, hc * H)), TensorSpec(f"{p}.hc_{part}_base", "F32", (mix,)),
              TensorSpec(f"{p}.hc_{part}_scale", "F32", (3,))]
    a = f"{p}.attn"
    t += _fp8(f"{a}.wq_a", q, H) + _fp8(f"{a}.wq_b", nh * hd, q) + _fp8(f"{a}.wkv", hd, H)
    t += _fp8(f"{a}.wo_a", g * o, nh * hd // g) + _fp8(f"{a}.wo_b", H, g * o)
    t += [TensorSpec(f"{a}.q_norm.weight", "BF16", (q,)), TensorSpec(f"{a}.kv_norm.weight", "BF16", (hd,)),
          TensorSpec(f"{a}.attn_sink", "F32", (nh,))]

    def compressor(name: str, r: int, dim: int) -> list[TensorSpec]:
        coff = 2 if r == 4 else 1
        return [TensorSpec(f"{name}.ape", "F32", (r, coff * dim)), TensorSpec(f"{name}.wkv.weight", "BF16", (coff * dim, H)),
                TensorSpec(f"{name}.wgate.weight", "BF16", (coff * dim, H)), TensorSpec(f"{name}.norm.weight", "BF16", (dim,))]
    if ratio:
        t += compressor(f"{a}.compressor", ratio, hd)
    if ratio == 4:
        ix = f"{a}.indexer"
        t += _fp8(f"{ix}.wq_b", c["index_n_heads"] * c["index_head_dim"], q)
        t += [TensorSpec(f"{ix}.weights_proj.weight", "BF16", (c["index_n_heads"], H))]
        t += compressor(f"{ix}.compressor", 4, c["index_head_dim"])
    E, I = c["n_routed_experts"], c["moe_intermediate_size"]
    t += [TensorSpec(f"{p}.ffn.gate.weight", "BF16", (E, H))]
    t += [TensorSpec(f"{p}.ffn.gate.tid2eid", "I32", (c["vocab_size"], c["num_experts_per_tok"]))
          if idx < c["num_hash_layers"] else TensorSpec(f"{p}.ffn.gate.bias", "F32", (E,))]
    s = f"{p}.ffn.shared_experts"
    t += _fp8(f"{s}.w1", I, H) + _fp8(f"{s}.w3", I, H) + _fp8(f"{s}.w2", H, I)
    for e in range(E):
        for w, (out, inp) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            t += _expert(f"{p}.ffn.experts.{e}.{w}", out, inp, fmt)
    return t


def _hc_head(p: str, H: int, hc: int) -> list[TensorSpec]:
    return [TensorSpec(f"{p}.hc_head_fn", "F32", (hc, hc * H)), TensorSpec(f"{p}.hc_head_base", "F32", (hc,)),
            TensorSpec(f"{p}.hc_head_scale", "F32", (1,))]


def _dspark_head(c: dict, k: int, blocks: int) -> list[TensorSpec]:
    """DSpark's head stack: the context combiner on mtp.0, the heads on the last block (_remap_dspark_name)."""
    H, hc, r, p = c["hidden_size"], c["hc_mult"], c["dspark_markov_rank"], f"mtp.{k}"
    t = []
    if k == 0:
        t += _fp8(f"{p}.main_proj", H, H * len(c["dspark_target_layer_ids"]))
        t += [TensorSpec(f"{p}.main_norm.weight", "BF16", (H,))]
    if k == blocks - 1:
        t += [TensorSpec(f"{p}.norm.weight", "BF16", (H,))] + _hc_head(p, H, hc)
        t += [TensorSpec(f"{p}.markov_head.markov_w1.weight", "BF16", (c["vocab_size"], r)),
              TensorSpec(f"{p}.markov_head.markov_w2.weight", "BF16", (c["vocab_size"], r)),
              TensorSpec(f"{p}.confidence_head.proj.weight", "F32", (1, H + r))]
    return t


def shards(c: dict, main_fmt: str, mtp_blocks: int) -> Iterator[list[TensorSpec]]:
    """One shard a block (a layer's ~3.3 GiB), the embeddings and head in the first and last."""
    H, hc = c["hidden_size"], c["hc_mult"]
    yield [TensorSpec("embed.weight", "BF16", (c["vocab_size"], H))]
    for i in range(c["num_hidden_layers"]):
        yield _block(c, f"layers.{i}", i, RATIOS[i], main_fmt)
    for k in range(mtp_blocks):
        p = f"mtp.{k}"
        if "dspark_markov_rank" in c:
            head = _dspark_head(c, k, mtp_blocks)
        else:  # the MTP block: its own embedding and hidden projections, norms and hc head
            head = _fp8(f"{p}.e_proj", H, H) + _fp8(f"{p}.h_proj", H, H)
            head += [TensorSpec(f"{p}.{n}.weight", "BF16", (H,)) for n in ("enorm", "hnorm", "norm")]
            head += _hc_head(p, H, hc)
        yield head + _block(c, p, c["num_hidden_layers"] + k, 0, "mxfp4")
    yield [TensorSpec("norm.weight", "BF16", (H,)), TensorSpec("head.weight", "BF16", (c["vocab_size"], H)),
           TensorSpec("hc_head_fn", "F32", (hc, hc * H)), TensorSpec("hc_head_base", "F32", (hc,)),
           TensorSpec("hc_head_scale", "F32", (1,))]


NVFP4_SCALE = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight_scale$")
E4M3_ONE = 0x38     # 1.0 in e4m3: a power of two


def _write_shard(path: Path, specs: list[TensorSpec]) -> int:
    """A shard whose data region is a hole, but for one shared region holding its NVFP4 expert scales (1.0s)."""
    scales = [s for s in specs if NVFP4_SCALE.search(s.name)]
    rest = [s for s in specs if not NVFP4_SCALE.search(s.name)]
    head, _ = header_bytes(rest, {"format": "pt"})
    data = sum(s.nbytes for s in rest)
    shared = max((s.nbytes for s in scales), default=0)
    if scales:
        header = json.loads(head[8:])
        header.update({s.name: {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [data, data + s.nbytes]}
                       for s in scales})
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(len(raw) + 8) % 8)
        head = len(raw).to_bytes(8, "little") + raw
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + data)              # the data region is a hole: no disk
        f.seek(len(head) + data)
        f.write(bytes([E4M3_ONE]) * shared)
    return data + shared


def write_v4_flash(path: str | os.PathLike[str], variant: str = "mxfp4") -> Path:
    """Write the header-only checkpoint at `path` (config.json, index, shards with sparse data regions)."""
    main_fmt, mtp_blocks = {"mxfp4": ("mxfp4", 1), "hybrid": ("modelopt", 3)}[variant]
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    cfg = dict(FLASH, compress_ratios=RATIOS + [0] * mtp_blocks)
    if main_fmt == "mxfp4":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                      "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    else:
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                      "ignore": ["head", "embed", "*attn*", "*ffn.gate", "*shared_experts*", "mtp.*"]}
        cfg.update(DSPARK)
    all_shards = list(shards(cfg, main_fmt, mtp_blocks))
    weight_map: dict[str, str] = {}
    total = 0
    for n, specs in enumerate(all_shards, 1):
        name = f"model-{n:05d}-of-{len(all_shards):05d}.safetensors"
        total += _write_shard(root / name, specs)
        weight_map.update({s.name: name for s in specs})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    return root
