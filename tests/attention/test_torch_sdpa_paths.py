"""TorchSDPAImpl on the CPU: the C++ kernel path and the plain-torch path give the same
result on one mixed batch (GQA, decode rows, a fresh prompt, a chunk with cached context,
padding lanes that write into the dummy block 0)."""
from __future__ import annotations

import math

import pytest
import torch

from vllm.attention.backends import cpu_paged_kernel
from vllm.attention.backends.cache_storage import byte_view
from vllm.attention.backends.torch_sdpa import TorchSDPAImpl, TorchSDPAMetadataBuilder

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 24


class _Layer:
    layer_name = "model.layers.0.self_attn.attn"
    k_scale = 1.0
    v_scale = 1.0


class _ScaledLayer(_Layer):
    k_scale = 0.5
    v_scale = 4.0


def run_batch(dtype, use_kernel, monkeypatch, cache_dtype=None, layer=_Layer):
    if not use_kernel:
        monkeypatch.setattr(cpu_paged_kernel, "cpu_paged_attention_available", lambda: False)
    gen = torch.Generator().manual_seed(0)
    # (context_len, query_len): decode, fresh prompt, chunk with context, decode
    requests = [(9, 1), (0, 6), (5, 3), (14, 1)]
    tables = [[3, 8, 11], [5, 20], [2, 17], [9, 4, 1, 22]]
    num_padding = 3
    stored = cache_dtype or dtype
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, dtype=stored)
    slots = []
    for (ctx, ql), table in zip(requests, tables):
        cache_kv = torch.randn(2, ctx, KV_HEADS, HEAD_SIZE, generator=gen).to(stored)
        for p in range(ctx):  # (through byte views: float8 has no index_put_)
            byte_view(cache)[:, table[p // BLOCK_SIZE], p % BLOCK_SIZE] = \
                byte_view(cache_kv)[:, p]
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                  for p in range(ctx, ctx + ql)]
    num_tokens = sum(q for _, q in requests) + num_padding
    md = TorchSDPAMetadataBuilder().build([q for _, q in requests],
                                          [c + q for c, q in requests], tables, slots,
                                          num_padded_tokens=num_tokens)
    query = torch.randn(num_tokens, HEADS * HEAD_SIZE, generator=gen).to(dtype)
    key = torch.randn(num_tokens, KV_HEADS * HEAD_SIZE, generator=gen).to(dtype)
    value = torch.randn(num_tokens, KV_HEADS * HEAD_SIZE, generator=gen).to(dtype)
    output = torch.full_like(query, 5.0)
    impl = TorchSDPAImpl(HEADS, HEAD_SIZE, 1 / math.sqrt(HEAD_SIZE), KV_HEADS)
    impl.forward(layer(), query, key, value, cache, md, output)
    return output, cache


@pytest.mark.skipif(not cpu_paged_kernel.cpu_paged_attention_available(),
                    reason="the CPU paged-attention kernel could not be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_and_torch_paths_agree(dtype, monkeypatch):
    ours, cache = run_batch(dtype, True, monkeypatch)
    torch_out, torch_cache = run_batch(dtype, False, monkeypatch)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), torch_out.float(), atol=tol, rtol=tol)
    assert (ours[-3:] == 0).all()  # padding lanes
    torch.testing.assert_close(cache, torch_cache, atol=0, rtol=0)
    # only the dummy block 0 and the requests' own slots were written
    assert cache[:, 0].abs().sum() > 0


@pytest.mark.skipif(not cpu_paged_kernel.cpu_paged_attention_available(),
                    reason="the CPU paged-attention kernel could not be built")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_a_float32_model_over_a_16bit_cache_takes_the_kernel(cache_dtype, monkeypatch):
    """kv_cache_dtype bfloat16/float16 under float32 activations: the kernel computes the
    batch (it had fallen back to the torch path), stores the new rows rounded as the torch
    path does, and agrees with it within the cache's rounding (the torch path attends a fresh
    prompt over its unrounded K/V; the kernel reads every key back from the cache)."""
    calls = []
    real_op = torch.ops.vllm_cpu_attn.write_and_attend
    monkeypatch.setattr(torch.ops.vllm_cpu_attn, "write_and_attend",
                        lambda *a: calls.append(a[3].dtype) or real_op(*a))
    ours, cache = run_batch(torch.float32, True, monkeypatch, cache_dtype)
    assert calls == [cache_dtype]
    torch_out, torch_cache = run_batch(torch.float32, False, monkeypatch, cache_dtype)
    assert calls == [cache_dtype] and ours.dtype == torch.float32
    torch.testing.assert_close(ours, torch_out, atol=2e-2, rtol=2e-2)
    assert (ours[-3:] == 0).all()
    torch.testing.assert_close(cache, torch_cache, atol=0, rtol=0)


