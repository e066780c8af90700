"""The CPU paged-attention kernel against its plain-torch reference: GQA, decode rows,
fresh prompts and chunks with cached context in one batch, padded block-table rows pointing
at the dummy block 0, strided query rows, and a subset of the requests."""
from __future__ import annotations

import math

import pytest
import torch

from vllm.attention.backends.cpu_paged_kernel import (
    cpu_paged_attention_available,
    paged_attention,
    paged_attention_reference,
)

pytestmark = pytest.mark.skipif(not cpu_paged_attention_available(),
                                reason="the CPU paged-attention kernel could not be built")


def make_batch(requests, heads, kv_heads, head_size, block_size, dtype, seed=0):
    """requests: [(context_len, query_len)]. Returns the kernel's inputs; blocks are assigned
    out of order, unused cache blocks and the dummy block 0 hold NaN (a read would show)."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(q for _, q in requests)
    needed = [-(-(c + q) // block_size) for c, q in requests]
    width = max(needed) + 2  # padded rows: the tail entries point at block 0
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_size), float("nan"),
                       dtype=dtype)
    table = torch.zeros(len(requests), width, dtype=torch.int32)
    used = 0
    for r, (c, q) in enumerate(requests):
        ids = order[used:used + needed[r]]
        used += needed[r]
        table[r, :needed[r]] = ids.to(torch.int32)
        kv = torch.randn(2, c + q, kv_heads, head_size, generator=gen).to(dtype)
        for p in range(c + q):
            cache[:, ids[p // block_size], p % block_size] = kv[:, p]
    # A wider projection output whose first H * D columns are the query: strided rows.
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype)
    query = qkv[:, :heads * head_size].view(num_tokens, heads, head_size)
    starts = [0]
    for _, q in requests:
        starts.append(starts[-1] + q)
    seq_lens = torch.tensor([c + q for c, q in requests], dtype=torch.int64)
    return query, cache, table, seq_lens, torch.tensor(starts, dtype=torch.int64)


def on_two_threads(fn, *args):
    """fn(*args) with torch on at least two threads (work items split between them)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(threads, 2))
        fn(*args)
    finally:
        torch.set_num_threads(threads)


def assert_matches_reference(query, cache, table, seq_lens, starts, window=None, cap=None,
                             k_scale=1.0, v_scale=1.0):
    """The kernel on two threads over every request equals the reference (no NaN, no row left
    unwritten), to float32 rounding for a float32 query, else to the query dtype's."""
    reqs = torch.arange(len(seq_lens))
    out = torch.full(query.shape, 7.0, dtype=query.dtype)
    ref = torch.zeros(query.shape, dtype=query.dtype)
    on_two_threads(paged_attention, query, cache, table, seq_lens, starts, reqs, 0.125, out,
                   window, cap, k_scale, v_scale)
    paged_attention_reference(query, cache, table, seq_lens, starts, reqs, 0.125, ref,
                              window, cap, k_scale, v_scale)
    assert not out.isnan().any()
    tol = 1e-5 if query.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_size,block_size",
                         [(4, 4, 16, 4), (14, 2, 64, 16), (8, 1, 32, 8), (4, 2, 128, 16),
                          (6, 3, 80, 16), (4, 2, 40, 16)])
def test_kernel_matches_reference(dtype, heads, kv_heads, head_size, block_size):
    # decode rows, a fresh prompt, chunks with context (one longer than the kernel's
    # 16-row chunk), a 1-token prompt, a block-aligned sequence
    requests = [(9, 1), (0, 7), (5, 3), (30, 1), (13, 40), (0, 1), (2 * block_size - 1, 1)]
    query, cache, table, seq_lens, starts = make_batch(requests, heads, kv_heads, head_size,
                                                       block_size, dtype)
    scale = 1 / math.sqrt(head_size)
    reqs = torch.arange(len(requests))
    out = torch.full(query.shape, 7.0, dtype=dtype)
    ref = torch.zeros(query.shape, dtype=dtype)
    paged_attention(query, cache, table, seq_lens, starts, reqs, scale, out)
    paged_attention_reference(query, cache, table, seq_lens, starts, reqs, scale, ref)
    assert not out.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_size", [(8, 8, 64), (14, 2, 64), (4, 2, 128)])
