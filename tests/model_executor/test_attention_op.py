"""The attention custom op against a naive reference: GQA, decode + prefill + chunked
prefill in one batch, padding lanes that write only into the dummy block 0."""
from __future__ import annotations

import math

import pytest
import torch

from vllm.attention.backends.torch_sdpa import TorchSDPAMetadataBuilder
from vllm.attention.layer import Attention, bind_kv_cache
from vllm.forward_context import (
    BatchDescriptor,
    get_forward_context,
    is_forward_context_available,
    set_forward_context,
)

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 8, 4, 16


def naive_attention(q, keys, values, context_len, scale):
    """q [ql, H, D]; keys/values [context_len + ql, KVH, D] -> [ql, H, D]."""
    group = HEADS // KV_HEADS
    out = torch.zeros_like(q)
    for i in range(q.shape[0]):
        visible = context_len + i + 1
        for h in range(HEADS):
            k = keys[:visible, h // group]
            v = values[:visible, h // group]
            weights = torch.softmax((k @ q[i, h]) * scale, dim=0)
            out[i, h] = weights @ v
    return out


def make_layer(name="model.layers.0.self_attn.attn"):
    return Attention(HEADS, HEAD_SIZE, 1 / math.sqrt(HEAD_SIZE), num_kv_heads=KV_HEADS,
                     prefix=name)


def test_unified_attention_matches_naive_reference():
    torch.manual_seed(0)
    scale = 1 / math.sqrt(HEAD_SIZE)
    # (context_len, query_len): fresh prompt, decode, chunk with context, decode
    requests = [(0, 5), (6, 1), (3, 4), (9, 1)]
    tables = [[7, 2], [11, 4], [5, 13], [9, 3, 14]]  # non-contiguous; block 0 never used
    num_padding = 2
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    used = {b for row in tables for b in row}
    for b in range(1, NUM_BLOCKS):  # blocks nobody owns hold NaN: reading one would show
        if b not in used:
            cache[:, b] = float("nan")
    full_k, full_v, slots, q_parts, k_parts, v_parts = [], [], [], [], [], []
    for (ctx, ql), table in zip(requests, tables):
        keys = torch.randn(ctx + ql, KV_HEADS, HEAD_SIZE)
        values = torch.randn(ctx + ql, KV_HEADS, HEAD_SIZE)
        for p in range(ctx):  # the cached context
            cache[0, table[p // BLOCK_SIZE], p % BLOCK_SIZE] = keys[p]
            cache[1, table[p // BLOCK_SIZE], p % BLOCK_SIZE] = values[p]
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                  for p in range(ctx, ctx + ql)]
        full_k.append(keys)
        full_v.append(values)
        q_parts.append(torch.randn(ql, HEADS, HEAD_SIZE))
        k_parts.append(keys[ctx:])
        v_parts.append(values[ctx:])
    pad_q = torch.randn(num_padding, HEADS, HEAD_SIZE)
    pad_kv = torch.randn(num_padding, KV_HEADS, HEAD_SIZE)
    q = torch.cat(q_parts + [pad_q]).flatten(1)
    k = torch.cat(k_parts + [pad_kv]).flatten(1)
    v = torch.cat(v_parts + [pad_kv]).flatten(1)
    before = cache.clone()

    metadata = TorchSDPAMetadataBuilder().build(
        [ql for _, ql in requests], [ctx + ql for ctx, ql in requests], tables, slots,
        num_padded_tokens=len(slots) + num_padding, device="cpu")
    assert metadata.slot_mapping[-num_padding:].tolist() == [0] * num_padding
    assert metadata.block_table[0].tolist() == [7, 2, 0]  # rows padded with the dummy block
    layer = make_layer()
    bind_kv_cache({layer.layer_name: layer}, {layer.layer_name: cache})
    with set_forward_context(metadata, None, attn_layers={layer.layer_name: layer}):
        out = layer(q, k, v)

    out = out.view(-1, HEADS, HEAD_SIZE)
    start = 0
    for i, (ctx, ql) in enumerate(requests):
        expected = naive_attention(q_parts[i], full_k[i], full_v[i], ctx, scale)
        torch.testing.assert_close(out[start:start + ql], expected, atol=1e-5, rtol=1e-5)
        start += ql
    assert torch.all(out[start:] == 0)  # padding lanes
    # The new K/V landed in the request's slots ...
    for (ctx, ql), table, keys, values in zip(requests, tables, full_k, full_v):
        for p in range(ctx + ql):
            torch.testing.assert_close(cache[0, table[p // BLOCK_SIZE], p % BLOCK_SIZE], keys[p])
            torch.testing.assert_close(cache[1, table[p // BLOCK_SIZE], p % BLOCK_SIZE],
                                       values[p])
    # ... and nothing else changed, except the dummy block the padding lanes wrote to.
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[torch.tensor(slots)] = True
    written = written.view(NUM_BLOCKS, BLOCK_SIZE)
    written[0] = True
    torch.testing.assert_close(cache[:, ~written], before[:, ~written], equal_nan=True)


def test_no_metadata_is_a_dummy_run():
    layer = make_layer()
    q = torch.randn(3, HEADS * HEAD_SIZE)
    kv = torch.randn(3, KV_HEADS * HEAD_SIZE)
    with set_forward_context(None, None, attn_layers={layer.layer_name: layer}):
        assert torch.all(layer(q, kv, kv) == 0)


def test_forward_context_rules():
    assert not is_forward_context_available()
    with pytest.raises(RuntimeError, match="No forward context"):
        get_forward_context()
    descriptor = BatchDescriptor(num_tokens=8, num_reqs=8, uniform=True)
    with set_forward_context(None, None, batch_descriptor=descriptor) as context:
        assert get_forward_context() is context
        assert context.batch_descriptor.non_uniform == BatchDescriptor(8)
        with pytest.raises(RuntimeError, match="do not nest"):
            with set_forward_context(None, None):
                pass
    assert not is_forward_context_available()
    layer = make_layer()
    q = torch.randn(1, HEADS * HEAD_SIZE)
    kv = torch.randn(1, KV_HEADS * HEAD_SIZE)
    with set_forward_context(None, None), pytest.raises(KeyError, match="attn_layers"):
        layer(q, kv, kv)


def test_bind_kv_cache_checks_names_and_shapes():
    layer = make_layer()
    layers = {layer.layer_name: layer}
    with pytest.raises(ValueError, match="without a cache"):
        bind_kv_cache(layers, {})
    with pytest.raises(ValueError, match="expected"):
        bind_kv_cache(layers, {layer.layer_name: torch.zeros(2, 4, 4, 3, HEAD_SIZE)})
    cache = torch.zeros(layer.get_kv_cache_shape(4, BLOCK_SIZE))
    bind_kv_cache(layers, {layer.layer_name: cache})
    assert layer.kv_cache is cache


def test_metadata_builder_rejects_inconsistent_input():
    builder = TorchSDPAMetadataBuilder()
    with pytest.raises(ValueError, match="slot_mapping"):
        builder.build([2], [2], [[1]], [4], None, "cpu")
    with pytest.raises(ValueError, match="seq_len"):
        builder.build([3], [2], [[1]], [4, 5, 6], None, "cpu")
    with pytest.raises(ValueError, match="num_padded_tokens"):
        builder.build([1], [1], [[1]], [4], 0, "cpu")
