import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moet_cache.source.checkpoint import COMPRESSED_TENSORS, MODELOPT, open_checkpoint
from moet_cache.errors import InputError, UnsupportedCheckpointError


def test_detects_both_layouts(ckpt_modelopt: Path, ckpt_ct: Path) -> None:
    with open_checkpoint(ckpt_modelopt) as a, open_checkpoint(ckpt_ct) as b:
        assert a.layout == MODELOPT and b.layout == COMPRESSED_TENSORS
        assert a.model.main_moe_layers() == [1, 2, 3] and a.model.mtp_layers() == [4]
        a.validate_experts([1, 2, 3, 4])
        b.validate_experts([1, 2, 3, 4])
        # compressed-tensors keeps the reciprocal global scale; the reader converts it
        g = b.read_expert(1, 0, "gate_proj").global_scale
        assert b.multiply_global_scale(g) == pytest.approx(1.0 / float(g.reshape(-1)[0]), rel=1e-6)


def _edit_config(root: Path, **changes: object) -> None:
    cfg = json.loads((root / "config.json").read_text())
    cfg.update(changes)
    (root / "config.json").write_text(json.dumps(cfg))


def test_refuses_other_quantization(src_copy: Path) -> None:
    _edit_config(src_copy, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(UnsupportedCheckpointError, match="'fp8', not NVFP4"):
        open_checkpoint(src_copy)


def test_refuses_modelopt_fp8(src_copy: Path) -> None:
    _edit_config(src_copy, quantization_config={"quant_method": "modelopt", "quant_algo": "FP8"})
    with pytest.raises(UnsupportedCheckpointError, match="quant_algo=FP8"):
        open_checkpoint(src_copy)


def test_refuses_unquantized(src_copy: Path) -> None:
    _edit_config(src_copy, quantization_config=None)
    (src_copy / "hf_quant_config.json").unlink()
    # the tensor names still say ModelOpt NVFP4, so it is detected from them
    assert open_checkpoint(src_copy).layout == MODELOPT


@pytest.mark.parametrize("change,match", [
    ({"n_routed_experts": "many"}, "n_routed_experts must be an integer"),
    ({"hidden_size": 250}, "not a multiple of 16"),
    ({"num_hidden_layers": -1}, "out of range"),
])
def test_malformed_config(src_copy: Path, change: dict, match: str) -> None:
    _edit_config(src_copy, **change)
    with pytest.raises(InputError, match=match):
        open_checkpoint(src_copy)


def test_config_not_json(src_copy: Path) -> None:
    (src_copy / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="config.json is not valid JSON"):
        open_checkpoint(src_copy)


def test_index_names_missing_shard(src_copy: Path) -> None:
    index = json.loads((src_copy / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "model-00009-of-00009.safetensors"
    (src_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InputError, match="names the shard model-00009-of-00009.safetensors, which does not exist"):
        open_checkpoint(src_copy)


def test_index_path_escape_refused(src_copy: Path) -> None:
    index = json.loads((src_copy / "model.safetensors.index.json").read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = "../etc/passwd"
    (src_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InputError, match="invalid shard file"):
        open_checkpoint(src_copy)


def _rewrite_tensor(root: Path, name: str, tensor: torch.Tensor | None) -> None:
    index = json.loads((root / "model.safetensors.index.json").read_text())
    shard = root / index["weight_map"][name]
    tensors = load_file(str(shard))
    if tensor is None:
        del tensors[name]
        del index["weight_map"][name]
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        tensors[name] = tensor
    save_file(tensors, str(shard))


def test_missing_shard_file(src_copy: Path) -> None:
    (src_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(InputError, match="does not exist"):
        open_checkpoint(src_copy)


def test_wrong_dtype_and_shape(src_copy: Path) -> None:
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    _rewrite_tensor(src_copy, name, torch.zeros(128, 128, dtype=torch.bfloat16))
    with pytest.raises(InputError, match=r"experts.3.up_proj.weight \(layer 2, expert 3\) has dtype BF16"):
        open_checkpoint(src_copy).validate_experts([1, 2, 3])
    _rewrite_tensor(src_copy, name, torch.zeros(128, 100, dtype=torch.uint8))
    with pytest.raises(InputError, match=r"has shape \[128, 100\], expected \[128, 128\]"):
        open_checkpoint(src_copy).validate_experts([1, 2, 3])


def test_missing_expert_tensor(src_copy: Path) -> None:
    _rewrite_tensor(src_copy, "model.layers.3.mlp.experts.15.down_proj.weight_scale", None)
    with pytest.raises(InputError, match=r"lacks model.layers.3.mlp.experts.15.down_proj.weight_scale \(layer 3, expert 15\)"):
        open_checkpoint(src_copy).validate_experts([3])


def test_truncated_shard(src_copy: Path) -> None:
    shard = src_copy / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="not a readable safetensors file"):
        open_checkpoint(src_copy)


def test_single_file_checkpoint(tmp_path: Path, ckpt_modelopt: Path) -> None:
    root = tmp_path / "single"
    root.mkdir()
    merged = {}
    for shard in sorted(ckpt_modelopt.glob("*.safetensors")):
        merged.update(load_file(str(shard)))
    save_file(merged, str(root / "model.safetensors"))
    shutil.copy(ckpt_modelopt / "config.json", root / "config.json")
    ck = open_checkpoint(root)
    assert ck.shards == ["model.safetensors"] and len(ck.tensors) == len(merged)
