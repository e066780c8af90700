"""Gemma 1/2/3 give transformers' logits (batched prefill, decode over the paged KV cache,
chunked prefill, padding lanes; block sizes 16 and 4), with the features that set them apart
active: Gemma 2's soft-caps (attention 5.0, final 3.0) and window of 8 shorter than the
prompts (7..37 tokens), Gemma 3's local/global layers with two RoPE bases and q/k norms.
Every checkpoint's norm weights are drawn at random (transformers initialises them to zero,
which would hide the (1 + weight) form). Plus: GemmaRMSNorm against transformers' norm,
the final soft-cap, bfloat16, Gemma 3 multimodal checkpoint names, clear errors. TP=2 and
the one-graph trace: tests/model_executor/test_tp_families.py."""
from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model_executor.paged_runner import PagedRunner
from tests.model_executor.test_models_vs_hf import (
    build,
    hf_logits,
    random_tokens,
    run_scenario,
)
from vllm.config import ModelConfig, VllmConfig
from vllm.model_executor.layers.activation import GeluAndMul
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.gemma import (
    embedding_normalizer,
    gemma_hidden_act,
    layer_kinds_from_config,
)
from vllm.model_executor.models.gemma3 import gemma3_rope_parameters

VOCAB = 384


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_prefill_decode_chunked_match_transformers(checkpoints, arch, block_size):
    run_scenario(checkpoints(arch), block_size)


def test_gemma2_layers_windows_caps_and_tied_head(checkpoints):
    model, _ = build(checkpoints("gemma2"))
    assert type(model).__name__ == "Gemma2ForCausalLM"
    attns = [layer.self_attn.attn for layer in model.model.layers]
    # transformers' default layer_types: even layers slide.
    assert [a.sliding_window for a in attns] == [8, None]
    assert all(a.logits_soft_cap == 5.0 for a in attns)
    assert all(a.scale == pytest.approx(24 ** -0.5) for a in attns)
    assert model.logits_processor.soft_cap == 3.0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.act_fn, GeluAndMul) and layer.mlp.act_fn.approximate == "tanh"
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        assert isinstance(getattr(layer, norm), GemmaRMSNorm)


def test_gemma3_local_and_global_layers(checkpoints):
    model, _ = build(checkpoints("gemma3"))
    local, glob = (layer.self_attn for layer in model.model.layers)
    assert (local.attn.sliding_window, glob.attn.sliding_window) == (8, None)
    assert (local.rotary_emb.base, glob.rotary_emb.base) == (10000.0, 1e6)
    assert type(glob.rotary_emb).__name__ == "RotaryEmbedding"
    assert isinstance(local.q_norm, GemmaRMSNorm) and local.q_norm.hidden_size == 16
    assert local.attn.logits_soft_cap is None and model.logits_processor.soft_cap is None


def test_gemma3_linear_rope_scaling_on_global_layers_only(checkpoints):
    """Gemma 3 4B+: rope_scaling linear x8 applies to the global layers' RoPE only."""
    path = checkpoints("gemma3", rope_scaling={"rope_type": "linear", "factor": 8.0})
    model, _ = build(path)
    local, glob = (layer.self_attn.rotary_emb for layer in model.model.layers)
    assert type(local).__name__ == "RotaryEmbedding"
    assert type(glob).__name__ == "LinearScalingRotaryEmbedding"
    assert glob.scaling_factor == 8.0
    run_scenario(path, 4)


def test_gemma3_pattern_and_soft_caps_as_transformers(checkpoints):
    """sliding_window_pattern 3 over 4 layers (local, local, global, local); the final
    soft-cap applies, attn_logit_softcapping does not (transformers' Gemma 3 ignores it)."""
    path = checkpoints("gemma3", num_hidden_layers=4, sliding_window_pattern=3,
                       final_logit_softcapping=3.0, attn_logit_softcapping=2.0)
    model, _ = build(path)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [8, 8, None, 8]
    assert model.logits_processor.soft_cap == 3.0
    run_scenario(path, 16)


