"""Logits soft-capping (Gemma 2's `attn_logit_softcapping`): each scaled score s = scale * q.k
becomes c * tanh(s / c) before the causal/window mask and the float32 softmax.

Checked against a dense float64 reference computed from the logical K/V (decode rows, a fresh
prompt longer than the kernel's 16-row chunk, chunks with cached context, GQA, block sizes 4
and 16, float32 and bfloat16, with and without a sliding window): the C++ kernel, its torch
reference, TorchSDPAImpl's kernel and plain-torch paths, and (in Triton's interpreter, where
Triton is installed) the Triton decode kernel. Also: a layer without a cap is unchanged (the
torch path still calls SDPA), bad caps are refused naming the value, and a backend that cannot
apply a cap is never given a layer that has one.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from vllm.attention.backends import cpu_paged_kernel, torch_sdpa
from vllm.attention.backends.abstract import AttentionImpl, check_logits_soft_cap
from vllm.attention.backends.torch_sdpa import (
    TorchSDPABackend,
    TorchSDPAImpl,
    TorchSDPAMetadataBuilder,
)

KERNEL = cpu_paged_kernel.cpu_paged_attention_available()
needs_kernel = pytest.mark.skipif(not KERNEL,
                                  reason="the CPU paged-attention kernel could not be built")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs Triton (its interpreter runs the kernel on CPU)")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (context_len, query_len): decode rows, a fresh prompt longer than 16 rows, chunks with
# cached context, a 1-token prompt.
REQUESTS = [(40, 1), (0, 23), (30, 20), (7, 1), (0, 1), (5, 3), (16, 9)]
HEAD_CONFIGS = [(6, 2, 16, 4), (4, 4, 32, 16), (8, 1, 24, 16)]  # heads, kv_heads, D, block
# Scores are scaled up (QUERY_GAIN) so that many exceed the smaller caps: the cap matters.
QUERY_GAIN = 4.0


def make_batch(requests, heads, kv_heads, head_size, block_size, dtype, seed=0):
    """The logical K/V of every request ([2, seq_len, KVH, D]), a zeroed paged cache holding
    them in shuffled blocks (the new tokens' K/V included), block-table rows padded with the
    dummy block 0, query [T, H, D], seq_lens and query_start_loc."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + q) // block_size) for c, q in requests]
    width = max(needed) + 1
    num_blocks = sum(needed) + 2
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_size, dtype=dtype)
    table = torch.zeros(len(requests), width, dtype=torch.int32)
    kvs, used = [], 0
    for r, (c, q) in enumerate(requests):
        ids = order[used:used + needed[r]]
        used += needed[r]
        table[r, :needed[r]] = ids.to(torch.int32)
        kv = torch.randn(2, c + q, kv_heads, head_size, generator=gen).to(dtype)
        kvs.append(kv)
        positions = torch.arange(c + q)
        cache[:, ids[positions // block_size], positions % block_size] = kv
    num_tokens = sum(q for _, q in requests)
    query = (torch.randn(num_tokens, heads, head_size, generator=gen) * QUERY_GAIN).to(dtype)
    starts = [0]
    for _, q in requests:
        starts.append(starts[-1] + q)
    seq_lens = torch.tensor([c + q for c, q in requests], dtype=torch.int64)
    return query, kvs, cache, table, seq_lens, torch.tensor(starts, dtype=torch.int64)


def dense_attention(query, kvs, requests, scale, window=None, cap=None):
    """Float64, one request at a time: scores = scale * q.k, capped (cap * tanh(s / cap)),
    then for the query row at position p the softmax over exactly the keys j with
    p - window < j <= p (the others masked out after the cap, so they weigh exactly 0)."""
    heads, kv_heads = query.shape[1], kvs[0].shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    start = 0
    for (context, query_len), kv in zip(requests, kvs):
        keys = kv[0].double().repeat_interleave(heads // kv_heads, dim=1)  # [S, H, D]
        values = kv[1].double().repeat_interleave(heads // kv_heads, dim=1)
        q = query[start:start + query_len].double()  # [Q, H, D]
        p = torch.arange(context, context + query_len)[:, None]  # [Q, 1]
        j = torch.arange(context + query_len)[None, :]  # [1, S]
        visible = (j <= p) if window is None else (j <= p) & (j > p - window)  # [Q, S]
        scores = torch.einsum("qhd,shd->hqs", q, keys) * scale
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:start + query_len] = torch.einsum("hqs,shd->qhd", scores.softmax(-1),
                                                    values)
        start += query_len
    return out


def tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


# --- the torch reference of the kernel's contract -------------------------------------------

@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cap", [None, 2.0, 30.0])
def test_kernel_reference_matches_dense(cap, window):
    query, kvs, cache, table, seq_lens, starts = make_batch(REQUESTS, 6, 2, 16, 4,
                                                           torch.float32)
    reqs = torch.arange(len(REQUESTS))
    ref = torch.full(query.shape, 7.0)
    cpu_paged_kernel.paged_attention_reference(query, cache, table, seq_lens, starts, reqs,
                                               0.25, ref, window=window, soft_cap=cap)
    torch.testing.assert_close(ref.double(),
                               dense_attention(query, kvs, REQUESTS, 0.25, window, cap),
                               atol=1e-5, rtol=1e-5)


def test_the_cap_changes_the_result_and_a_huge_cap_does_not():
    """Not vacuous: with these scores a cap of 2 moves the result far; a cap of 1e6 leaves
    it where no cap puts it."""
    query, kvs, *_ = make_batch(REQUESTS, 6, 2, 16, 4, torch.float32)
    plain = dense_attention(query, kvs, REQUESTS, 0.25)
    assert (dense_attention(query, kvs, REQUESTS, 0.25, cap=2.0) - plain).abs().max() > 0.3
    torch.testing.assert_close(dense_attention(query, kvs, REQUESTS, 0.25, cap=1e6), plain,
                               atol=1e-6, rtol=1e-6)


# --- the C++ kernel --------------------------------------------------------------------------

@needs_kernel
@pytest.mark.parametrize("cap", [0.5, 2.0, 30.0])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads,head_size,block_size", HEAD_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_dense(dtype, heads, kv_heads, head_size, block_size, window, cap):
    """Caps that put the scores / cap in both ranges of the kernel's tanh (series below 0.3,
    exponential above), decode rows and chunks in one call."""
    query, kvs, cache, table, seq_lens, starts = make_batch(REQUESTS, heads, kv_heads,
                                                           head_size, block_size, dtype)
    scale = 1 / math.sqrt(head_size)
    reqs = torch.arange(len(REQUESTS))
    out = torch.full(query.shape, 7.0, dtype=dtype)
    cpu_paged_kernel.paged_attention(query, cache, table, seq_lens, starts, reqs, scale, out,
                                     window=window, soft_cap=cap)
    dense = dense_attention(query, kvs, REQUESTS, scale, window, cap)
    tol = tolerance(dtype)
    torch.testing.assert_close(out.double(), dense, atol=tol, rtol=tol)
    ref = torch.empty_like(out)
    cpu_paged_kernel.paged_attention_reference(query, cache, table, seq_lens, starts, reqs,
                                               scale, ref, window=window, soft_cap=cap)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@needs_kernel
def test_kernel_without_a_cap_is_the_plain_kernel():
    """soft_cap None and 0.0 (the op's default) are the uncapped kernel, bit for bit; a
    capped call differs."""
    query, kvs, cache, table, seq_lens, starts = make_batch(REQUESTS, 6, 2, 16, 4,
                                                           torch.float32)
    reqs = torch.arange(len(REQUESTS))
    outs = [torch.empty(query.shape) for _ in range(3)]
    cpu_paged_kernel.paged_attention(query, cache, table, seq_lens, starts, reqs, 0.25, outs[0])
    torch.ops.vllm_cpu_attn.paged_attention(query, cache, table, seq_lens, starts, reqs, 0.25,
                                            outs[1])
    cpu_paged_kernel.paged_attention(query, cache, table, seq_lens, starts, reqs, 0.25, outs[2],
                                     soft_cap=2.0)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0].double(), dense_attention(query, kvs, REQUESTS, 0.25),
                               atol=1e-5, rtol=1e-5)
    assert (outs[2] - outs[0]).abs().max() > 0.3
    with pytest.raises(ValueError, match="soft_cap must be a positive finite number"):
        cpu_paged_kernel.paged_attention(query, cache, table, seq_lens, starts, reqs, 0.25,
                                         outs[2], soft_cap=-1.0)
    with pytest.raises(RuntimeError, match="soft_cap must be 0"):
        torch.ops.vllm_cpu_attn.paged_attention(query, cache, table, seq_lens, starts, reqs,
                                                0.25, outs[2], 0, float("nan"))


@needs_kernel
def test_kernel_tanh_is_accurate_across_its_two_ranges():
    """One query row over keys whose scores / cap sweep across 0.3 (where the kernel's tanh
    switches from its series to the exponential form) and far into the flat tails: with
    one-hot values the output is the softmax of the capped scores, against float64."""
    n, head_size, cap = 64, 16, 4.0
    query = torch.zeros(1, 1, head_size)
    query[0, 0, 0] = 1.0
    keys = torch.zeros(n, head_size)
    # score / cap: 48 steps of 0.1 through -2.4 .. 2.4 (both sides of 0.3), then the tails.
    keys[:, 0] = torch.cat([torch.linspace(-2.4, 2.4, 48) * cap,
                            torch.tensor([-300.0, -90, -40, -20, -12, -8, -6, -5,
                                          5, 6, 8, 12, 20, 40, 90, 300])])
    cache = torch.zeros(2, n // 16 + 1, 16, 1, head_size)
    cache[0, 1:].view(-1, head_size)[:] = keys
    table = torch.arange(1, n // 16 + 1, dtype=torch.int32).view(1, -1)
    got = []
    for part in range(n // head_size):  # the values pick out head_size weights at a time
        cache[1].zero_()
        cache[1, 1:].view(-1, head_size)[part * head_size:(part + 1) * head_size] = \
            torch.eye(head_size)
        out = torch.empty(1, 1, head_size)
        cpu_paged_kernel.paged_attention(query, cache, table, torch.tensor([n]),
                                         torch.tensor([0, 1]), torch.tensor([0]), 1.0, out,
                                         soft_cap=cap)
        got.append(out.view(-1))
    expected = (torch.tanh(keys[:, 0].double() / cap) * cap).softmax(-1)
    torch.testing.assert_close(torch.cat(got).double(), expected, atol=2e-7, rtol=1e-6)


@needs_kernel
def test_write_and_attend_with_a_cap():
    from vllm.attention.backends.cpu_paged_kernel import write_and_attend

    requests = [(21, 1), (0, 9), (12, 6)]
    query, kvs, cache, table, seq_lens, starts = make_batch(requests, 6, 2, 16, 4,
                                                           torch.float32)
    num_tokens = query.shape[0]
    new_k, new_v, slots = [], [], []
    for r, (c, n) in enumerate(requests):
        for p in range(c, c + n):
            slot = int(table[r, p // 4]) * 4 + p % 4
            cache.view(2, -1, 2, 16)[:, slot] = 0.0
            slots.append(slot)
            new_k.append(kvs[r][0, p])
            new_v.append(kvs[r][1, p])
    out = torch.zeros(num_tokens, 6 * 16)
    write_and_attend(query.reshape(num_tokens, -1), torch.stack(new_k).reshape(num_tokens, -1),
                     torch.stack(new_v).reshape(num_tokens, -1), cache, torch.tensor(slots),
                     table, seq_lens, starts, torch.arange(3), 0.25, out, window=4,
                     soft_cap=1.5)
    torch.testing.assert_close(out.view(num_tokens, 6, 16).double(),
                               dense_attention(query, kvs, requests, 0.25, 4, 1.5), atol=1e-5,
                               rtol=1e-5)


# --- TorchSDPAImpl: the kernel path and the plain-torch path --------------------------------

class _Layer:
    layer_name = "model.layers.0.self_attn.attn"


def run_impl(dtype, heads, kv_heads, head_size, block_size, window, cap, device="cpu",
             impl_cls=TorchSDPAImpl, builder=None, requests=REQUESTS):
    """One batch through the impl (the new tokens' K/V written by it, three padding lanes):
    (output [T, H, D] without the padding, on the CPU; the dense reference)."""
    query, kvs, cache, table, seq_lens, starts = make_batch(requests, heads, kv_heads,
                                                           head_size, block_size, dtype)
    slots, key, value = [], [], []
    for r, (c, n) in enumerate(requests):
        for p in range(c, c + n):
            slots.append(int(table[r, p // block_size]) * block_size + p % block_size)
            key.append(kvs[r][0, p])
            value.append(kvs[r][1, p])
    cache.view(2, -1, kv_heads, head_size)[:, slots] = 0  # the impl writes them
    num_padding = 3
    num_tokens = len(slots) + num_padding
    tables = [table[r, :-(-(c + q) // block_size)].tolist() for r, (c, q) in enumerate(requests)]
    md = (builder or TorchSDPAMetadataBuilder()).build(
        [q for _, q in requests], [c + q for c, q in requests], tables, slots,
        num_padded_tokens=num_tokens, device=device)
    pad = torch.zeros(num_padding, kv_heads * head_size, dtype=dtype)
    q2d = torch.cat([query.reshape(len(slots), -1),
                     torch.zeros(num_padding, heads * head_size, dtype=dtype)])
    k2d = torch.cat([torch.stack(key).reshape(len(slots), -1), pad])
    v2d = torch.cat([torch.stack(value).reshape(len(slots), -1), pad])
    scale = 1 / math.sqrt(head_size)
    q2d, k2d, v2d, cache = (t.to(device) for t in (q2d, k2d, v2d, cache))
    impl = impl_cls(heads, head_size, scale, kv_heads, sliding_window=window,
                    logits_soft_cap=cap)
    output = torch.full_like(q2d, 5.0)
    impl.forward(_Layer(), q2d, k2d, v2d, cache, md, output)
    output = output.cpu()
    assert (output[len(slots):] == 0).all()  # padding lanes
    return (output[:len(slots)].view(query.shape),
            dense_attention(query, kvs, requests, scale, window, cap))


def use_torch_path(monkeypatch):
    monkeypatch.setattr(cpu_paged_kernel, "cpu_paged_attention_available", lambda: False)


@pytest.mark.parametrize("use_kernel", [
    pytest.param(True, marks=needs_kernel, id="kernel"), pytest.param(False, id="torch")])
@pytest.mark.parametrize("cap", [2.0, 30.0])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads,head_size,block_size", HEAD_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_impl_paths_match_dense(dtype, heads, kv_heads, head_size, block_size, window, cap,
                                use_kernel, monkeypatch):
    if not use_kernel:
        use_torch_path(monkeypatch)
    ours, dense = run_impl(dtype, heads, kv_heads, head_size, block_size, window, cap)
    assert not ours.isnan().any()
    tol = tolerance(dtype)
    torch.testing.assert_close(ours.double(), dense, atol=tol, rtol=tol)


@needs_kernel
def test_impl_kernel_path_passes_the_cap(monkeypatch):
    """On the CPU a capped layer still takes the one-call kernel path (no torch fallback)."""
    seen = []
    real = torch.ops.vllm_cpu_attn.write_and_attend  # the op the impl calls
    monkeypatch.setattr(torch.ops.vllm_cpu_attn, "write_and_attend",
                        lambda *a: seen.append(a[12]) or real(*a))  # (soft_cap)
    monkeypatch.setattr(TorchSDPAImpl, "_prefill", lambda *a: pytest.fail("torch path ran"))
    monkeypatch.setattr(TorchSDPAImpl, "_decode", lambda *a: pytest.fail("torch path ran"))
    ours, dense = run_impl(torch.float32, 6, 2, 16, 4, None, 2.0)
    torch.testing.assert_close(ours.double(), dense, atol=1e-5, rtol=1e-5)
    assert seen == [2.0]


def test_torch_path_calls_sdpa_without_a_cap_and_never_with_one(monkeypatch):
    use_torch_path(monkeypatch)
    calls = []
    real = torch_sdpa.F.scaled_dot_product_attention
    monkeypatch.setattr(torch_sdpa.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    ours, dense = run_impl(torch.float32, 6, 2, 16, 4, None, None)
    torch.testing.assert_close(ours.double(), dense, atol=1e-5, rtol=1e-5)
    assert len(calls) == 1 + sum(q > 1 for _, q in REQUESTS)  # batched decode + one each
    calls.clear()
    run_impl(torch.float32, 6, 2, 16, 4, None, 2.0)
    assert calls == []


def test_torch_path_splits_long_calls_into_row_chunks(monkeypatch):
    """With a tiny score budget every prompt is computed a few query rows at a time: the
    same result."""
    use_torch_path(monkeypatch)
    whole, dense = run_impl(torch.float32, 6, 2, 16, 4, 7, 3.0)
    monkeypatch.setattr(torch_sdpa, "_SCORE_BUDGET", 6 * 50 * 3)
    chunked, _ = run_impl(torch.float32, 6, 2, 16, 4, 7, 3.0)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chunked.double(), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_on_cuda(dtype):
    ours, dense = run_impl(dtype, 6, 2, 16, 4, 5, 2.0, device="cuda")
    torch.testing.assert_close(ours.double(), dense, atol=tolerance(dtype),
                               rtol=tolerance(dtype))


# --- bad caps, the layer, the selector ------------------------------------------------------

@pytest.mark.parametrize("cap", [0, 0.0, -1.5, float("inf"), float("nan"), True, "50"])
def test_bad_caps_are_rejected_naming_the_value(cap):
    with pytest.raises(ValueError, match="logits_soft_cap must be a positive finite number"):
        check_logits_soft_cap(cap)
    with pytest.raises(ValueError, match=r"logits_soft_cap .*got " + _re(cap)):
        TorchSDPAImpl(4, 16, 0.25, 2, logits_soft_cap=cap)
    from vllm.attention.layer import Attention

    with pytest.raises(ValueError, match=r"logits_soft_cap of 'model.layers.3.self_attn.attn'"
                                         r".*got " + _re(cap)):
        Attention(4, 16, 0.25, prefix="model.layers.3.self_attn.attn", logits_soft_cap=cap)


def _re(value) -> str:
    import re

    return re.escape(repr(value))


def test_good_caps_are_floats_on_the_layer_and_impl():
    from vllm.attention.layer import Attention

    assert check_logits_soft_cap(None) is None
    assert check_logits_soft_cap(50) == 50.0 and isinstance(check_logits_soft_cap(50), float)
    layer = Attention(4, 16, 0.25, num_kv_heads=2, prefix="model.layers.0.self_attn.attn",
                      logits_soft_cap=50)
    assert layer.logits_soft_cap == layer.impl.logits_soft_cap == 50.0
    assert "logits_soft_cap=50.0" in repr(layer)
    plain = Attention(4, 16, 0.25, prefix="model.layers.1.self_attn.attn")
    assert plain.logits_soft_cap is plain.impl.logits_soft_cap is None
    assert "logits_soft_cap=None" in repr(plain)
    assert TorchSDPABackend.supports_logits_soft_cap
    assert not getattr(AttentionImpl, "supports_logits_soft_cap", False)


class _NoCapBackend(TorchSDPABackend):
    supports_logits_soft_cap = False

    @staticmethod
    def get_name() -> str:
        return "NO_CAP"


def test_layer_and_selector_refuse_backends_without_soft_cap_support(monkeypatch):
    from vllm.attention import selector
    from vllm.attention.layer import Attention

    with pytest.raises(ValueError, match=r"NO_CAP does not support logits soft-capping "
                                         r"\(layer 'model.layers.1.self_attn.attn', "
                                         r"logits_soft_cap=30.0\)"):
        Attention(4, 16, 0.25, prefix="model.layers.1.self_attn.attn", logits_soft_cap=30.0,
                  attn_backend=_NoCapBackend)
    # Without a cap the backend is fine.
    assert Attention(4, 16, 0.25, prefix="model.layers.2.self_attn.attn",
                     attn_backend=_NoCapBackend).attn_backend is _NoCapBackend

    monkeypatch.setitem(selector._BACKENDS, "NO_CAP", (__name__, "_NoCapBackend"))
    assert selector.get_attn_backend(16, backend_name="no_cap") is _NoCapBackend
    with pytest.raises(ValueError, match=r"NO_CAP does not support logits soft-capping "
                                         r"\(logits_soft_cap=30.0\); use TORCH_SDPA"):
        selector.get_attn_backend(16, backend_name="no_cap", logits_soft_cap=30.0)
    # A default choice that cannot apply the cap falls back to TORCH_SDPA (logged).
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "no_cap")
    assert selector.get_attn_backend(16) is _NoCapBackend
    logged = []
    monkeypatch.setattr(selector.logger, "info_once", lambda msg, *a: logged.append(msg % a))
    assert selector.get_attn_backend(16, logits_soft_cap=30.0) is TorchSDPABackend
    assert logged == ["attention backend NO_CAP does not support logits soft-capping: layers "
                      "with a soft cap use TORCH_SDPA"]
    layer = Attention(4, 16, 0.25, prefix="model.layers.4.self_attn.attn", logits_soft_cap=30.0)
    assert layer.attn_backend is TorchSDPABackend


# --- TRITON_ATTN: the Triton decode kernel ---------------------------------------------------

def test_triton_attn_supports_caps_and_hands_the_cap_to_its_decode_kernel(monkeypatch):
    """No Triton needed: a fake kernel module records what the impl passes."""
    import types

    from vllm.attention.backends.triton_attn import (
        TritonAttentionBackend,
        TritonAttentionImpl,
        TritonAttentionMetadataBuilder,
    )

    assert TritonAttentionBackend.supports_logits_soft_cap
    calls = []
    fake = types.ModuleType("triton_decode_kernel")
    fake.paged_decode = lambda *a, **k: calls.append((k.get("window"), k.get("soft_cap")))
    monkeypatch.setitem(sys.modules, "vllm.attention.backends.triton_decode_kernel", fake)
    md = TritonAttentionMetadataBuilder(max_rows=4, max_blocks=2).build(
        [1, 1], [3, 1], [[1], [2]], [18, 32])
    for cap, window in [(50.0, None), (None, 4)]:
        impl = TritonAttentionImpl(2, 8, 0.3, num_kv_heads=1, sliding_window=window,
                                   logits_soft_cap=cap)
        query, key = torch.randn(2, 16), torch.randn(2, 8)
        impl.forward(None, query, key, key.clone(), torch.zeros(2, 3, 16, 1, 8), md,
                     torch.empty_like(query))
    assert calls == [(None, 50.0), (4, None)]


def run_with_interpreter(code: str) -> str:
    """`code`'s stdout, run in a new process with Triton's interpreter on (CPU platform)."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path, "VLLM_PLATFORM": "cpu",
           "CUDA_VISIBLE_DEVICES": ""}
    env.pop("VLLM_ATTENTION_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@needs_triton
def test_triton_decode_kernel_with_a_cap_in_the_interpreter():
    """The kernel against the reference (GQA, block sizes 4 and 16, a window, padding rows,
    float32 and bfloat16), then TritonAttentionImpl on a uniform decode batch (the kernel
    path) against the dense float64 reference."""
    out = run_with_interpreter("""
        import torch
        from vllm.attention.backends.cpu_paged_kernel import paged_attention_reference
        from vllm.attention.backends.triton_attn import (TritonAttentionImpl,
                                                         TritonAttentionMetadataBuilder)
        from vllm.attention.backends.triton_decode_kernel import paged_decode
        from tests.attention.test_logits_soft_cap import run_impl
        torch.manual_seed(0)
        for heads, kv_heads, head_size, block_size, window, cap, dtype in [
                (4, 2, 16, 4, None, 2.0, torch.float32), (6, 2, 24, 16, 5, 0.5, torch.float32),
                (8, 1, 16, 16, 9, 3.0, torch.bfloat16)]:
            kv = torch.randn(2, 12, block_size, kv_heads, head_size).to(dtype)
            lens = [min(n, 8 * block_size) for n in (7, 1, 0, 13, 30)]
            table = torch.zeros(7, 8, dtype=torch.int32)
            for i in range(5):
                table[i] = torch.randperm(11)[:8].int() + 1
            q = (torch.randn(5, heads, head_size) * 4).to(dtype)
            out = torch.full((5, heads, head_size), 7.0, dtype=dtype)
            paged_decode(q, kv, table, torch.tensor(lens + [0, 0]), 0.3, out, window,
                         soft_cap=cap)
            live = torch.tensor([i for i in range(5) if lens[i]])
            ref, plain = torch.zeros(2, 5, heads, head_size)
            args = (q.float(), kv.float(), table[:5], torch.tensor(lens), torch.arange(6), live,
                    0.3)
            paged_attention_reference(*args, ref, window, soft_cap=cap)
            paged_attention_reference(*args, plain, window)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
            assert (plain - ref).abs().max() > 0.1  # the cap matters here
            assert out[2].abs().max() == 0
        decodes = [(40, 1), (7, 1), (0, 1), (31, 1)]
        for window in (None, 6):
            ours, dense = run_impl(torch.float32, 6, 2, 16, 4, window, 2.0,
                                   impl_cls=TritonAttentionImpl,
                                   builder=TritonAttentionMetadataBuilder(max_rows=8,
                                                                          max_blocks=16),
                                   requests=decodes)
            torch.testing.assert_close(ours.double(), dense, atol=1e-5, rtol=1e-5)
        print("OK")
    """)
    assert out.strip().endswith("OK")
