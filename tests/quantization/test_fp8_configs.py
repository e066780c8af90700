"""Parsing `quantization_config` of FP8 checkpoints (fp8 and compressed-tensors layouts),
ignore lists, and the errors for schemes we do not run."""
from __future__ import annotations

import pytest

from tests.config import model_configs
from vllm.model_executor.layers.quantization import (
    get_quantization_config,
    get_quantization_config_class,
)
from vllm.model_executor.layers.quantization.compressed_tensors import CompressedTensorsConfig
from vllm.model_executor.layers.quantization.fp8 import Fp8Config


def ct(weights: dict, acts: dict | None, ignore=None) -> dict:
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", **weights}}
    if acts is not None:
        group["input_activations"] = {"num_bits": 8, "type": "float", **acts}
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": group},
            "ignore": ignore or []}


def test_fp8_layout():
    static = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "static"})
    assert static.activation_quant() == (True, None) and static.has_static_activation_scales
    dynamic = Fp8Config.from_config({"quant_method": "fp8"})
    assert dynamic.activation_quant() == (False, None)
    block = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128],
                                   "modules_to_not_convert": ["lm_head"]})
    assert block.activation_quant() == (False, 128) and block.ignore == ["lm_head"]
    with pytest.raises(ValueError, match="activation_scheme"):
        Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "int8"})
    with pytest.raises(ValueError, match="need activation_scheme 'dynamic'"):
        Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "static",
                               "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="two positive integers"):
        Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128]})


@pytest.mark.parametrize("weights,acts,expected", [
    ({"strategy": "tensor"}, {"strategy": "tensor", "dynamic": False}, ("tensor", True, None)),
    ({"strategy": "channel"}, {"strategy": "token", "dynamic": True}, ("channel", False, None)),
    ({"strategy": "block", "block_structure": [128, 128]},
     {"strategy": "group", "group_size": 128, "dynamic": True}, ("block", False, 128)),
    ({"strategy": "channel"}, None, ("channel", False, None)),  # weight-only: dynamic tokens
    ({"strategy": "block", "block_structure": [64, 64]}, None, ("block", False, 64)),
])
def test_compressed_tensors_layout(weights, acts, expected):
    config = CompressedTensorsConfig.from_config(ct(weights, acts))
    strategy, static, group = expected
    assert config.weight_strategy == strategy
    assert config.activation_quant() == (static, group)
    assert config.is_fp8


@pytest.mark.parametrize("bad,match", [
    (ct({"strategy": "tensor", "num_bits": 4, "type": "int"}, None), "not FP8"),
    (ct({"strategy": "tensor"}, {"strategy": "token", "dynamic": False}), "per-tensor"),
    (ct({"strategy": "tensor", "symmetric": False}, None), "asymmetric"),
    (ct({"strategy": "group"}, None), "not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "config groups"),
])
def test_compressed_tensors_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        CompressedTensorsConfig.from_config(bad)


def test_ignore_lists_and_packed_layers():
    config = Fp8Config("dynamic", ignore=["lm_head", "model.layers.0.mlp.down_proj",
                                          "re:.*layers\\.1\\.self_attn\\.[qkv]_proj"])
    assert config.is_layer_skipped("lm_head")
    assert config.is_layer_skipped("model.layers.0.mlp.down_proj")
    assert not config.is_layer_skipped("model.layers.1.mlp.down_proj")
    # qkv_proj packs q/k/v: skipped when every part is ignored.
    assert config.is_layer_skipped("model.layers.1.self_attn.qkv_proj")
    assert not config.is_layer_skipped("model.layers.0.self_attn.qkv_proj")
    # Routers stay unquantized.
    assert config.is_layer_skipped("model.layers.0.block_sparse_moe.gate")
    partial = Fp8Config("dynamic", ignore=["model.layers.0.mlp.gate_proj"])
    with pytest.raises(ValueError, match="only some parts"):
        partial.is_layer_skipped("model.layers.0.mlp.gate_up_proj")


def test_model_config_integration():
    model_config = model_configs.fp8("static")
    quant = get_quantization_config(model_config)
    assert isinstance(quant, Fp8Config) and quant is get_quantization_config(model_config)
    assert get_quantization_config(model_configs.dense()) is None
    ct_config = get_quantization_config(model_configs.compressed_tensors_fp8(dynamic=False))
    assert isinstance(ct_config, CompressedTensorsConfig) and ct_config.act_static
    with pytest.raises(ValueError, match="'gptq' is not supported"):
        get_quantization_config_class("gptq")
