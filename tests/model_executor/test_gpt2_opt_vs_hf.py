"""GPT-2 and OPT give transformers' logits over the paged KV cache (prefill, chunked prefill
with cached context, decode, padding lanes) for their config variants and checkpoint
layouts. TP=2 and the one-graph trace: tests/model_executor/test_tp_families.py."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.model_executor.paged_runner import PagedRunner
from tests.model_executor.test_models_vs_hf import build, random_tokens, run_scenario

pytestmark = pytest.mark.usefixtures("one_thread")


def rewrite_names(src: str, dst, rename, extra: dict[str, torch.Tensor] | None = None) -> str:
    """A copy of the checkpoint folder `src` at `dst` with every tensor name passed through
    `rename` (None drops the tensor) and `extra` tensors added."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    renamed = {rename(name): tensor.contiguous() for name, tensor in tensors.items()
               if rename(name) is not None}
    renamed.update(extra or {})
    save_file(renamed, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = f.read()
    with open(os.path.join(dst, "config.json"), "w") as f:
        f.write(config)
    return str(dst)


# ---------------------------------------------------------------- GPT-2

@pytest.mark.parametrize("block_size", [16, 4])
def test_gpt2_default(checkpoints, block_size):
    path = checkpoints("gpt2")
    model, _ = build(path)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(model.attention_layers) == 2
    run_scenario(path, block_size)


@pytest.mark.parametrize("overrides", [
    {"activation_function": "relu"},
    {"activation_function": "gelu", "scale_attn_by_inverse_layer_idx": True},
    {"scale_attn_weights": False, "n_inner": 96, "layer_norm_epsilon": 1e-3},
    {"tie_word_embeddings": False},
], ids=["relu", "gelu-inverse-layer-idx", "unscaled-n_inner-eps", "untied"])
def test_gpt2_variants(checkpoints, overrides):
    path = checkpoints("gpt2", **overrides)
    model, _ = build(path)
    if overrides.get("tie_word_embeddings") is False:
        assert model.lm_head.weight is not model.transformer.wte.weight
    run_scenario(path, 4)


def test_gpt2_checkpoint_without_transformer_prefix(checkpoints, tmp_path):
    """The Hub's gpt2 / DialoGPT files: `h.0.attn.c_attn.weight`, with the causal-mask
    buffers `attn.bias` / `attn.masked_bias` beside the weights."""
    src = checkpoints("gpt2")
    buffers = {}
    for i in range(2):
        buffers[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 512, 512))
        buffers[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    path = rewrite_names(src, tmp_path / "no-prefix", lambda n: n.removeprefix("transformer."),
                         buffers)
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert not any(name.startswith("transformer.") for name in f.keys())  # noqa: SIM118
    run_scenario(path, 16)


def test_gpt2_reorder_and_upcast_attn_is_the_same_math(checkpoints):
    """transformers' eager path with reorder_and_upcast_attn (scores in float32, scale folded
    into the product) gives our logits."""
    path = checkpoints("gpt2", reorder_and_upcast_attn=True)
    from transformers import AutoModelForCausalLM

    prompt = random_tokens(17, 6)
    with torch.inference_mode():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
        expected = hf(torch.tensor([prompt])).logits[0]
    model, config = build(path)
    got = PagedRunner(model, config).step([("p", prompt)])["p"]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_gpt2_cross_attention_config_is_refused(checkpoints, tmp_path):
    path = rewrite_names(checkpoints("gpt2"), tmp_path / "cross", lambda n: n)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["add_cross_attention"] = True
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="add_cross_attention=True"):
        build(path)


def test_gpt2_unexpected_tensor_is_named(checkpoints, tmp_path):
    path = rewrite_names(checkpoints("gpt2"), tmp_path / "extra", lambda n: n,
                         {"transformer.h.0.attn.q_attn.weight": torch.zeros(64, 64)})
    with pytest.raises(ValueError, match="unexpected tensor 'transformer.h.0.attn.q_attn"):
        build(path)


# ---------------------------------------------------------------- OPT

@pytest.mark.parametrize("block_size", [16, 4])
def test_opt_pre_layer_norm(checkpoints, block_size):
    path = checkpoints("opt")
    model, _ = build(path)
    decoder = model.model.decoder
    assert decoder.final_layer_norm is not None and decoder.project_in is None
    assert model.lm_head.weight is decoder.embed_tokens.weight
    run_scenario(path, block_size)


def test_opt_project_in_out_post_layer_norm(checkpoints):
    """opt-350m's layout: embeddings of 32 projected to hidden 64 and back, post-LN blocks,
    no decoder-level final LayerNorm."""
    path = checkpoints("opt", word_embed_proj_dim=32, do_layer_norm_before=False)
    model, _ = build(path)
    decoder = model.model.decoder
    assert decoder.final_layer_norm is None
    assert decoder.project_in.weight.shape == (64, 32)
    assert decoder.project_out.weight.shape == (32, 64)
    run_scenario(path, 4)


@pytest.mark.parametrize("overrides", [
    {"enable_bias": False, "layer_norm_elementwise_affine": False},
    {"activation_function": "gelu", "tie_word_embeddings": False},
    {"_remove_final_layer_norm": True},
], ids=["no-bias-no-affine", "gelu-untied", "removed-final-ln"])
def test_opt_variants(checkpoints, overrides):
    path = checkpoints("opt", **overrides)
    model, _ = build(path)
    if "enable_bias" in overrides:
        assert model.model.decoder.layers[0].fc1.bias is None
    run_scenario(path, 4)


def test_opt_checkpoint_with_decoder_prefix(checkpoints, tmp_path):
    """facebook/opt-* files on the Hub name tensors `decoder.layers.0...` (no `model.`)."""
    src = checkpoints("opt", word_embed_proj_dim=32)
    path = rewrite_names(src, tmp_path / "decoder-prefix", lambda n: n.removeprefix("model."))
    run_scenario(path, 16)


def test_opt_missing_and_unknown_tensors_are_named(checkpoints, tmp_path):
    src = checkpoints("opt")
    path = rewrite_names(src, tmp_path / "missing",
                         lambda n: None if "layers.1.self_attn.k_proj.weight" in n else n)
    with pytest.raises(ValueError, match="missing tensors for: "
                       r"model\.decoder\.layers\.1\.self_attn\.k_proj\.weight$"):
        build(path)
    path = rewrite_names(src, tmp_path / "unknown",
                         lambda n: n.replace("layers.1.fc1", "layers.1.fc3"))
    with pytest.raises(ValueError, match="unexpected tensor 'model.decoder.layers.1.fc3"):
        build(path)
