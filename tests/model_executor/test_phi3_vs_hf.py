"""Phi-3 against transformers: fused qkv/gate_up checkpoint tensors, sliding window, partial
RoPE and LongRoPE (short factors when max_model_len <= original_max_position_embeddings, long
ones otherwise: see `LongRoPEScaledRotaryEmbedding`), and the fused weight loaders under
tensor parallelism."""
from __future__ import annotations

import math
import os

import pytest
import torch

from tests.model_executor import test_models_vs_hf as models_vs_hf
from tests.model_executor.hf_checkpoints import make_phi3
from tests.model_executor.paged_runner import PagedRunner
from tests.model_executor.test_models_vs_hf import (
    ATOL,
    build,
    hf_logits,
    random_tokens,
    run_scenario,
)
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.model_executor.layers import linear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader import get_model

HEAD_DIM = 16  # TINY: hidden 64 / 4 heads


def longrope(original: int, pairs: int = HEAD_DIM // 2, **extra) -> dict:
    """LongRoPE parameters with distinct per-pair factors (short ones near 1, long ones
    larger), as Phi-3-mini-128k's config has them."""
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.15 * i for i in range(pairs)],
            "long_factor": [1.5 + 0.9 * i for i in range(pairs)],
            "original_max_position_embeddings": original, **extra}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """phi3(**overrides) -> a tiny Phi-3 checkpoint folder (made once per overrides)."""
    root = tmp_path_factory.mktemp("phi3")
    made: dict[str, str] = {}

    def get(**overrides) -> str:
        rope = overrides.get("rope_parameters")
        if rope is not None and "original_max_position_embeddings" in rope:
            # transformers takes Phi-3's pre-training length from the top level.
            overrides["original_max_position_embeddings"] = \
                rope["original_max_position_embeddings"]
        key = repr(sorted(overrides.items()))
        if key not in made:
            made[key] = make_phi3(root / f"phi3-{len(made)}", tokenizer=False, **overrides)
        return made[key]

    return get


@pytest.mark.parametrize("block_size", [16, 4])
def test_phi3_matches_transformers(phi3, block_size):
    path = phi3()
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # The checkpoint holds the fused tensors, not separate projections.
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj" in n or ".gate_proj" in n for n in names)
    model, _ = build(path)
    assert type(model).__name__ == "Phi3ForCausalLM"
    assert all(layer.sliding_window is None for layer in model.attention_layers.values())
    assert model.model.layers[0].self_attn.qkv_proj.bias is None
    run_scenario(path, block_size)


def test_phi3_sliding_window_and_partial_rotary(phi3):
    """Phi-3-mini-4k sets sliding_window (2047): transformers applies it to every layer.
    A window of 8 bites on the scenario's prompts (up to 37 tokens)."""
    path = phi3(sliding_window=8,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.5,
                                 "original_max_position_embeddings": 512})
    model, _ = build(path)
    assert [layer.sliding_window for layer in model.attention_layers.values()] == [8, 8]
    assert model.model.layers[0].self_attn.rotary_emb.rotary_dim == HEAD_DIM // 2
    run_scenario(path, 4)


def build_with_max_model_len(max_model_len: int):
    """test_models_vs_hf.build with a max_model_len (which picks LongRoPE's factor list)."""
    def build_it(path: str, block_size: int = 16, custom_ops=None):
        assert custom_ops is None
        config = VllmConfig(model_config=ModelConfig(model=path, dtype="float32",
                                                     max_model_len=max_model_len),
                            cache_config=CacheConfig(block_size=block_size),
                            optimization_level=0)
        return get_model(config), config
    return build_it