@pytest.mark.skipif(not cpu_paged_kernel.cpu_paged_attention_available(),
                    reason="the CPU paged-attention kernel could not be built")
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_cache_on_both_paths(cache_dtype, dtype, monkeypatch):
    """kv_cache_dtype fp8: the kernel and the torch path (which writes through byte views:
    float8 has no index_copy_) store the same bytes (K / k_scale, V / v_scale) and agree
    within FP8's rounding (the torch path attends a fresh prompt over its unrounded K/V)."""
    ours, cache = run_batch(dtype, True, monkeypatch, cache_dtype, _ScaledLayer)
    torch_out, torch_cache = run_batch(dtype, False, monkeypatch, cache_dtype, _ScaledLayer)
    assert cache.dtype == cache_dtype
    assert torch.equal(cache.view(torch.uint8), torch_cache.view(torch.uint8))
    tol = 0.15 if cache_dtype == torch.float8_e5m2 else 0.08
    torch.testing.assert_close(ours.float(), torch_out.float(), atol=tol, rtol=tol)
    assert (ours[-3:] == 0).all()
    # the scales count: without them the stored values read back differently
    plain, _ = run_batch(dtype, True, monkeypatch, cache_dtype)
    assert not torch.allclose(plain.float(), ours.float(), atol=tol, rtol=tol)


def _decode_batch(dtype, cache):
    """One decode row over 5 cached positions of block 3 (whatever the cache holds)."""
    md = TorchSDPAMetadataBuilder().build([1], [6], [[3, 7]], [3 * BLOCK_SIZE + 1])
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, HEADS * HEAD_SIZE, generator=gen).to(dtype)
    k = torch.randn(1, KV_HEADS * HEAD_SIZE, generator=gen).to(dtype)
    v = torch.randn(1, KV_HEADS * HEAD_SIZE, generator=gen).to(dtype)
    return md, q, k, v


def test_a_rebound_cache_is_checked_again():
    """The cache checks run once per cache tensor: a layer bound to an empty or a
    non-contiguous cache later still gets its clear error."""
    impl = TorchSDPAImpl(HEADS, HEAD_SIZE, 1 / math.sqrt(HEAD_SIZE), KV_HEADS)
    good = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    md, q, k, v = _decode_batch(torch.float32, good)
    impl.forward(_Layer(), q, k, v, good, md, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="has no KV cache"):
        impl.forward(_Layer(), q, k, v, torch.empty(0), md, torch.empty_like(q))
    strided = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 2 * HEAD_SIZE)[..., :HEAD_SIZE]
    with pytest.raises(ValueError, match="must be contiguous"):
        impl.forward(_Layer(), q, k, v, strided, md, torch.empty_like(q))


@pytest.mark.skipif(not cpu_paged_kernel.cpu_paged_attention_available(),
                    reason="the CPU paged-attention kernel could not be built")
def test_the_kernel_decision_follows_cache_and_dtypes(monkeypatch):
    """The kernel-or-torch decision is remade when the cache tensor or an input dtype
    changes: a float32 layer that took the kernel takes the torch path for float64 inputs
    and a float64 cache (the kernel has no float64), and the kernel again after."""
    paths = []
    real_decode = TorchSDPAImpl._decode
    monkeypatch.setattr(TorchSDPAImpl, "_decode",
                        lambda self, *a: paths.append("torch") or real_decode(self, *a))
    real_op = torch.ops.vllm_cpu_attn.write_and_attend
    monkeypatch.setattr(torch.ops.vllm_cpu_attn, "write_and_attend",
                        lambda *a: paths.append("kernel") or real_op(*a))
    impl = TorchSDPAImpl(HEADS, HEAD_SIZE, 1 / math.sqrt(HEAD_SIZE), KV_HEADS)
    results = {}
    for dtype in (torch.float32, torch.float64, torch.float32):
        cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE,
                            generator=torch.Generator().manual_seed(2)).to(dtype)
        md, q, k, v = _decode_batch(dtype, cache)
        out = torch.empty_like(q)
        impl.forward(_Layer(), q, k, v, cache, md, out)
        results.setdefault(dtype, out)
    assert paths == ["kernel", "torch", "kernel"]
    torch.testing.assert_close(results[torch.float32].double(), results[torch.float64],
                               atol=1e-5, rtol=1e-5)


def test_the_impl_does_not_keep_a_cache_alive():
    """A KV cache the engine drops is freed: the impl remembers it only weakly."""
    import gc
    import weakref

    impl = TorchSDPAImpl(HEADS, HEAD_SIZE, 1 / math.sqrt(HEAD_SIZE), KV_HEADS)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    md, q, k, v = _decode_batch(torch.float32, cache)
    impl.forward(_Layer(), q, k, v, cache, md, torch.empty_like(q))
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None