def test_gemma1_legacy_gelu_means_tanh(checkpoints):
    assert gemma_hidden_act(SimpleNamespace(hidden_act="gelu")) == "gelu_pytorch_tanh"
    assert gemma_hidden_act(SimpleNamespace(hidden_act="gelu_pytorch_tanh")) == \
        "gelu_pytorch_tanh"
    path = checkpoints("gemma", hidden_act="gelu")
    model, _ = build(path)
    assert model.model.layers[0].mlp.act_fn.approximate == "tanh"
    prompt = random_tokens(11, 6)
    got = PagedRunner(model, build(path)[1]).step([("p", prompt)])["p"]
    torch.testing.assert_close(got, hf_logits(path, {"p": prompt})["p"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("hidden_size, dtype, expected", [
    (3072, torch.bfloat16, 55.5), (3072, torch.float32, 55.42562484741211),
    (64, torch.bfloat16, 8.0), (2304, torch.bfloat16, 48.0)])
def test_embedding_normalizer_is_rounded_to_the_dtype(hidden_size, dtype, expected):
    assert embedding_normalizer(hidden_size, dtype) == expected


def bfloat16_copy(path: str, folder) -> str:
    """The checkpoint stored in bfloat16 (config.json's dtype too)."""
    tensors = {k: v.to(torch.bfloat16)
               for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["dtype"] = "bfloat16"
    config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("arch, stored", [("gemma2", "float32"), ("gemma3", "float32"),
                                          ("gemma2", "bfloat16"), ("gemma3", "bfloat16")])
def test_bfloat16_model_runs_close_to_float32(checkpoints, arch, stored, tmp_path):
    """bfloat16 compute, from the float32 checkpoint or a bfloat16 copy of it, stays close
    to transformers' float32 logits."""
    path = checkpoints(arch)
    ours = path if stored == "float32" else bfloat16_copy(path, tmp_path)
    config = VllmConfig(model_config=ModelConfig(model=ours, dtype="bfloat16"),
                        optimization_level=0)
    model = get_model(config)
    assert model.lm_head.weight.dtype == torch.bfloat16
    prompt = random_tokens(23, 8)  # longer than the window of 8
    logits = PagedRunner(model, config, block_size=4).step([("p", prompt)])["p"]
    assert logits.dtype == torch.float32
    reference = hf_logits(path, {"p": prompt})["p"]
    torch.testing.assert_close(logits, reference, atol=0.15, rtol=0.05)


def test_gemma3_multimodal_checkpoint_names(checkpoints, tmp_path):
    """Tensors saved from Gemma3ForConditionalGeneration (`language_model.model.*`) load."""
    path = checkpoints("gemma3")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    renamed = {"language_model." + name: tensor for name, tensor in tensors.items()}
    assert any(name.startswith("language_model.model.layers.") for name in renamed)
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    model, config = build(str(tmp_path))
    prompt = random_tokens(19, 9)
    got = PagedRunner(model, config).step([("p", prompt)])["p"]
    torch.testing.assert_close(got, hf_logits(path, {"p": prompt})["p"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["forward_native", "forward_cpu"])
def test_gemma_rms_norm_matches_transformers(dtype, method):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, generator=generator)
    x = (torch.randn(5, 96, generator=generator) * 3).to(dtype)
    residual = torch.randn(5, 96, generator=generator).to(dtype)
    theirs = Gemma2RMSNorm(96, eps=1e-6)
    theirs.weight.data.copy_(weight)
    ours = GemmaRMSNorm(96, eps=1e-6, dtype=dtype)
    ours.weight.data.copy_(weight)  # rounded to dtype like a loaded bf16 checkpoint
    theirs.weight.data.copy_(ours.weight.data.float())
    forward = getattr(ours, method)
    # The native form is transformers' ops exactly; ATen's fused rms_norm may differ in the
    # last bit (one bfloat16 ulp is 2**-8 relative).
    if method == "forward_native":
        tol = {"atol": 0, "rtol": 0}
    else:
        tol = {"atol": 1e-5, "rtol": 8e-3 if dtype == torch.bfloat16 else 1e-5}
    torch.testing.assert_close(forward(x), theirs(x), **tol)
    out, new_residual = forward(x, residual)
    summed = x + residual  # transformers' residual add, in the model dtype
    torch.testing.assert_close(new_residual, summed, atol=0, rtol=0)
    torch.testing.assert_close(out, theirs(summed), **tol)


def test_gemma_rms_norm_scales_in_float32_before_the_cast():
    """(x_hat * (1 + w)) is rounded once; Llama's order rounds x_hat first."""
    norm = GemmaRMSNorm(64, dtype=torch.bfloat16)
    norm.weight.data.copy_(torch.linspace(-0.9, 0.9, 64))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x32 = x.float()
    x_hat = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    once = (x_hat * (1 + norm.weight.float())).to(torch.bfloat16)
    twice = x_hat.to(torch.bfloat16) * (1 + norm.weight)
    assert not torch.equal(once, twice)
    torch.testing.assert_close(norm.forward_native(x), once, atol=0, rtol=0)


def test_logits_processor_soft_cap():
    generator = torch.Generator().manual_seed(0)
    head = SimpleNamespace(weight=torch.randn(VOCAB, 8, generator=generator), bias=None,
                           tp_size=1)
    hidden = torch.randn(3, 8, generator=generator)
    plain = LogitsProcessor(VOCAB)(head, hidden)
    capped = LogitsProcessor(VOCAB, soft_cap=3.0)(head, hidden)
    assert plain.abs().max() > 3.0
    torch.testing.assert_close(capped, 3.0 * torch.tanh(plain / 3.0))
    assert capped.abs().max() <= 3.0
    for bad in (0, -1.0, math.nan, math.inf, True, "3"):
        with pytest.raises(ValueError, match="soft_cap"):
            LogitsProcessor(VOCAB, soft_cap=bad)


def test_bidirectional_attention_is_a_clear_error(checkpoints):
    path = checkpoints("gemma2", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        build(path)


def test_layer_types_are_checked():
    config = SimpleNamespace(num_hidden_layers=2, layer_types=["sliding_attention", "chunked"])
    with pytest.raises(ValueError, match=r"layer_types\[1\] is 'chunked'; supported: "
                                         "'full_attention', 'sliding_attention'"):
        layer_kinds_from_config(config, pattern=2)
    config.layer_types = ["full_attention"]
    with pytest.raises(ValueError, match="layer_types has 1 entries for num_hidden_layers=2"):
        layer_kinds_from_config(config, pattern=2)
    config.layer_types = None
    assert layer_kinds_from_config(SimpleNamespace(num_hidden_layers=7), pattern=6) == \
        ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]


def test_gemma3_rope_parameters_old_and_new_config_names():
    old = SimpleNamespace(rope_theta=1e6, rope_local_base_freq=1e4,
                          rope_scaling={"rope_type": "linear", "factor": 8.0})
    new = SimpleNamespace(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    expected = {"full_attention": (1e6, {"rope_type": "linear", "factor": 8.0}),
                "sliding_attention": (1e4, None)}
    assert gemma3_rope_parameters(old) == expected
    assert gemma3_rope_parameters(new) == expected
    assert gemma3_rope_parameters(SimpleNamespace()) == {
        "full_attention": (1e6, None), "sliding_attention": (1e4, None)}
