"""Qwen2-MoE and Qwen3-MoE give transformers' logits (batched prefill, paged decode, chunked
prefill, padding lanes) with each routing and layout option: norm_topk_prob on and off,
mlp_only_layers, decoder_sparse_step, sliding windows, and expert tensors stored per expert
(Hub checkpoints, transformers 5's default save) or stacked over the experts."""
from __future__ import annotations

import os

import pytest
import torch

from tests.model_executor.test_models_vs_hf import build, run_scenario
from vllm.config import ModelConfig
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.models.llama import LlamaMLP
from vllm.model_executor.models.qwen2_moe import (
    Qwen2MoeSparseMoeBlock,
    is_sparse_layer,
    layer_index,
)

FAMILIES = ["qwen2_moe", "qwen3_moe"]


pytestmark = pytest.mark.usefixtures("one_thread")


def mlp_kinds(model) -> list[str]:
    return ["moe" if isinstance(layer.mlp, Qwen2MoeSparseMoeBlock) else "dense"
            for layer in model.model.layers]


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers(checkpoints, family, block_size):
    run_scenario(checkpoints(family), block_size)


def test_structure_of_the_default_checkpoints(checkpoints):
    qwen2, _ = build(checkpoints("qwen2_moe"))
    block = qwen2.model.layers[0].mlp
    assert mlp_kinds(qwen2) == ["moe", "moe"]
    assert not block.experts.renormalize  # norm_topk_prob False in the maker
    assert block.experts.w13_weight.shape == (4, 2 * 32, 64)
    assert block.shared_expert.gate_up_proj.weight.shape == (2 * 48, 64)
    assert block.shared_expert_gate.weight.shape == (1, 64)
    assert qwen2.model.layers[0].self_attn.qkv_proj.bias is not None
    assert qwen2.model.layers[0].self_attn.o_proj.bias is None
    qwen3, _ = build(checkpoints("qwen3_moe"))
    block = qwen3.model.layers[0].mlp
    assert block.experts.renormalize and block.shared_expert is None
    assert not hasattr(block, "shared_expert_gate") or block.shared_expert_gate is None
    attn = qwen3.model.layers[0].self_attn
    assert attn.qkv_proj.bias is None and attn.q_norm.weight.shape == (16,)


@pytest.mark.parametrize("family, overrides, kinds", [
    ("qwen2_moe", {"norm_topk_prob": True}, ["moe", "moe"]),
    ("qwen3_moe", {"norm_topk_prob": False}, ["moe", "moe"]),
    ("qwen2_moe", {"mlp_only_layers": [0]}, ["dense", "moe"]),
    ("qwen3_moe", {"mlp_only_layers": [0]}, ["dense", "moe"]),
    ("qwen2_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 3},
     ["dense", "moe", "dense"]),
    ("qwen3_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 3},
     ["dense", "moe", "dense"]),
], ids=["qwen2-renorm", "qwen3-no-renorm", "qwen2-mlp-only-0", "qwen3-mlp-only-0",
        "qwen2-sparse-step-2", "qwen3-sparse-step-2"])
@pytest.mark.parametrize("block_size", [16, 4])
def test_variants_match_transformers(checkpoints, family, overrides, kinds, block_size):
    path = checkpoints(family, **overrides)
    model, _ = build(path)
    assert mlp_kinds(model) == kinds
    for layer, kind in zip(model.model.layers, kinds):
        if kind == "dense":  # intermediate_size, not the expert size
            assert isinstance(layer.mlp, LlamaMLP)
            assert layer.mlp.gate_up_proj.weight.shape == (2 * 128, 64)
        else:
            assert layer.mlp.experts.renormalize == model.config.norm_topk_prob
    run_scenario(path, block_size)


@pytest.mark.parametrize("family, overrides, windows", [
    # transformers' Qwen2-MoE layer_types: sliding on even layers below max_window_layers.
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
     [8, None]),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}, [8, 8]),
    ("qwen3_moe", {"use_sliding_window": False, "sliding_window": 8}, [None, None]),
], ids=["qwen2-layer-types", "qwen3-every-layer", "qwen3-window-off"])
def test_sliding_window_matches_transformers(checkpoints, family, overrides, windows):
    path = checkpoints(family, **overrides)
    model, _ = build(path)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == windows
    run_scenario(path, 4)  # prompts of 7-37 tokens: the window of 8 bites


