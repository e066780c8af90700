"""Sliding-window attention (transformers' semantics: the query at position p sees the keys at
positions p - W < j <= p) in the CPU kernel, its plain-torch reference and TorchSDPAImpl's two
paths (kernel, plain torch), each against a dense masked softmax computed directly from the
logical K/V in float64: decode rows, a fresh prompt, chunks with cached context, windows
smaller than, equal to and larger than the context, GQA, float32 and bfloat16.

Cache positions that no query row of a request can see are filled with NaN, so a read of a
block the window excludes would show: the kernel and the reference must skip every such
position, the plain-torch path every such whole block.
"""
from __future__ import annotations

import math

import pytest
import torch

from vllm.attention.backends import cpu_paged_kernel
from vllm.attention.backends.abstract import check_sliding_window
from vllm.attention.backends.torch_sdpa import (
    TorchSDPABackend,
    TorchSDPAImpl,
    TorchSDPAMetadataBuilder,
)

KERNEL = cpu_paged_kernel.cpu_paged_attention_available()
needs_kernel = pytest.mark.skipif(not KERNEL,
                                  reason="the CPU paged-attention kernel could not be built")

# (context_len, query_len): decode rows (context 40, a block-aligned 2 * 16 - 1 + 1 and
# shorter ones), a fresh prompt longer than the kernel's 16-row chunk, chunks with cached
# context (one of 20 rows), a 1-token prompt, a chunk whose context is a window length.
REQUESTS = [(40, 1), (0, 23), (30, 20), (7, 1), (0, 1), (31, 1), (47, 1), (5, 3), (16, 9)]
# Smaller than every context, equal to some (16, 30, 40), equal to a sequence (48), larger.
WINDOWS = [1, 5, 16, 30, 40, 48, 1000]
HEAD_CONFIGS = [(4, 4, 16, 4), (14, 2, 64, 16), (8, 1, 32, 8)]  # heads, kv_heads, D, block


def first_visible(context: int, window: int | None) -> int:
    """The first position the request's first query row (position `context`) sees."""
    return 0 if window is None else max(0, context - window + 1)