@pytest.mark.parametrize("rope, attention_factor", [
    (longrope(64), math.sqrt(1 + math.log(512 / 64) / math.log(64))),
    (longrope(64, pairs=HEAD_DIM // 4, partial_rotary_factor=0.5, attention_factor=1.2), 1.2),
    (longrope(64, factor=4.0), math.sqrt(1 + math.log(4.0) / math.log(64))),
], ids=["defaults", "partial-attention-factor", "explicit-factor"])
def test_longrope_short_factors_match_transformers(phi3, monkeypatch, rope,
                                                   attention_factor):
    """max_model_len 64 <= original_max_position_embeddings 64: the short factors and the
    attention factor, as transformers uses them on sequences of at most 64 tokens (the
    scenario's longest has 37)."""
    path = phi3(rope_parameters=rope)
    model, config = build(path)
    assert config.model_config.max_model_len == 512  # max_position_embeddings, as transformers
    assert model.model.layers[0].self_attn.rotary_emb.use_long_factors
    monkeypatch.setattr(models_vs_hf, "build", build_with_max_model_len(64))
    model, _ = models_vs_hf.build(path)
    rotary = model.model.layers[0].self_attn.rotary_emb
    assert type(rotary).__name__ == "LongRoPEScaledRotaryEmbedding"
    assert not rotary.use_long_factors and rotary.original_max_position == 64
    assert rotary.attention_factor == pytest.approx(attention_factor)
    run_scenario(path, 4)


@torch.inference_mode()
def test_longrope_caches_are_transformers_rotations(phi3):
    """The cache holds transformers' cos/sin for a sequence of max_model_len tokens: the short
    factors' for max_model_len <= original_max_position_embeddings (32), the long ones'
    (for every position) above it."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    path = phi3(rope_parameters=longrope(32))
    hf = Phi3RotaryEmbedding(AutoConfig.from_pretrained(path))
    x = torch.zeros(1, 1, HEAD_DIM)
    caches = {}
    for max_model_len in (32, 33, 512):
        model, _ = build_with_max_model_len(max_model_len)(path)
        cache = model.model.layers[0].self_attn.rotary_emb.cos_sin_cache
        cos, sin = hf(x, torch.arange(max_model_len)[None])
        expected = torch.cat([cos[0, :, :HEAD_DIM // 2], sin[0, :, :HEAD_DIM // 2]], dim=-1)
        torch.testing.assert_close(cache[:max_model_len], expected, atol=1e-5, rtol=1e-5)
        caches[max_model_len] = cache
    assert (caches[32][1:] - caches[512][1:]).abs().amax(dim=-1).min() > 1e-3
    torch.testing.assert_close(caches[33], caches[512], atol=0, rtol=0)


@torch.inference_mode()
def hf_logits_long_factors(path: str, sequences: dict[str, list[int]], original: int) -> dict:
    """transformers' logits with its long factors for every sequence: its rotary module sees
    one extra position past the switch point (then dropped)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    native = model.model.rotary_emb.forward

    def long_always(x, position_ids):
        beyond = torch.full_like(position_ids[:, :1], original)
        cos, sin = native(x, torch.cat([position_ids, beyond], dim=1))
        return cos[:, :-1], sin[:, :-1]

    model.model.rotary_emb.forward = long_always
    return {key: model(torch.tensor([seq])).logits[0].float() for key, seq in sequences.items()}


def test_longrope_long_factors_past_the_switch(phi3):
    """original_max_position_embeddings 32, max_position_embeddings 512 = max_model_len:
    the long factors everywhere. Request "long" crosses position 32 in a chunked prefill and
    keeps decoding: transformers' logits exactly (it too uses the long factors for the whole
    of a sequence longer than 32). Request "short" (14 tokens) in the same batches gets
    transformers' logits under the long factors, not transformers' own short-factor logits
    (the documented difference)."""
    path = phi3(rope_parameters=longrope(32))
    long_seq, short_seq = random_tokens(48, 21), random_tokens(14, 22)
    plain = hf_logits(path, {"long": long_seq, "short": short_seq})
    forced = hf_logits_long_factors(path, {"short": short_seq, "long": long_seq}, 32)
    torch.testing.assert_close(forced["long"], plain["long"], atol=ATOL, rtol=0)
    model, config = build(path, block_size=4)
    assert config.model_config.max_model_len == 512
    runner = PagedRunner(model, config, block_size=4)
    got = [runner.step([("long", long_seq[:20]), ("short", short_seq[:10])], num_padding=2)]
    got.append(runner.step([("short", short_seq[10:11]), ("long", long_seq[20:44])]))
    for i in range(44, 47):
        got.append(runner.step([("long", long_seq[i:i + 1]),
                                ("short", short_seq[11 + i - 44:12 + i - 44])]))
    ours_long = torch.cat([step["long"] for step in got])
    ours_short = torch.cat([step["short"] for step in got])
    assert ours_long.shape[0] == 47 and ours_short.shape[0] == 14
    torch.testing.assert_close(ours_long, plain["long"][:47], atol=ATOL, rtol=0)
    torch.testing.assert_close(ours_short, forced["short"], atol=ATOL, rtol=0)
    assert (ours_short - plain["short"]).abs().max() > 1e-2


def test_longrope_bad_factor_lists_are_a_clear_error():
    rope = longrope(32)
    with pytest.raises(ValueError, match=r"short_factor must be a list of 8 positive numbers"):
        get_rope(HEAD_DIM, HEAD_DIM, 512, 10000.0, {**rope, "short_factor": [1.0] * 7})
    with pytest.raises(ValueError, match=r"long_factor must be a list of 8 positive numbers"):
        get_rope(HEAD_DIM, HEAD_DIM, 512, 10000.0, {**rope, "long_factor": None})
    # The legacy name "su" is the same scaling.
    su = get_rope(HEAD_DIM, HEAD_DIM, 512, 10000.0, {**rope, "rope_type": "su"})
    torch.testing.assert_close(su.cos_sin_cache,
                               get_rope(HEAD_DIM, HEAD_DIM, 512, 10000.0, rope).cos_sin_cache)


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_fused_loaders_give_each_rank_its_slices(monkeypatch, num_kv_heads):
    """A fused [q; k; v] / [gate; up] checkpoint tensor loaded without a shard id gives every
    tensor-parallel rank exactly what the separate tensors would: its q heads, its (possibly
    replicated) kv head, its gate and up rows."""
    heads, head_size, hidden = 4, 4, 8
    q = torch.randn(heads * head_size, hidden)
    k, v = (torch.randn(num_kv_heads * head_size, hidden) for _ in range(2))
    gate, up = torch.randn(12, hidden), torch.randn(12, hidden)
    monkeypatch.setattr(linear, "get_tensor_model_parallel_world_size", lambda: 2)
    for rank in range(2):
        monkeypatch.setattr(linear, "get_tensor_model_parallel_rank", lambda r=rank: r)
        fused = linear.QKVParallelLinear(hidden, head_size, heads, num_kv_heads, bias=False)
        fused.weight.weight_loader(fused.weight, torch.cat([q, k, v]))
        split = linear.QKVParallelLinear(hidden, head_size, heads, num_kv_heads, bias=False)
        for shard, tensor in zip("qkv", (q, k, v)):
            split.weight.weight_loader(split.weight, tensor, shard)
        kv_head = rank if num_kv_heads == 2 else 0  # one kv head per rank, or replicated
        rows = slice(kv_head * head_size, (kv_head + 1) * head_size)
        expected = torch.cat([q.chunk(2)[rank], k[rows], v[rows]])
        torch.testing.assert_close(fused.weight.data, expected, atol=0, rtol=0)
        torch.testing.assert_close(split.weight.data, expected, atol=0, rtol=0)

        merged = linear.MergedColumnParallelLinear(hidden, [12, 12], bias=False)
        merged.weight.weight_loader(merged.weight, torch.cat([gate, up]))
        torch.testing.assert_close(merged.weight.data,
                                   torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]),
                                   atol=0, rtol=0)


def test_fused_tensor_of_the_wrong_size_is_a_clear_error():
    qkv = linear.QKVParallelLinear(8, 4, 4, 2, bias=False)  # 16 + 8 + 8 rows
    with pytest.raises(ValueError, match=r"must have 32 rows \(parts of \[16, 8, 8\]\)"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(40, 8))
    merged = linear.MergedColumnParallelLinear(8, [12, 12], bias=False)
    with pytest.raises(ValueError, match=r"must have 24 rows"):
        merged.weight.weight_loader(merged.weight, torch.randn(30, 8))