@pytest.mark.parametrize("family", FAMILIES)
def test_stacked_expert_checkpoint(checkpoints, family, tmp_path):
    """transformers 5 keeps experts stacked (`experts.gate_up_proj [E, 2I, H]`,
    `experts.down_proj [E, H, I]`); `save_pretrained` converts back to per-expert names
    unless `save_original_format=False`. Both layouts load to the same logits."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    per_expert = checkpoints(family)
    with safe_open(os.path.join(per_expert, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names
    assert not any(name.endswith("experts.gate_up_proj") for name in names)

    stacked = str(tmp_path / "stacked")
    hf = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
    hf.save_pretrained(stacked, save_original_format=False)
    with safe_open(os.path.join(stacked, "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 64)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (4, 64, 32)
    assert not any(".experts.0." in name for name in shapes)
    run_scenario(stacked, 16)
    a, _ = build(per_expert)
    b, _ = build(stacked)
    for name, param in a.named_parameters():
        torch.testing.assert_close(dict(b.named_parameters())[name], param, atol=0, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_config_is_moe(checkpoints, family):
    config = ModelConfig(model=checkpoints(family))
    assert config.is_moe
    assert config.get_num_experts() == 4


def _moe(monkeypatch, rank: int, world: int) -> FusedMoE:
    import vllm.model_executor.layers.fused_moe as fused_moe

    monkeypatch.setattr(fused_moe, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(fused_moe, "get_tensor_model_parallel_world_size", lambda: world)
    return FusedMoE(num_experts=3, top_k=2, hidden_size=8, intermediate_size=6,
                    params_dtype=torch.float32)


@pytest.mark.parametrize("rank, world", [(0, 1), (0, 2), (1, 2)])
def test_stacked_and_per_expert_loads_agree_on_every_rank(monkeypatch, rank, world):
    gate, up = torch.randn(3, 6, 8), torch.randn(3, 6, 8)
    down = torch.randn(3, 8, 6)
    per_expert, stacked = _moe(monkeypatch, rank, world), _moe(monkeypatch, rank, world)
    for e in range(3):
        for shard, tensor in (("w1", gate[e]), ("w3", up[e])):
            per_expert.weight_loader(per_expert.w13_weight, tensor, "x", shard, e)
        per_expert.weight_loader(per_expert.w2_weight, down[e], "x", "w2", e)
    stacked.weight_loader(stacked.w13_weight, torch.cat([gate, up], dim=1), "x", "w13", None)
    stacked.weight_loader(stacked.w2_weight, down, "x", "w2", None)
    torch.testing.assert_close(stacked.w13_weight, per_expert.w13_weight, atol=0, rtol=0)
    torch.testing.assert_close(stacked.w2_weight, per_expert.w2_weight, atol=0, rtol=0)
    inter = 6 // world
    rows = slice(rank * inter, (rank + 1) * inter)
    torch.testing.assert_close(stacked.w13_weight[:, :inter], gate[:, rows])
    torch.testing.assert_close(stacked.w13_weight[:, inter:], up[:, rows])
    torch.testing.assert_close(stacked.w2_weight, down[:, :, rows])


def test_stacked_load_errors(monkeypatch):
    moe = _moe(monkeypatch, 0, 1)
    with pytest.raises(ValueError, match=r"mlp.experts.gate_up_proj: stacked expert tensor of "
                       r"shape \(4, 12, 8\) does not fit \(3, 12, 8\)"):
        moe.weight_loader(moe.w13_weight, torch.zeros(4, 12, 8), "mlp.experts.gate_up_proj",
                          "w13", None)
    with pytest.raises(ValueError, match="shard id must be w13 or w2, got 'w1'"):
        moe.weight_loader(moe.w13_weight, torch.zeros(3, 12, 8), "n", "w1", None)


def test_renormalize_off_keeps_softmax_weights():
    from vllm.model_executor.layers.fused_moe import select_experts

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, probs[:, :2])
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, probs[:, :2] / probs[:, :2].sum())


def test_expert_out_of_range_is_a_clear_error(checkpoints, tmp_path):
    """A checkpoint with more experts than the config names fails on the first extra one."""
    path = checkpoints("qwen2_moe")
    model, _ = build(path)
    with pytest.raises(ValueError, match=r"expert id 4 is out of range \(num_experts=4\)"):
        model.load_weights([("model.layers.0.mlp.experts.4.up_proj.weight",
                             torch.zeros(32, 64))])


def test_layer_selection_rules():
    class Config:
        num_experts = 4
        decoder_sparse_step = 2
        mlp_only_layers = [3]

    assert [is_sparse_layer(Config, i) for i in range(6)] == [False, True, False, False,
                                                              False, True]
    Config.decoder_sparse_step = 0
    with pytest.raises(ValueError, match="decoder_sparse_step must be an integer >= 1, got 0"):
        is_sparse_layer(Config, 0)
    assert layer_index("model.layers.12") == 12
    with pytest.raises(ValueError, match="cannot tell the layer index from the module prefix "
                       "'model.decoder'"):
        layer_index("model.decoder")
