"""The CPU paged-attention kernel (vllm/attention/csrc/cpu_paged_attention.cpp): build, load,
call, and its plain-torch reference.

    if cpu_paged_attention_available():
        paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, req_indices,
                        scale, out, window=None, soft_cap=None)

The kernel reads each request's K/V straight from the paged cache (no gather into a padded
copy) and handles decode rows and chunks with cached context alike; `window` (a sliding
window W: query position p sees keys p - W < j <= p, as transformers masks them; None = the
whole causal context) skips the blocks no row can see; `soft_cap` (logits soft-capping c:
each scaled score s becomes c * tanh(s / c) before the mask and softmax; None = none) is
applied in the kernel's score loop. See the C++ file for the contract.
It is built at first use, once per machine, and cached under the vllm cache root
(vllm/utils/cpu_kernels.py; the cache key hashes the source, so an edited kernel is rebuilt);
when the build fails the failure is logged once and callers keep their plain-torch path.
Set VLLM_CPU_ATTENTION_KERNEL=0 to never build or load it.
"""
from __future__ import annotations

import os

import torch

from vllm.attention.backends.abstract import check_logits_soft_cap, check_sliding_window
from vllm.attention.backends.cache_storage import FP8_CACHE_DTYPES
from vllm.utils.cpu_kernels import load_cpu_extension

_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc",
                       "cpu_paged_attention.cpp")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_takes(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the kernel computes a `query_dtype` query over a `cache_dtype` KV cache: any of
    SUPPORTED_DTYPES over any of them or an FP8 cache (kv_cache_dtype may differ from the
    model's dtype). The math is float32 throughout."""
    return query_dtype in SUPPORTED_DTYPES and (cache_dtype in SUPPORTED_DTYPES
                                                or cache_dtype in FP8_CACHE_DTYPES)


def cpu_paged_attention_available() -> bool:
    """Build (first call on this machine) and load the kernel; True when
    `torch.ops.vllm_cpu_attn.paged_attention` is usable. Thread-safe; one try per process."""
    return load_cpu_extension("paged_attention", _SOURCE, "VLLM_CPU_ATTENTION_KERNEL")


def window_arg(window: int | None) -> int:
    """The kernels' int window argument: 0 = no window."""
    return check_sliding_window(window, "window") or 0


def soft_cap_arg(soft_cap: float | None) -> float:
    """The kernels' float soft-cap argument: 0.0 = none."""
    return check_logits_soft_cap(soft_cap, "soft_cap") or 0.0


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    req_indices: torch.Tensor, scale: float, out: torch.Tensor,
                    window: int | None = None, soft_cap: float | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Attention of the listed requests' query rows over their paged K/V, written into `out`.

    query/out [T, H, D] (channel dim dense), kv_cache [2, num_blocks, block_size, KVH, D]
    contiguous, of a dtype `kernel_takes` under the query's, block_table [R, max_blocks]
    int32, seq_lens [R] int64, query_start_loc [R + 1] int64, req_indices [n] int64, window:
    a sliding window (None: none), soft_cap: logits soft-capping (None: none); the cache
    holds K / k_scale and V / v_scale (an FP8 cache's scales). Needs
    `cpu_paged_attention_available()`."""
    torch.ops.vllm_cpu_attn.paged_attention(query, kv_cache, block_table, seq_lens,
                                            query_start_loc, req_indices, scale, out,
                                            window_arg(window), soft_cap_arg(soft_cap),
                                            k_scale, v_scale)


def write_and_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, req_indices: torch.Tensor, scale: float,
                     out: torch.Tensor, window: int | None = None,
                     soft_cap: float | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> None:
    """Write key/value rows 0..len(slot_mapping)-1 into the cache by slot, then
    `paged_attention`. query/out [T, H * D], key/value [T, KVH * D] (row-strided is fine),
    all of one dtype, the cache's or one `kernel_takes` it under (rows are then rounded to
    the cache's dtype, to nearest even; into an FP8 cache divided by k_scale / v_scale first
    and saturated, as `cache_storage.to_cache` stores them); slot_mapping int64. Needs
    `cpu_paged_attention_available()`."""
    torch.ops.vllm_cpu_attn.write_and_attend(query, key, value, kv_cache, slot_mapping,
                                             block_table, seq_lens, query_start_loc,
                                             req_indices, scale, out, window_arg(window),
                                             soft_cap_arg(soft_cap), k_scale, v_scale)


def paged_attention_reference(query: torch.Tensor, kv_cache: torch.Tensor,
                              block_table: torch.Tensor, seq_lens: torch.Tensor,
                              query_start_loc: torch.Tensor, req_indices: torch.Tensor,
                              scale: float, out: torch.Tensor,
                              window: int | None = None,
                              soft_cap: float | None = None, k_scale: float = 1.0,
                              v_scale: float = 1.0) -> None:
    """The kernel's contract in plain torch (one request at a time, float32 math): query row
    i of a request with `context` cached tokens sits at position p = context + i and sees the
    keys at positions j <= p, and with a sliding window W only those with j > p - W; with a
    `soft_cap` c each scaled score s becomes c * tanh(s / c) before the mask and softmax; the
    cached K and V are multiplied by k_scale and v_scale."""
    window = window_arg(window)
    soft_cap = check_logits_soft_cap(soft_cap, "soft_cap")
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = query.shape[1] // kv_heads
    for r in req_indices.tolist():
        start, end = int(query_start_loc[r]), int(query_start_loc[r + 1])
        seq_len, query_len = int(seq_lens[r]), end - start
        if query_len == 0:
            continue
        context = seq_len - query_len
        # Keys before the first row's window are visible to no row: never read (like the
        # kernel, which skips their blocks).
        first = max(0, context - window + 1) if window else 0
        positions = torch.arange(first, seq_len)
        blocks = block_table[r].long()[positions // block_size]
        keys = kv_cache[0, blocks, positions % block_size].float() * k_scale  # [S, KVH, D]
        values = kv_cache[1, blocks, positions % block_size].float() * v_scale
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[start:end].float().transpose(0, 1)  # [H, ql, D]
        scores = q @ keys.transpose(1, 2) * scale  # [H, ql, S - first]
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        rows = (torch.arange(query_len) + context).unsqueeze(1)
        visible = positions.unsqueeze(0) <= rows
        if window:
            visible &= positions.unsqueeze(0) > rows - window
        scores = scores.masked_fill(~visible, float("-inf"))
        result = scores.softmax(dim=-1) @ values  # [H, ql, D]
        out[start:end] = result.transpose(0, 1).to(out.dtype)