def test_kernel_decode_rows_long_contexts(dtype, heads, kv_heads, head_size):
    """Decode rows (the two-pass path: few query rows per KV head) over contexts that span
    many blocks, one not block-aligned, next to a short one, on two threads."""
    requests = [(1000, 1), (37, 1), (513, 1), (0, 1), (300, 2)]
    query, cache, table, seq_lens, starts = make_batch(requests, heads, kv_heads, head_size,
                                                       16, dtype, seed=3)
    reqs = torch.arange(len(requests))
    out = torch.full(query.shape, 7.0, dtype=dtype)
    ref = torch.zeros(query.shape, dtype=dtype)
    on_two_threads(paged_attention, query, cache, table, seq_lens, starts, reqs, 0.125, out)
    paged_attention_reference(query, cache, table, seq_lens, starts, reqs, 0.125, ref)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_size", [(8, 8, 64), (14, 2, 64), (4, 2, 128),
                                                      (2, 2, 32)])
@pytest.mark.parametrize("n_requests", [1, 2, 3, 16])
@pytest.mark.parametrize("window,cap", [(None, None), (40, None), (None, 30.0)])
def test_kernel_decode_batches_in_both_read_orders(dtype, heads, kv_heads, head_size,
                                                   n_requests, window, cap):
    """Decode batches of every size on two threads: one or two requests give work items of
    some of the KV heads (read head by head), more give items of whole position rows, which
    the two-pass path reads position by position (cache order), on AVX-512 and AVX2 builds
    alike (vectors of the ISA's width). All match the reference, with a sliding window and
    with logits soft-capping too."""
    lengths = [(37 * i) % 211 + 1 for i in range(n_requests)]
    batch = make_batch([(n, 1) for n in lengths], heads, kv_heads, head_size, 16, dtype,
                       seed=n_requests)
    assert_matches_reference(*batch, window, cap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_size", [(8, 8, 64), (14, 2, 64), (4, 4, 128),
                                                      (6, 3, 80)])
@pytest.mark.parametrize("window,cap", [(None, None), (24, None), (None, 20.0), (24, 20.0)])
def test_kernel_prompt_rows_in_the_lanes(dtype, heads, kv_heads, head_size, window, cap):
    """Items with many rows per KV head (prompts, chunks with context, GQA groups) fold with the
    rows in the vector lanes: row counts that fill the lanes, leave some empty (9, 23 rows) or
    span several groups (GQA), in place (float32) or from widened copies, match the reference
    with a sliding window and soft-capping, in 16- and 32-slot blocks (two 16-key chunks in a
    block). Two threads, so items are split between them."""
    requests = [(0, 9), (0, 40), (17, 23), (100, 33), (3, 1)]
    for block_size in (16, 32):
        query, cache, table, seq_lens, starts = make_batch(requests, heads, kv_heads, head_size,
                                                           block_size, dtype, seed=block_size)
        query = query * 4  # sharp softmax: the running max moves between chunks
        reqs = torch.arange(len(requests))
        out = torch.full(query.shape, 7.0, dtype=dtype)
        ref = torch.zeros(query.shape, dtype=dtype)
        on_two_threads(paged_attention, query, cache, table, seq_lens, starts, reqs, 0.125,
                       out, window, cap)
        paged_attention_reference(query, cache, table, seq_lens, starts, reqs, 0.125, ref,
                                  window, cap)
        assert not out.isnan().any()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_kernel_leaves_unlisted_requests_alone():
    requests = [(3, 1), (0, 5), (6, 1), (4, 2)]
    query, cache, table, seq_lens, starts = make_batch(requests, 4, 2, 16, 4, torch.float32)
    reqs = torch.tensor([0, 2], dtype=torch.int64)
    out = torch.full(query.shape, 7.0)
    ref = torch.full(query.shape, 7.0)
    paged_attention(query, cache, table, seq_lens, starts, reqs, 0.25, out)
    paged_attention_reference(query, cache, table, seq_lens, starts, reqs, 0.25, ref)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (out[1:6] == 7.0).all() and (out[7:] == 7.0).all()