def make_paged(requests, heads, kv_heads, head_size, block_size, dtype, window, poison,
               seed=0, fill=float("nan")):
    """The logical K/V of every request ([2, seq_len, KVH, D], in `dtype`), a paged cache
    holding them in shuffled blocks, padded block-table rows, and query [T, H, D].

    poison: "positions" fills each request's positions before its first visible one with NaN,
    "blocks" only the whole blocks before the block holding it. Every other slot (unused
    blocks, the dummy block 0, the slots past a request's last position) holds `fill`: NaN
    for the kernel, which reads none of them; the plain-torch path reads whole blocks and
    padded block-table rows (masked), which the engine's zero-initialised cache allows."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + q) // block_size) for c, q in requests]
    width = max(needed) + 2  # padded rows: the tail entries point at block 0
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_size), fill, dtype=dtype)
    table = torch.zeros(len(requests), width, dtype=torch.int32)
    kvs, used = [], 0
    for r, (c, q) in enumerate(requests):
        ids = order[used:used + needed[r]]
        used += needed[r]
        table[r, :needed[r]] = ids.to(torch.int32)
        kv = torch.randn(2, c + q, kv_heads, head_size, generator=gen).to(dtype)
        kvs.append(kv)
        first = first_visible(c, window)
        hidden = first if poison == "positions" else first // block_size * block_size
        positions = torch.arange(c + q)
        cache[:, ids[positions // block_size], positions % block_size] = kv
        hidden_positions = positions[:hidden]
        cache[:, ids[hidden_positions // block_size], hidden_positions % block_size] = \
            float("nan")
    num_tokens = sum(q for _, q in requests)
    query = torch.randn(num_tokens, heads, head_size, generator=gen).to(dtype)
    starts = [0]
    for _, q in requests:
        starts.append(starts[-1] + q)
    seq_lens = torch.tensor([c + q for c, q in requests], dtype=torch.int64)
    return query, kvs, cache, table, seq_lens, torch.tensor(starts, dtype=torch.int64)


def dense_attention(query, kvs, requests, scale, window):
    """Float64, one request at a time: for its query row at position p, the softmax over
    exactly the keys j with p - window < j <= p (the others masked out before the softmax,
    so they weigh exactly 0)."""
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
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:start + query_len] = torch.einsum("hqs,shd->qhd", scores.softmax(-1),
                                                    values)
        start += query_len
    return out


def tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


@needs_kernel
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads,kv_heads,head_size,block_size", HEAD_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_and_reference_match_dense(dtype, heads, kv_heads, head_size, block_size,
                                          window):
    query, kvs, cache, table, seq_lens, starts = make_paged(
        REQUESTS, heads, kv_heads, head_size, block_size, dtype, window, "positions")
    scale = 1 / math.sqrt(head_size)
    reqs = torch.arange(len(REQUESTS))
    out = torch.full(query.shape, 7.0, dtype=dtype)
    ref = torch.full(query.shape, 7.0, dtype=dtype)
    cpu_paged_kernel.paged_attention(query, cache, table, seq_lens, starts, reqs, scale, out,
                                     window=window)
    cpu_paged_kernel.paged_attention_reference(query, cache, table, seq_lens, starts, reqs,
                                               scale, ref, window=window)
    dense = dense_attention(query, kvs, REQUESTS, scale, window)
    assert not out.isnan().any() and not ref.isnan().any()
    tol = tolerance(dtype)
    torch.testing.assert_close(ref.double(), dense, atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), dense, atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@needs_kernel
def test_kernel_window_differs_from_full_attention_and_half_precision():
    """The window changes the result when it is shorter than the context (the test above is
    not vacuous), and float16 follows the same contract."""
    query, kvs, cache, table, seq_lens, starts = make_paged(
        REQUESTS, 8, 2, 32, 8, torch.float16, 5, "blocks")
    reqs = torch.arange(len(REQUESTS))
    out = torch.empty(query.shape, dtype=torch.float16)
    cpu_paged_kernel.paged_attention(query, cache, table, seq_lens, starts, reqs, 0.2, out,
                                     window=5)
    torch.testing.assert_close(out.double(), dense_attention(query, kvs, REQUESTS, 0.2, 5),
                               atol=2e-2, rtol=2e-2)
    full = dense_attention(query, kvs, REQUESTS, 0.2, None)
    assert (out.double() - full).abs().max() > 0.1


@needs_kernel
def test_kernel_window_many_threads_and_long_sequences():
    """Long decode contexts (up to ~600 positions) with a short window, many work items."""
    torch.manual_seed(1)
    requests = [(int(c), 1) for c in torch.randint(1, 600, (24,))] + [(300, 33), (0, 70)]
    query, kvs, cache, table, seq_lens, starts = make_paged(
        requests, 14, 2, 64, 16, torch.float32, 37, "positions")
    reqs = torch.arange(len(requests))
    out = torch.empty(query.shape)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(threads, 2))
        cpu_paged_kernel.paged_attention(query, cache, table, seq_lens, starts, reqs, 0.125,
                                         out, window=37)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out.double(), dense_attention(query, kvs, requests, 0.125, 37),
                               atol=1e-5, rtol=1e-5)


@needs_kernel
def test_write_and_attend_window():
    from vllm.attention.backends.cpu_paged_kernel import write_and_attend

    requests = [(21, 1), (0, 9), (12, 6)]
    query, kvs, cache, table, seq_lens, starts = make_paged(
        requests, 6, 2, 16, 4, torch.float32, 4, "positions")
    num_tokens = query.shape[0]
    # The new tokens' K/V come in as rows; their cache slots start empty (zeros).
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
                     table, seq_lens, starts, torch.arange(3), 0.25, out, window=4)
    torch.testing.assert_close(out.view(num_tokens, 6, 16).double(),
                               dense_attention(query, kvs, requests, 0.25, 4), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "8"])
def test_bad_windows_are_rejected_naming_the_value(window):
    with pytest.raises(ValueError, match="sliding_window.*" + repr(window).replace(".", r"\.")):
        check_sliding_window(window)
    with pytest.raises(ValueError, match="positive integer"):
        TorchSDPAImpl(4, 16, 0.25, 2, sliding_window=window)


# --- TorchSDPAImpl: the kernel path and the plain-torch path -------------------------------

class _Layer:
    layer_name = "model.layers.0.self_attn.attn"


def run_impl(dtype, window, heads, kv_heads, head_size, block_size, other_window=None,
             device="cpu"):
    """One mixed batch through TorchSDPAImpl (the new tokens' K/V written by the impl, three
    padding lanes), then a second layer with `other_window` on the same metadata (its own
    cache); returns [output [T, H, D] without padding (on the CPU), dense reference] for
    each. On a device other than the CPU the plain-torch path runs."""
    md, results = None, []
    for w in (window, other_window):
        query, kvs, cache, table, seq_lens, starts = make_paged(
            REQUESTS, heads, kv_heads, head_size, block_size, dtype, w, "blocks", fill=0.0)
        slots, key, value = [], [], []
        for r, (c, n) in enumerate(REQUESTS):
            for p in range(c, c + n):
                slots.append(int(table[r, p // block_size]) * block_size + p % block_size)
                key.append(kvs[r][0, p])
                value.append(kvs[r][1, p])
        num_padding = 3
        num_tokens = len(slots) + num_padding
        if md is None:
            tables = [table[r, :-(-(c + q) // block_size)].tolist()
                      for r, (c, q) in enumerate(REQUESTS)]
            md = TorchSDPAMetadataBuilder().build([q for _, q in REQUESTS],
                                                  [c + q for c, q in REQUESTS], tables, slots,
                                                  num_padded_tokens=num_tokens, device=device)
        pad = torch.zeros(num_padding, kv_heads * head_size, dtype=dtype)
        q2d = torch.cat([query.reshape(len(slots), -1),
                         torch.zeros(num_padding, heads * head_size, dtype=dtype)])
        k2d = torch.cat([torch.stack(key).reshape(len(slots), -1), pad])
        v2d = torch.cat([torch.stack(value).reshape(len(slots), -1), pad])
        scale = 1 / math.sqrt(head_size)
        q2d, k2d, v2d, cache = (t.to(device) for t in (q2d, k2d, v2d, cache))
        impl = TorchSDPAImpl(heads, head_size, scale, kv_heads, sliding_window=w)
        output = torch.full_like(q2d, 5.0)
        impl.forward(_Layer(), q2d, k2d, v2d, cache, md, output)
        output = output.cpu()
        assert (output[len(slots):] == 0).all()  # padding lanes
        results += [output[:len(slots)].view(query.shape),
                    dense_attention(query, kvs, REQUESTS, scale, w)]
    return results


@pytest.mark.parametrize("use_kernel", [
    pytest.param(True, marks=needs_kernel, id="kernel"), pytest.param(False, id="torch")])
@pytest.mark.parametrize("window", [1, 5, 16, 30, 40, 1000])
@pytest.mark.parametrize("heads,kv_heads,head_size,block_size", [(6, 2, 16, 4), (4, 4, 32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_impl_paths_match_dense(dtype, heads, kv_heads, head_size, block_size, window,
                                use_kernel, monkeypatch):
    if not use_kernel:
        monkeypatch.setattr(cpu_paged_kernel, "cpu_paged_attention_available", lambda: False)
    # A layer without a window shares the batch's metadata (cached per-window plans).
    ours, dense, full, dense_full = run_impl(dtype, window, heads, kv_heads, head_size,
                                             block_size, other_window=None)
    tol = tolerance(dtype)
    assert not ours.isnan().any()
    torch.testing.assert_close(ours.double(), dense, atol=tol, rtol=tol)
    torch.testing.assert_close(full.double(), dense_full, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 1, 5, 30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_with_query_groups_folded(dtype, window, monkeypatch):
    """What CUDA runs for masked GQA calls (decode rows, prompts over cached context, windows):
    each key head's query heads folded into the query rows, so that no `enable_gqa` call
    with a mask falls to the math kernel. Forced here on the CPU against the dense reference
    (GQA 3:1)."""
    from vllm.attention.backends import torch_sdpa

    monkeypatch.setattr(cpu_paged_kernel, "cpu_paged_attention_available", lambda: False)
    folded = []
    real = torch_sdpa.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        folded.append(not kwargs.get("enable_gqa", False))
        # Strided as CUDA's memory-efficient kernel returns it: [B, L, heads, hd] in memory.
        return real(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(torch_sdpa, "_fold_query_groups", lambda device: True)
    monkeypatch.setattr(torch_sdpa.F, "scaled_dot_product_attention", spy)
    ours, dense, _, _ = run_impl(dtype, window, 6, 2, 16, 4)
    tol = tolerance(dtype)
    torch.testing.assert_close(ours.double(), dense, atol=tol, rtol=tol)
    assert any(folded)  # the masked calls went through the folded form


def test_torch_path_env_switch(monkeypatch):
    """VLLM_CPU_ATTENTION_KERNEL=0 keeps the kernel unloaded; the window still applies."""
    from vllm.utils import cpu_kernels

    monkeypatch.setenv("VLLM_CPU_ATTENTION_KERNEL", "0")
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    assert not cpu_paged_kernel.cpu_paged_attention_available()
    ours, dense, _, _ = run_impl(torch.float32, 7, 6, 2, 16, 4, other_window=3)
    torch.testing.assert_close(ours.double(), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_on_cuda(dtype):
    ours, dense, full, dense_full = run_impl(dtype, 5, 6, 2, 16, 4, other_window=None,
                                             device="cuda")
    tol = tolerance(dtype)
    torch.testing.assert_close(ours.double(), dense, atol=tol, rtol=tol)
    torch.testing.assert_close(full.double(), dense_full, atol=tol, rtol=tol)


# --- the layer and the selector: a window never goes to a backend that would ignore it -----

class _NoWindowBackend(TorchSDPABackend):
    supports_sliding_window = False

    @staticmethod
    def get_name() -> str:
        return "NO_WINDOW"


def test_layer_and_selector_refuse_backends_without_window_support(monkeypatch):
    from vllm.attention import selector
    from vllm.attention.layer import Attention

    layer = Attention(4, 16, 0.25, num_kv_heads=2, prefix="model.layers.0.self_attn.attn",
                      sliding_window=8)
    assert layer.sliding_window == layer.impl.sliding_window == 8
    assert "sliding_window=8" in repr(layer)
    with pytest.raises(ValueError, match="NO_WINDOW does not support sliding-window"):
        Attention(4, 16, 0.25, num_kv_heads=2, prefix="model.layers.1.self_attn.attn",
                  sliding_window=8, attn_backend=_NoWindowBackend)
    assert Attention(4, 16, 0.25, prefix="model.layers.2.self_attn.attn",
                     attn_backend=_NoWindowBackend).impl.sliding_window is None
    with pytest.raises(ValueError, match=r"sliding_window of 'model.layers.3.self_attn.attn'"
                                         r".*got -2"):
        Attention(4, 16, 0.25, prefix="model.layers.3.self_attn.attn", sliding_window=-2)

    monkeypatch.setitem(selector._BACKENDS, "NO_WINDOW", (__name__, "_NoWindowBackend"))
    assert selector.get_attn_backend(16, backend_name="no_window") is _NoWindowBackend
    with pytest.raises(ValueError, match="NO_WINDOW does not support sliding-window"):
        selector.get_attn_backend(16, backend_name="no_window", sliding_window=8)
    # A default choice (here from VLLM_ATTENTION_BACKEND) that cannot apply the window falls
    # back to TORCH_SDPA (logged).
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "no_window")
    assert selector.get_attn_backend(16) is _NoWindowBackend
    logged = []
    monkeypatch.setattr(selector.logger, "info_once", lambda msg, *a: logged.append(msg % a))
    assert selector.get_attn_backend(16, sliding_window=8) is TorchSDPABackend
    assert logged == ["attention backend NO_WINDOW does not support sliding-window attention: "
                      "layers with a window use TORCH_SDPA"]
