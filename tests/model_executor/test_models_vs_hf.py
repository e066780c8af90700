"""Our models give transformers' logits: batched prefill, decode over the paged KV cache,
chunked prefill in a mixed batch, padding lanes; tied, sharded and llama3-RoPE checkpoints."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.model_executor.hf_checkpoints import LLAMA3_ROPE_SCALING, YARN_ROPE_SCALING
from tests.model_executor.paged_runner import PagedRunner
from vllm.config import CacheConfig, CompilationConfig, ModelConfig, VllmConfig
from vllm.model_executor.model_loader import get_model
from vllm.platforms import current_platform

ATOL = 1e-4
VOCAB = 384


pytestmark = pytest.mark.usefixtures("one_thread")


def build(path: str, block_size: int = 16, custom_ops: list[str] | None = None):
    """Our model for the folder at -O0 (eager), float32."""
    cc = CompilationConfig(custom_ops=custom_ops) if custom_ops else CompilationConfig()
    config = VllmConfig(model_config=ModelConfig(model=path, dtype="float32"),
                        cache_config=CacheConfig(block_size=block_size),
                        compilation_config=cc, optimization_level=0)
    return get_model(config), config


@torch.inference_mode()
def hf_logits(path: str, sequences: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return {key: model(torch.tensor([seq])).logits[0].float() for key, seq in sequences.items()}


def random_tokens(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=generator).tolist()


def run_scenario(path: str, block_size: int) -> None:
    """Step 1: three prompts and the first chunk of a fourth, with padding lanes.
    Step 2: the fourth prompt's second chunk (cached context) mixed with three decodes.
    Steps 3-4: pure decode batches, reordered, then padded."""
    prompts = {"a": random_tokens(7, 1), "b": random_tokens(19, 2), "c": random_tokens(34, 3),
               "d": random_tokens(30, 4)}
    extra = {key: random_tokens(3, 10 + i) for i, key in enumerate(prompts)}
    full = {key: prompts[key] + extra[key] for key in prompts}
    reference = hf_logits(path, full)
    model, config = build(path, block_size)
    runner = PagedRunner(model, config, block_size=block_size)

    def check(out, offsets):
        for key, logits in out.items():
            start = offsets[key]
            expected = reference[key][start:start + logits.shape[0]]
            torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0,
                                       msg=lambda m, k=key: f"request {k}: {m}")

    a, b, c, d = (prompts[k] for k in "abcd")
    check(runner.step([("a", a), ("b", b), ("c", c), ("d", d[:12])], num_padding=3),
          {"a": 0, "b": 0, "c": 0, "d": 0})
    check(runner.step([("d", d[12:]), ("a", extra["a"][:1]), ("b", extra["b"][:1]),
                       ("c", extra["c"][:1])]),
          {"d": 12, "a": 7, "b": 19, "c": 34})
    # "d" finished its prompt in step 2: its decode tokens start one step later.
    step = {"a": 1, "b": 1, "c": 1, "d": 0}
    check(runner.step([(k, extra[k][step[k]:step[k] + 1]) for k in "cbad"]),
          {"a": 8, "b": 20, "c": 35, "d": 30})
    check(runner.step([(k, extra[k][step[k] + 1:step[k] + 2]) for k in "abcd"], num_padding=2),
          {"a": 9, "b": 21, "c": 36, "d": 31})


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mixtral"])
def test_prefill_decode_chunked_match_transformers(checkpoints, arch, block_size):
    run_scenario(checkpoints(arch), block_size)


def test_mistral_uses_llama_class(checkpoints):
    path = checkpoints("mistral")
    run_scenario(path, 16)
    model, _ = build(path)
    assert type(model).__name__ == "LlamaForCausalLM"


def test_tied_embeddings(checkpoints):
    path = checkpoints("llama", tie_word_embeddings=True)
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    model, _ = build(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    run_scenario(path, 16)


def test_sharded_checkpoint(checkpoints):
    path = checkpoints("llama", max_shard_size="60KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 1
    run_scenario(path, 16)


def test_llama3_rope_scaling(checkpoints):
    path = checkpoints("llama", rope_scaling=LLAMA3_ROPE_SCALING)
    model, _ = build(path)
    assert type(model.model.layers[0].self_attn.rotary_emb).__name__ == "Llama3RotaryEmbedding"
    run_scenario(path, 4)


@pytest.mark.parametrize("arch, scaling", [
    ("qwen2", YARN_ROPE_SCALING),
    ("llama", {**YARN_ROPE_SCALING, "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.3}),
    ("qwen3", {**YARN_ROPE_SCALING, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}),
], ids=["qwen2-defaults", "llama-betas-attention-factor", "qwen3-mscale-no-truncate"])
def test_yarn_rope_scaling(checkpoints, arch, scaling):
    """YaRN (Qwen's long-context setting) gives transformers' logits, with its defaults and
    with each optional parameter; the default max_model_len is the pre-training length times
    the factor, as vLLM derives it."""
    path = checkpoints(arch, rope_scaling=scaling)
    model, config = build(path)
    rope = model.model.layers[0].self_attn.rotary_emb
    assert type(rope).__name__ == "YaRNScalingRotaryEmbedding"
    assert config.model_config.max_model_len == 128 * 4
    run_scenario(path, 4)


@pytest.mark.parametrize("scaling, expected", [
    (None, 512),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, 16384),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 512),
    ({"rope_type": "linear", "factor": 2.0}, 1024),
    ({"rope_type": "llama3", **{k: v for k, v in LLAMA3_ROPE_SCALING.items()
                                if k != "rope_type"}}, 512),
])
def test_default_max_model_len_follows_the_rope_scaling(scaling, expected):
    """As vLLM derives it (yarn: pre-training length x factor; linear: x factor), but never
    below max_position_embeddings, which transformers runs to."""
    from transformers import LlamaConfig

    from vllm.model_executor.layers.rotary_embedding import rope_max_position

    config = LlamaConfig(max_position_embeddings=512, rope_scaling=scaling)
    assert rope_max_position(config) == expected


def test_unsupported_rope_type_is_a_clear_error(checkpoints):
    path = checkpoints("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_scaling type 'dynamic' is not supported; "
                       "supported: default, linear, llama3, yarn"):
        build(path)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral"])
def test_custom_ops_all_vs_none(checkpoints, arch):
    path = checkpoints(arch)
    prompt = random_tokens(21, 5)
    results = {}
    for mode in ("all", "none"):
        model, config = build(path, custom_ops=[mode])
        norm = model.model.norm
        expected = f"forward_{current_platform.device_type}" if mode == "all" \
            else "forward_native"
        assert norm._forward_method.__name__ == expected
        runner = PagedRunner(model, config)
        results[mode] = (runner.step([("p", prompt)])["p"], runner.step([("p", [5])])["p"])
    for got_all, got_none in zip(results["all"], results["none"]):
        torch.testing.assert_close(got_all, got_none, atol=1e-5, rtol=0)


def test_dummy_load_format(checkpoints, tmp_path):
    path = checkpoints("qwen3")
    folder = tmp_path / "config-only"  # dummy weights need only config.json
    folder.mkdir()
    (folder / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    config = VllmConfig(model_config=ModelConfig(model=str(folder), dtype="float32"),
                        optimization_level=0)
    model = get_model(config, load_format="dummy")
    logits = PagedRunner(model, config).step([("p", random_tokens(9, 7))])["p"]
    assert logits.shape == (9, VOCAB) and torch.isfinite(logits).all()
    again = get_model(config, load_format="dummy")  # seeded: the same weights
    torch.testing.assert_close(again.lm_head.weight, model.lm_head.weight)


def test_bfloat16_model_runs_close_to_float32(checkpoints):
    path = checkpoints("qwen2")
    config = VllmConfig(model_config=ModelConfig(model=path, dtype="bfloat16"),
                        optimization_level=0)
    model = get_model(config)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32
    prompt = random_tokens(13, 8)
    logits = PagedRunner(model, config).step([("p", prompt)])["p"]
    assert logits.dtype == torch.float32
    reference = hf_logits(path, {"p": prompt})["p"]
    torch.testing.assert_close(logits, reference, atol=0.15, rtol=0.05)


@pytest.mark.parametrize("family, norm_names, identity", [
    ("gpt2", ("ln_1", "ln_2", "ln_f"), 1.0),      # nn.LayerNorm
    ("gemma2", ("layernorm", "norm"), 0.0),       # GemmaRMSNorm: (1 + w), identity at 0
    ("qwen3", ("layernorm", "q_norm", "norm"), 1.0)])
def test_dummy_norms_are_the_identity(checkpoints, tmp_path, family, norm_names, identity):
    """load_format="dummy": every norm's weight is its identity scale and its bias 0, so
    dummy benchmarks see activations of a normal size."""
    folder = tmp_path / "config-only"
    folder.mkdir()
    path = checkpoints(family)
    (folder / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    config = VllmConfig(model_config=ModelConfig(model=str(folder), dtype="float32"),
                        optimization_level=0)
    model = get_model(config, load_format="dummy")
    checked = 0
    for name, param in model.named_parameters():
        module_name, _, kind = name.rpartition(".")
        if not module_name.rsplit(".", 1)[-1].endswith(norm_names):
            continue
        expected = identity if kind == "weight" else 0.0
        assert torch.all(param == expected), name
        checked += 1
    assert checked >= 5


def test_mixtral_stacked_expert_checkpoint(checkpoints, tmp_path):
    """transformers 5's own Mixtral layout (`save_original_format=False`): the MoE block named
    `mlp`, every expert stacked in `experts.gate_up_proj` / `experts.down_proj`."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    stacked = str(tmp_path / "stacked")
    hf = AutoModelForCausalLM.from_pretrained(checkpoints("mixtral"), dtype=torch.float32)
    hf.save_pretrained(stacked, save_original_format=False)
    with safe_open(os.path.join(stacked, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any("block_sparse_moe" in name for name in names)
    run_scenario(stacked, 16)


@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", ["phi3", "qwen3_moe", "gpt2"])
def test_half_precision_checkpoint_with_dtype_auto(checkpoints, tmp_path, family, stored):
    """A checkpoint saved in bfloat16/float16 loads with dtype="auto": the compute dtype is
    the platform's choice (as stored, or float32 on a CPU without native bf16), every
    parameter is in it, and the logits stay near transformers' float32 ones."""
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / f"{family}-{stored}")
    hf = AutoModelForCausalLM.from_pretrained(checkpoints(family), dtype=torch.float32)
    hf.to(getattr(torch, stored)).save_pretrained(path)
    config = VllmConfig(model_config=ModelConfig(model=path, dtype="auto"),
                        optimization_level=0)
    model_config = config.model_config
    assert model_config.checkpoint_dtype == stored
    expected_dtype, _ = current_platform.resolve_auto_dtype(model_config)
    assert model_config.resolved_dtype == expected_dtype
    model = get_model(config)
    assert {p.dtype for p in model.parameters()} == {getattr(torch, expected_dtype)}
    prompt = random_tokens(13, 8)
    logits = PagedRunner(model, config).step([("p", prompt)])["p"]
    reference = hf_logits(path, {"p": prompt})["p"]  # the rounded weights, in float32
    torch.testing.assert_close(logits, reference, atol=0.15, rtol=0.05)