def test_kernel_many_threads_and_long_sequences():
    torch.manual_seed(1)
    requests = [(int(c), 1) for c in torch.randint(1, 300, (24,))] + [(100, 33)]
    query, cache, table, seq_lens, starts = make_batch(requests, 14, 2, 64, 16, torch.float32)
    reqs = torch.arange(len(requests))
    out, ref = torch.empty(query.shape), torch.empty(query.shape)
    on_two_threads(paged_attention, query, cache, table, seq_lens, starts, reqs, 0.125, out)
    paged_attention_reference(query, cache, table, seq_lens, starts, reqs, 0.125, ref)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_kernel_rejects_a_short_block_table():
    query, cache, table, seq_lens, starts = make_batch([(20, 1)], 4, 4, 16, 4, torch.float32)
    with pytest.raises(RuntimeError, match="blocks"):
        paged_attention(query, cache, table[:, :2], seq_lens, starts, torch.tensor([0]), 0.25,
                        torch.empty(query.shape))
    # positions are int32 in the kernel's lanes: a length past that is refused, named
    with pytest.raises(RuntimeError, match="seq_len 2147483648 is over"):
        paged_attention(query, cache, table, torch.tensor([1 << 31]), starts,
                        torch.tensor([0]), 0.25, torch.empty(query.shape))


