"""Paged decode attention in Triton: one query token per row, everything read from device
memory, so one launch can be captured in a CUDA graph and replayed for any batch of that size.

The kernel reads each row's sequence length and block-table row from tensors (not from host
lists), loops over the row's blocks with an online softmax, and handles a grouped-query layer
by giving each program the query heads of one KV head (a sliding window and logits
soft-capping are options; the soft-cap is a constexpr flag, so an uncapped layer compiles the
kernel without it). A row whose sequence length is 0 (a padding lane of a captured batch)
writes zeros.

On CUDA the kernel is compiled by Triton. On the CPU it runs in Triton's interpreter, when
`TRITON_INTERPRET=1` was set before Triton was imported (for tests on machines without a GPU:
slow, but the same kernel code). Import this module only where Triton is installed.
"""
import os

import torch
import triton
import triton.language as tl

from vllm.attention.backends.abstract import check_logits_soft_cap


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, block_table_ptr, seq_lens_ptr, scale,
                         v_scale,
                         stride_q_row, stride_q_head, stride_o_row, stride_o_head,
                         stride_table_row, stride_k_block, stride_k_slot, stride_k_head, window,
                         soft_cap, SOFT_CAP: tl.constexpr, GROUP: tl.constexpr,
                         GROUP_P2: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_P2: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_P2: tl.constexpr):
    """One program: one row (query token) x one KV head (its GROUP query heads). SOFT_CAP:
    scores become soft_cap * tanh(score / soft_cap) before the mask."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_P2)
    s = tl.arange(0, BLOCK_P2)
    g_ok = g < GROUP
    d_ok = d < HEAD_SIZE
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m = tl.full([GROUP_P2], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_P2], tl.float32)
    # The query sits at position seq_len - 1; with a window W it sees positions >= seq_len - W.
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    for b in range(start // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_table_ptr + row * stride_table_row + b).to(tl.int64)
        pos = b * BLOCK_SIZE + s
        visible = (s < BLOCK_SIZE) & (pos < seq_len) & (pos >= start)
        offsets = (block * stride_k_block + s[:, None] * stride_k_slot
                   + kv_head * stride_k_head + d[None, :])
        kv_mask = visible[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_P2, BLOCK_P2]
        if SOFT_CAP:
            # tanh through exp (triton.language has no tanh): with t = e^(-2|y|) in (0, 1],
            # tanh|y| = (1 - t) / (1 + t), which never overflows; its rounding (an ulp of 1)
            # is below a float32 score's own once multiplied by the cap.
            y = scores / soft_cap
            t = tl.exp(-2.0 * tl.abs(y))
            th = (1.0 - t) / (1.0 + t)
            scores = tl.where(y < 0, -th, th) * soft_cap
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    result = tl.where(denom[:, None] > 0, acc * v_scale / tl.maximum(denom, 1e-30)[:, None],
                      0.0)
    tl.store(out_ptr + row * stride_o_row + heads[:, None] * stride_o_head + d[None, :],
             result.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def interpreter_on() -> bool:
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _p2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                 window: int | None = None, soft_cap: float | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """out[i] = attention of query row i (its token at position seq_lens[i] - 1) over the
    first seq_lens[i] positions of its paged K/V (with a sliding window W only the last W;
    with a `soft_cap` c each scaled score s becomes c * tanh(s / c) before the softmax).
    The cache holds K / k_scale and V / v_scale (an FP8 cache's scales; 1.0 otherwise).

    query/out [N, H, D] (head and channel dims dense; rows may be strided), kv_cache
    [2, num_blocks, block_size, KVH, D] contiguous, block_table [>= N, max_blocks] int32 with
    unit column stride, seq_lens [>= N] int32/int64 (0: the row is padding, written as zeros).
    Nothing is read back to the host: the launch is CUDA-graph safe."""
    rows, heads, head_size = query.shape
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if rows == 0:
        return
    if query.stride(2) != 1 or out.stride(2) != 1 or block_table.stride(1) != 1:
        raise ValueError("paged_decode: query/out channels and block-table columns must be "
                         "dense")
    if not kv_cache.is_contiguous():
        raise ValueError("paged_decode: the KV cache must be contiguous")
    if query.device.type == "cpu" and not interpreter_on():
        raise RuntimeError("paged_decode on CPU tensors needs Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before Triton is imported")
    soft_cap = check_logits_soft_cap(soft_cap, "soft_cap")
    group = heads // kv_heads
    keys, values = kv_cache[0], kv_cache[1]
    _paged_decode_kernel[(rows, kv_heads)](
        query, keys, values, out, block_table, seq_lens, float(scale) * k_scale, float(v_scale),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        keys.stride(0), keys.stride(1), keys.stride(2), int(window or 0),
        soft_cap or 0.0, SOFT_CAP=soft_cap is not None, GROUP=group, GROUP_P2=_p2(group),
        HEAD_SIZE=head_size, HEAD_P2=_p2(head_size), BLOCK_SIZE=block_size,
        BLOCK_P2=_p2(block_size))