def test_write_and_attend_writes_then_attends():
    """The fused op equals index_copy_ of the new K/V rows followed by paged_attention, with
    strided q/k/v rows (slices of one projection output) and a padding lane into block 0."""
    from vllm.attention.backends.cpu_paged_kernel import write_and_attend

    heads, kv_heads, head_size, block_size = 6, 2, 16, 4
    requests = [(5, 1), (0, 3), (2, 2)]
    query, cache, table, seq_lens, starts = make_batch(requests, heads, kv_heads, head_size,
                                                       block_size, torch.float32)
    cache = cache.nan_to_num(0.0)
    num_tokens = query.shape[0] + 1  # one padding lane
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_size)
    q = qkv[:, :heads * head_size]
    k = qkv[:, heads * head_size:(heads + kv_heads) * head_size]
    v = qkv[:, (heads + kv_heads) * head_size:]
    slots = []
    for r, (c, n) in enumerate(requests):
        slots += [int(table[r, p // block_size]) * block_size + p % block_size
                  for p in range(c, c + n)]
    slots.append(3)  # the padding lane writes into the dummy block 0
    slots = torch.tensor(slots)
    reqs = torch.arange(len(requests))
    ref_cache = cache.clone()
    flat = ref_cache.view(2, -1, kv_heads, head_size)
    flat[0].index_copy_(0, slots, k.reshape(num_tokens, kv_heads, head_size))
    flat[1].index_copy_(0, slots, v.reshape(num_tokens, kv_heads, head_size))
    ref = torch.zeros(num_tokens, heads, head_size)
    paged_attention_reference(q.reshape(num_tokens, heads, head_size), ref_cache, table,
                              seq_lens, starts, reqs, 0.25, ref)
    out = torch.zeros(num_tokens, heads * head_size)
    write_and_attend(q, k, v, cache, slots, table, seq_lens, starts, reqs, 0.25, out)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out.view(num_tokens, heads, head_size), ref, atol=1e-5,
                               rtol=1e-5)
    with pytest.raises(RuntimeError, match="out of range"):
        write_and_attend(q, k, v, cache, torch.tensor([10**6]), table, seq_lens, starts, reqs,
                         0.25, out)


FLOATS = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("query_dtype,cache_dtype",
                         [(q, c) for q in FLOATS for c in FLOATS if q != c])
@pytest.mark.parametrize("heads,kv_heads,head_size", [(8, 8, 64), (14, 2, 64), (6, 3, 80)])
@pytest.mark.parametrize("requests", [
    [(9, 1), (0, 7), (5, 3), (30, 1), (13, 40), (0, 1), (31, 1)],  # mixed: every path
    [((37 * i) % 211 + 1, 1) for i in range(16)],  # a decode batch: cache order
], ids=["mixed", "decode16"])
@pytest.mark.parametrize("window,cap", [(None, None), (24, 20.0)])
def test_kernel_query_over_a_cache_of_another_dtype(query_dtype, cache_dtype, heads, kv_heads,
                                                    head_size, requests, window, cap):
    """kv_cache_dtype other than the model's (a 16-bit cache under float32 weights, a float32
    one under bfloat16 ...): the query attends over the cache in float32 math (the reference
    widens the same stored values), on every path (decode rows in both read orders, prompt
    rows in the lanes, other head sizes per row), with a window and soft-capping too; out
    has the query's dtype."""
    query, cache, table, seq_lens, starts = make_batch(requests, heads, kv_heads, head_size,
                                                       16, torch.float32, seed=5)
    assert_matches_reference(query.to(query_dtype), cache.to(cache_dtype), table, seq_lens,
                             starts, window, cap)


@pytest.mark.parametrize("dtype,cache_dtype",
                         [(q, c) for q in FLOATS for c in FLOATS if q != c])
def test_write_and_attend_converts_rows_into_a_cache_of_another_dtype(dtype, cache_dtype):
    """q/k/v over a cache of another dtype: the new rows are stored as torch converts them
    (`.to(cache_dtype)`, nearest even), then attended in float32."""
    from vllm.attention.backends.cpu_paged_kernel import write_and_attend

    heads, kv_heads, head_size, block_size = 4, 2, 64, 16
    requests = [(20, 1), (0, 5)]
    query, cache, table, seq_lens, starts = make_batch(requests, heads, kv_heads, head_size,
                                                       block_size, torch.float32, seed=2)
    cache = cache.nan_to_num(0.0).to(cache_dtype)
    tokens = query.shape[0]
    # values that round differently by mode, and one past bfloat16's 8 bits of mantissa
    k = (torch.randn(tokens, kv_heads * head_size) * 3 + 1 / 3).to(dtype)
    v = (torch.randn(tokens, kv_heads * head_size) + 1 + 2 ** -9).to(dtype)
    query = query.to(dtype)
    slots = torch.tensor([int(table[r, p // block_size]) * block_size + p % block_size
                          for r, (c, n) in enumerate(requests) for p in range(c, c + n)])
    reqs = torch.arange(len(requests))
    ref_cache = cache.clone()
    flat = ref_cache.view(2, -1, kv_heads, head_size)
    flat[0].index_copy_(0, slots, k.view(tokens, kv_heads, head_size).to(cache_dtype))
    flat[1].index_copy_(0, slots, v.view(tokens, kv_heads, head_size).to(cache_dtype))
    ref = torch.zeros(query.shape, dtype=dtype)
    paged_attention_reference(query, ref_cache, table, seq_lens, starts, reqs, 0.125, ref)
    q = query.reshape(tokens, heads * head_size)
    out = torch.zeros(tokens, heads * head_size, dtype=dtype)
    write_and_attend(q, k, v, cache, slots, table, seq_lens, starts, reqs, 0.125, out)
    assert torch.equal(cache, ref_cache)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.view(query.shape).float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("query_dtype,cache_dtype", [(torch.float64, torch.float32),
                                                     (torch.float32, torch.float64),
                                                     (torch.float32, torch.int8),
                                                     (torch.float64, torch.float8_e4m3fn)])
def test_kernel_refuses_other_dtype_pairs_by_name(query_dtype, cache_dtype):
    from vllm.attention.backends.cpu_paged_kernel import kernel_takes

    assert not kernel_takes(query_dtype, cache_dtype)
    query, cache, table, seq_lens, starts = make_batch([(3, 1)], 4, 4, 16, 4, query_dtype)
    with pytest.raises(RuntimeError, match="query over a .* cache is not supported"):
        paged_attention(query, cache.to(cache_dtype), table, seq_lens, starts,
                        torch.tensor([0]), 0.25, torch.empty(query.shape, dtype=query_dtype))


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("requests", [
    [(9, 1), (0, 7), (5, 3), (30, 1), (13, 40), (0, 1), (31, 1)],
    [((37 * i) % 211 + 1, 1) for i in range(16)],
], ids=["mixed", "decode16"])
@pytest.mark.parametrize("window,cap", [(None, None), (24, 20.0)])
def test_kernel_over_an_fp8_cache(cache_dtype, query_dtype, requests, window, cap):
    """kv_cache_dtype fp8 / fp8_e5m2: any query dtype over a one-byte cache holding K / k_scale
    and V / v_scale; the kernel multiplies the scales back (the reference reads the same bytes
    widened and scaled) on every path, with a window and soft-capping too."""
    from vllm.attention.backends.cache_storage import to_cache

    query, cache, table, seq_lens, starts = make_batch(requests, 8, 2, 64, 16, torch.float32,
                                                       seed=7)
    k_scale, v_scale = 0.25, 3.0
    stored = torch.stack([to_cache(cache[0] * 2, cache_dtype, k_scale),
                          to_cache(cache[1], cache_dtype, v_scale)])
    assert_matches_reference(query.to(query_dtype), stored, table, seq_lens, starts, window,
                             cap, k_scale, v_scale)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_kernel_decodes_every_fp8_code_exactly(cache_dtype):
    """Every finite byte of the format, read through the kernel's widening (one visible key:
    the output is its V row times v_scale) equals torch's own conversion."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(cache_dtype).float()
    codes[~values.isfinite()] = 0  # NaN / inf codes: never written (writes saturate)
    head_size = 128
    cache = torch.zeros(2, 3, 16, 1, head_size, dtype=cache_dtype)
    table = torch.tensor([[1], [2]], dtype=torch.int32)
    cache.view(torch.uint8)[1, 1, 0, 0] = codes[:128]
    cache.view(torch.uint8)[1, 2, 0, 0] = codes[128:]
    query = torch.randn(2, 4, head_size)
    out = torch.empty(2, 4, head_size)
    paged_attention(query, cache, table, torch.tensor([1, 1]), torch.tensor([0, 1, 2]),
                    torch.arange(2), 0.1, out, k_scale=1.0, v_scale=0.5)
    expected = codes.view(cache_dtype).float().view(2, 1, head_size) * 0.5
    assert torch.equal(out, expected.expand(2, 4, head_size))


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_and_attend_stores_scaled_saturated_fp8(cache_dtype, dtype):
    """New rows go into an FP8 cache as `to_cache` stores them: divided by the scale, rounded
    to nearest even, values past the format's range saturated (not inf / NaN)."""
    from vllm.attention.backends.cache_storage import to_cache
    from vllm.attention.backends.cpu_paged_kernel import write_and_attend

    heads, kv_heads, head_size, block_size = 4, 2, 64, 16
    requests = [(20, 1), (0, 5)]
    query, cache, table, seq_lens, starts = make_batch(requests, heads, kv_heads, head_size,
                                                       block_size, torch.float32, seed=4)
    k_scale, v_scale = 0.5, 2.0
    cache = to_cache(cache.nan_to_num(0.0), cache_dtype)
    tokens = query.shape[0]
    k = (torch.randn(tokens, kv_heads * head_size) * 4).to(dtype)
    k[0, :4] = torch.tensor([1e5, -1e5, 300.0, -250.0])  # past e4m3's 448 once divided
    v = torch.randn(tokens, kv_heads * head_size).to(dtype)
    slots = torch.tensor([int(table[r, p // block_size]) * block_size + p % block_size
                          for r, (c, n) in enumerate(requests) for p in range(c, c + n)])
    reqs = torch.arange(len(requests))
    ref_cache = cache.clone()
    flat = ref_cache.view(torch.uint8).view(2, -1, kv_heads, head_size)
    flat[0].index_copy_(0, slots, to_cache(k.view(tokens, kv_heads, head_size), cache_dtype,
                                           k_scale).view(torch.uint8))
    flat[1].index_copy_(0, slots, to_cache(v.view(tokens, kv_heads, head_size), cache_dtype,
                                           v_scale).view(torch.uint8))
    ref = torch.zeros(query.shape, dtype=dtype)
    query = query.to(dtype)
    paged_attention_reference(query, ref_cache, table, seq_lens, starts, reqs, 0.125, ref,
                              k_scale=k_scale, v_scale=v_scale)
    out = torch.zeros(tokens, heads * head_size, dtype=dtype)
    write_and_attend(query.reshape(tokens, -1), k, v, cache, slots, table, seq_lens, starts,
                     reqs, 0.125, out, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    assert cache.float().isfinite().all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.view(query.shape).float(), ref.float(), atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="k_scale and v_scale must be positive"):
        write_and_attend(query.reshape(tokens, -1), k, v, cache, slots, table, seq_lens,
                         starts, reqs, 0.125, out, k_scale=0.0)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_fp8_writes_round_as_torch_does(cache_dtype, scale):
    """The kernel's own (vectorized) conversion into an FP8 cache gives torch's bytes for every
    representable value, the midpoints between neighbours (ties to even) and a hair either
    side, subnormals, values past the range (saturated), tiny ones and NaN of either sign."""
    from vllm.attention.backends.cache_storage import to_cache
    from vllm.attention.backends.cpu_paged_kernel import write_and_attend

    codes = torch.arange(256, dtype=torch.uint8).view(cache_dtype).float()
    codes = codes[codes.isfinite()].unique()
    mids = (codes[1:] + codes[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([codes, mids, torch.nextafter(mids, torch.tensor(1e9)),
                        torch.nextafter(mids, torch.tensor(-1e9)),
                        torch.randn(3000, generator=gen) * 50,
                        torch.randn(1000, generator=gen) * 1e-3,
                        torch.randn(1000, generator=gen) * 1e-5,
                        torch.tensor([1e6, -1e6, float("nan"), -float("nan"), 1e-30, -1e-30])])
    # rows of 40 (a head size of 40): two 16-value vectors and a scalar tail of 8 each
    rows = torch.cat([values, torch.zeros(-values.numel() % 40)]).view(-1, 40)
    n = rows.shape[0]
    cache = torch.zeros(2, n + 1, 1, 1, 40, dtype=cache_dtype)
    write_and_attend(torch.randn(n, 40), rows, rows.clone(), cache, torch.arange(1, n + 1),
                     torch.arange(1, n + 1, dtype=torch.int32).view(n, 1),
                     torch.ones(n, dtype=torch.long), torch.arange(n + 1), torch.arange(n),
                     0.1, torch.empty(n, 40), k_scale=scale, v_scale=scale)
    expected = to_cache(rows, cache_dtype, scale).view(torch.uint8)
    assert torch.equal(cache[0, 1:, 0, 0].view(torch.uint8), expected)
    assert torch.equal(cache[1, 1:, 0, 0].view(torch.uint8), expected)
