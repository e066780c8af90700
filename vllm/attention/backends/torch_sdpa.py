"""Paged attention on PyTorch: write K/V by slot index, then attend over the paged cache.

Runs on any device torch runs on. KV cache of one layer: [2, num_blocks, block_size,
num_kv_heads, head_size]. Block 0 is the engine's reserved dummy block: padding lanes write
there and padded block-table entries point there; no live query ever reads it (every read is
masked by the request's sequence length).

On the CPU, when the C++ kernel of cpu_paged_kernel.py is built, one call per layer computes
every request (decode rows, fresh prompts and chunks with context) straight from the paged
cache, whose dtype may differ from the model's (kv_cache_dtype: float32, bfloat16, float16 or
FP8; cache_storage.py says what each holds). Elsewhere, or when the kernel cannot serve the
batch (a build failure, another dtype), the plain-torch path runs.

Plain-torch strategy (the op is opaque to Dynamo, so host-side lists may steer it):
- decode requests (one query token) are batched: their blocks are gathered into
  [B, max_len, kv_heads, head_size] and attended with a length mask in one SDPA call;
- other requests run one SDPA call each: a fresh prompt (no cached context) attends to its
  own K/V with `is_causal`; a chunk with cached context reads the cache with an offset mask
  (query i at absolute position context_len + i sees cache positions <= context_len + i).

Sliding window (the layer's `sliding_window` W, as transformers masks it): the query at
position p sees only keys p - W < j <= p. Both paths apply it; the torch path then gathers only
the blocks that hold some visible key (decode rows read each request's table from the block
of its window's start), so long contexts read no more than the window's blocks.

Logits soft-capping (the layer's `logits_soft_cap` c, Gemma 2): each scaled score s becomes
c * tanh(s / c) before the mask and the softmax. SDPA has no such option, so on the torch path
a capped layer's calls are spelled out in float32 (matmul, cap, mask, softmax, matmul), in
chunks of query rows that bound the scores' memory; a layer without a cap keeps SDPA.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vllm.attention.backends import cpu_paged_kernel
from vllm.attention.backends.abstract import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
)
from vllm.attention.backends.cache_storage import byte_view, from_cache, kv_scales, to_cache

DUMMY_BLOCK_ID = 0


@dataclass
class TorchSDPAMetadata(AttentionMetadata):
    num_actual_tokens: int
    """Tokens of the batch before padding (lanes past it are padding)."""
    num_reqs: int
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int64: cumulative query lengths (request i's tokens are
    query_start_loc[i]:query_start_loc[i+1])."""
    seq_lens: torch.Tensor
    """[num_reqs] int64: cached context + new tokens of each request."""
    block_table: torch.Tensor
    """[num_reqs, max_blocks_per_req] int32/int64, rows padded with the dummy block 0."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64: block_id * block_size + offset; padding lanes point into block 0."""
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    _plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Device index tensors derived once per batch and shared by all layers."""


class TorchSDPAMetadataBuilder(AttentionMetadataBuilder):
    """Builds TorchSDPAMetadata from the scheduler's per-request host lists."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def build(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              slot_mapping: list[int], num_padded_tokens: int | None = None,
              device: torch.device | str = "cpu") -> TorchSDPAMetadata:
        num_reqs = len(query_lens)
        if len(seq_lens) != num_reqs or len(block_tables) != num_reqs:
            raise ValueError(f"query_lens ({num_reqs}), seq_lens ({len(seq_lens)}) and "
                             f"block_tables ({len(block_tables)}) must have one entry per request")
        for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
            if q < 0 or s < q:
                raise ValueError(f"request {i}: query_len {q} and seq_len {s} must satisfy "
                                 "0 <= query_len <= seq_len")
        num_actual = sum(query_lens)
        if len(slot_mapping) != num_actual:
            raise ValueError(f"slot_mapping has {len(slot_mapping)} entries for {num_actual} "
                             "tokens")
        num_tokens = num_actual if num_padded_tokens is None else num_padded_tokens
        if num_tokens < num_actual:
            raise ValueError(f"num_padded_tokens ({num_tokens}) is smaller than the number of "
                             f"tokens ({num_actual})")
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        width = max([len(row) for row in block_tables] + [1])
        table = [list(row) + [DUMMY_BLOCK_ID] * (width - len(row)) for row in block_tables]
        slots = list(slot_mapping) + [DUMMY_BLOCK_ID] * (num_tokens - num_actual)
        device = None if torch.device(device).type == "cpu" else device
        return TorchSDPAMetadata(
            num_actual_tokens=num_actual, num_reqs=num_reqs,
            query_start_loc=_tensor(starts, np.int64, device),
            seq_lens=_tensor(seq_lens, np.int64, device),
            block_table=_tensor(table, np.int32, device).view(num_reqs, width),
            slot_mapping=_tensor(slots, np.int64, device),
            max_query_len=max(query_lens, default=0), max_seq_len=max(seq_lens, default=0),
            query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))


def _tensor(values: list, dtype: type, device: torch.device | str | None) -> torch.Tensor:
    """A tensor of host ints (copied to `device` unless None); through numpy, which takes
    ~0.8 us where torch.tensor() takes ~2.2 (four per step)."""
    host = torch.from_numpy(np.asarray(values, dtype=dtype))
    return host if device is None else host.to(device)


@dataclass
class _DecodePlan:
    token_index: torch.Tensor | slice  # rows of q/output holding the decode tokens
    block_table: torch.Tensor  # [B, blocks] int64: the blocks each decode row reads
    mask: torch.Tensor  # [B, 1, 1, blocks * block_size] bool


@dataclass
class _Plan:
    decode: _DecodePlan | None
    others: list[tuple[int, int, int, int]]  # (request, start, query_len, seq_len), q_len > 1


def _make_plan(md: TorchSDPAMetadata, block_size: int, device: torch.device,
               window: int | None = None) -> _Plan:
    """Host-side plan of one batch for one (block size, sliding window); shared by the layers
    with that window."""
    starts = [0]
    for q in md.query_lens_cpu:
        starts.append(starts[-1] + q)
    decodes = [i for i, q in enumerate(md.query_lens_cpu) if q == 1]
    others = [(i, starts[i], q, md.seq_lens_cpu[i]) for i, q in enumerate(md.query_lens_cpu)
              if q > 1]
    decode = None
    if decodes:
        num_blocks = -(-max(md.seq_lens_cpu[i] for i in decodes) // block_size)
        tokens = [starts[i] for i in decodes]
        if tokens == list(range(tokens[0], tokens[0] + len(tokens))):
            token_index: torch.Tensor | slice = slice(tokens[0], tokens[0] + len(tokens))
        else:
            token_index = torch.tensor(tokens, dtype=torch.int64, device=device)
        if decodes == list(range(len(decodes))):
            table = md.block_table[:len(decodes), :num_blocks]
            lens = md.seq_lens[:len(decodes)]
        else:
            reqs = torch.tensor(decodes, dtype=torch.int64, device=device)
            table = md.block_table[reqs, :num_blocks]
            lens = md.seq_lens[reqs]
        if window is None:
            positions = torch.arange(num_blocks * block_size, device=device)
            mask = (positions.unsqueeze(0) < lens.unsqueeze(1)).view(len(decodes), 1, 1, -1)
        else:
            # Row b (position lens[b] - 1) sees positions lens[b] - window .. lens[b] - 1: read
            # its table from the block of the first one, as many blocks as the widest needs.
            first = [max(0, md.seq_lens_cpu[i] - window) for i in decodes]
            first_block = [f // block_size for f in first]
            width = max(-(-md.seq_lens_cpu[i] // block_size) - b
                        for i, b in zip(decodes, first_block))
            # Columns past a row's last block are clamped into the table (masked anyway).
            columns = (torch.tensor(first_block, dtype=torch.int64, device=device).unsqueeze(1)
                       + torch.arange(width, device=device)).clamp_(max=table.shape[1] - 1)
            table = table.gather(1, columns)
            positions = (columns[:, :1] * block_size
                         + torch.arange(width * block_size, device=device))
            low = torch.tensor(first, dtype=torch.int64, device=device).unsqueeze(1)
            mask = ((positions >= low) & (positions < lens.unsqueeze(1))).view(
                len(decodes), 1, 1, -1)
        decode = _DecodePlan(token_index, table.to(torch.int64), mask)
    return _Plan(decode, others)


class TorchSDPAImpl(AttentionImpl):
    """`sliding_window` (AttentionImpl): W or None, applied on both the kernel and the torch
    path."""

    # What `forward` checks once per KV-cache tensor and input dtypes rather than per call: it
    # runs once per layer per step, where each Python check costs more than it would warm
    # (the step's weight stream has evicted the objects it reads). The cache tensors are held
    # weakly: a cache the engine lets go of is freed.
    _checked_cache: Callable[[], torch.Tensor | None] = staticmethod(lambda: None)
    _kernel_cache: Callable[[], torch.Tensor | None] = staticmethod(lambda: None)
    _kernel_dtypes: tuple[torch.dtype, ...] | None = None
    _kernel_ok = False

    def _check_cache(self, layer: Any, kv_cache: torch.Tensor) -> None:
        if kv_cache.numel() == 0:
            raise RuntimeError(f"attention layer {getattr(layer, 'layer_name', '?')!r} has no KV "
                               "cache: bind one with vllm.attention.layer.bind_kv_cache()")
        if not kv_cache.is_contiguous():
            raise ValueError("the KV cache tensor must be contiguous "
                             "[2, num_blocks, block_size, num_kv_heads, head_size]")
        self._checked_cache = weakref.ref(kv_cache)

    def _kernel_serves(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, md: TorchSDPAMetadata) -> bool:
        """Whether the C++ kernel (`cpu_paged_kernel.write_and_attend`) computes this call:
        CPU tensors of one dtype over a cache the kernel takes (`kernel_takes`) and an int32
        block table. Decided once per cache tensor and input dtypes; the kernel's arguments
        that never change are made then."""
        dtypes = (query.dtype, key.dtype, value.dtype, md.block_table.dtype)
        if kv_cache is not self._kernel_cache() or dtypes != self._kernel_dtypes:
            self._kernel_ok = (query.device.type == "cpu" and key.dtype == query.dtype
                               and value.dtype == query.dtype
                               and cpu_paged_kernel.kernel_takes(query.dtype, kv_cache.dtype)
                               and md.block_table.dtype == torch.int32
                               and cpu_paged_kernel.cpu_paged_attention_available())
            if self._kernel_ok:
                self._kernel_op = torch.ops.vllm_cpu_attn.write_and_attend
                self._kernel_window = cpu_paged_kernel.window_arg(self.sliding_window)
                self._kernel_soft_cap = cpu_paged_kernel.soft_cap_arg(self.logits_soft_cap)
            self._kernel_cache, self._kernel_dtypes = weakref.ref(kv_cache), dtypes
        return self._kernel_ok

    @classmethod
    def fused_output_quant_supported(cls, quant_dtype: torch.dtype, static: bool,
                                     per_tensor: bool) -> bool:
        # Each result is copied into `output` anyway: quantizing replaces that copy.
        return quant_dtype == torch.float8_e4m3fn and static and per_tensor

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: TorchSDPAMetadata,
                output: torch.Tensor, output_scale: torch.Tensor | None = None) -> torch.Tensor:
        """`output_scale`: `output` is float8_e4m3fn, written quantized with this scale."""
        md = attn_metadata
        self._output_scale = output_scale
        num_tokens = query.shape[0]
        if kv_cache is not self._checked_cache():
            self._check_cache(layer, kv_cache)
        num_slots = min(num_tokens, md.slot_mapping.shape[0])
        slots = md.slot_mapping if num_slots == md.slot_mapping.shape[0] else \
            md.slot_mapping[:num_slots]

        if self._kernel_serves(query, key, value, kv_cache, md):
            # One C++ call writes the new K/V and attends for every request.
            requests = md._plans.get("all_requests")
            if requests is None:
                requests = md._plans["all_requests"] = torch.arange(md.num_reqs)
            # An FP8 output is quantized from a result in the query's dtype, as the unfused
            # graph (attention, then the quant op) would compute it.
            result = output if output_scale is None else torch.empty_like(query)
            self._kernel_op(query, key, value, kv_cache, slots, md.block_table, md.seq_lens,
                            md.query_start_loc, requests, self.scale, result,
                            self._kernel_window, self._kernel_soft_cap,
                            *kv_scales(layer, kv_cache))
            if md.num_actual_tokens < num_tokens:
                result[md.num_actual_tokens:].zero_()
            if output_scale is not None:
                output.copy_(self._to_output(result))
            return output

        heads, kv_heads, head_size = self.num_heads, self.num_kv_heads, self.head_size
        q = query.view(num_tokens, heads, head_size)
        k = key.view(num_tokens, kv_heads, head_size)
        v = value.view(num_tokens, kv_heads, head_size)
        out = output.view(num_tokens, heads, head_size)
        _, num_blocks, block_size = kv_cache.shape[:3]
        scales = kv_scales(layer, kv_cache)
        # (through byte views: index_copy_ has no float8 kernel)
        flat_cache = byte_view(kv_cache).view(2, num_blocks * block_size, kv_heads, -1)
        for i, (rows, scale) in enumerate(zip((k, v), scales)):
            new = to_cache(rows[:num_slots], kv_cache.dtype, scale)
            flat_cache[i].index_copy_(0, slots, byte_view(new))
        if md.num_actual_tokens < num_tokens:
            out[md.num_actual_tokens:].zero_()

        window = self.sliding_window
        plan = md._plans.get((block_size, window))
        if plan is None:
            plan = md._plans[(block_size, window)] = _make_plan(md, block_size, query.device,
                                                                window)
        gqa = heads != kv_heads
        if plan.decode is not None:
            self._decode(q, out, kv_cache, plan.decode, gqa, scales)
        for req, start, query_len, seq_len in plan.others:
            self._prefill(q, k, v, out, kv_cache, md, req, start, query_len, seq_len, gqa,
                          scales)
        return output

    def _decode(self, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                plan: _DecodePlan, gqa: bool, scales: tuple[float, float]) -> None:
        batch, num_blocks = plan.block_table.shape
        block_size = kv_cache.shape[2]
        # One index_select over whole blocks (rows of K and V together) is ~2x faster on the
        # CPU than advanced indexing of the 5-D cache.
        gathered = _gather_blocks(kv_cache, plan.block_table.flatten()).view(
            2, batch, num_blocks * block_size, self.num_kv_heads, self.head_size)
        # [B, kv_heads, max_len, hd]
        keys = from_cache(gathered[0].transpose(1, 2), q.dtype, scales[0])
        values = from_cache(gathered[1].transpose(1, 2), q.dtype, scales[1])
        queries = q[plan.token_index].unsqueeze(2)  # [B, heads, 1, hd]
        result = _sdpa(queries, keys, values, plan.mask, False, self.scale, gqa,
                       self.logits_soft_cap)
        out[plan.token_index] = self._to_output(result.squeeze(2))

    def _prefill(self, q, k, v, out, kv_cache, md, req, start, query_len, seq_len,
                 gqa, scales) -> None:
        end = start + query_len
        queries = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, ql, hd]
        context_len = seq_len - query_len
        window = self.sliding_window
        if window is not None and window >= seq_len:
            window = None  # every row's window covers all of its causal context
        if context_len == 0 and window is None:
            keys, values = k[start:end], v[start:end]
            mask, causal = None, True
        else:
            rows = torch.arange(query_len, device=q.device).unsqueeze(1) + context_len
            # The first block holding a key of the first row's window (0 without a window).
            block_size = kv_cache.shape[2]
            first_block = 0 if window is None else max(0, context_len - window + 1) // block_size
            key0 = first_block * block_size  # position of the first key read
            if context_len == 0:
                keys, values = k[start:end], v[start:end]
            else:
                num_blocks = -(-seq_len // block_size)
                blocks = md.block_table[req, first_block:num_blocks].to(torch.int64)
                gathered = _gather_blocks(kv_cache, blocks).view(
                    2, -1, self.num_kv_heads, self.head_size)[:, :seq_len - key0]
                keys = from_cache(gathered[0], q.dtype, scales[0])
                values = from_cache(gathered[1], q.dtype, scales[1])
            positions = torch.arange(key0, seq_len, device=q.device).unsqueeze(0)
            mask = positions <= rows
            if window is not None:
                mask &= positions > rows - window
            causal = False
        result = _sdpa(queries, keys.transpose(0, 1).unsqueeze(0).to(q.dtype),
                       values.transpose(0, 1).unsqueeze(0).to(q.dtype), mask, causal,
                       self.scale, gqa, self.logits_soft_cap)
        out[start:end] = self._to_output(result.squeeze(0).transpose(0, 1))

    def _to_output(self, result: torch.Tensor) -> torch.Tensor:
        scale = getattr(self, "_output_scale", None)
        if scale is None:
            return result
        import vllm.model_executor.kernels.fp8_ops  # noqa: F401  (defines the op)

        return torch.ops.vllm.static_scaled_fp8_quant(result.contiguous(), scale)


def _fold_query_groups(device: torch.device) -> bool:
    """CUDA: of torch's SDPA kernels, flash takes no mask and memory-efficient no
    `enable_gqa`, so a masked GQA call falls to the math kernel (float32 scores of every
    head, K/V copied per head: gigabytes at long contexts). Folding each key head's group of
    query heads into the query rows makes it a plain masked call."""
    return device.type == "cuda"


def _sdpa(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
          mask: torch.Tensor | None, causal: bool, scale: float, gqa: bool,
          soft_cap: float | None = None) -> torch.Tensor:
    """SDPA of queries [B, heads, L, hd] over keys / values [B, kv_heads, S, hd]; `mask`
    [..., L, S] (broadcast over batch and heads) or `causal`; `soft_cap` c: scores
    c * tanh(s / c) (SDPA has no such option: computed explicitly)."""
    if soft_cap is not None:
        return _soft_capped_attention(queries, keys, values, mask, causal, scale, soft_cap)
    if not (gqa and mask is not None and _fold_query_groups(queries.device)):
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                              is_causal=causal, scale=scale, enable_gqa=gqa)
    batch, heads, rows, head_size = queries.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    # Query head h reads key head h // group: [B, kv_heads, group * L, hd], one mask row
    # per (query head of the group, query row).
    folded = queries.reshape(batch, kv_heads, group * rows, head_size)
    mask = mask.expand(*mask.shape[:-2], rows, mask.shape[-1])
    mask = mask.repeat(*([1] * (mask.dim() - 2)), group, 1)
    result = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
    # CUDA's memory-efficient kernel returns [B, kv_heads, group * L, hd] strided as
    # [B, group * L, kv_heads, hd]: no view splits its rows.
    return result.reshape(batch, heads, rows, head_size)


# Float32 score elements one explicit soft-capped call materialises at most (x4 bytes, and a
# few temporaries of that size): longer calls are split into chunks of query rows.
_SCORE_BUDGET = 1 << 24


def _soft_capped_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           mask: torch.Tensor | None, causal: bool, scale: float,
                           cap: float) -> torch.Tensor:
    """`_sdpa` with soft-capped scores, spelled out in float32: scores = scale * q.k, then
    cap * tanh(scores / cap), then the mask, softmax, and the weighted sum of the values.
    Shapes as `_sdpa`; the result has the queries' dtype."""
    batch, heads, rows, head_size = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    if causal:  # a fresh prompt: query row i sees keys 0..i (+ any keys before the rows)
        mask = torch.ones(rows, length, dtype=torch.bool, device=queries.device).tril(
            length - rows)
    if mask is not None and mask.dim() == 4:
        mask = mask.unsqueeze(2)  # [B, 1, 1(group), L or 1, S]
    # Query head h reads key head h // group: [B, kv_heads, group, L, hd] against
    # [B, kv_heads, 1, S, hd], so no K/V copy per query head.
    q = queries.reshape(batch, kv_heads, group, rows, head_size).float()
    k = keys.unsqueeze(2).float()
    v = values.unsqueeze(2).float()
    out = torch.empty(batch, kv_heads, group, rows, head_size, dtype=queries.dtype,
                      device=queries.device)
    step = max(1, _SCORE_BUDGET // max(1, batch * heads * length))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        scores = torch.matmul(q[..., r0:r1, :], k.transpose(-1, -2)).mul_(scale / cap)
        scores = scores.tanh_().mul_(cap)
        if mask is not None:
            part = mask if mask.shape[-2] == 1 else mask[..., r0:r1, :]
            scores.masked_fill_(~part, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[..., r0:r1, :] = torch.matmul(probs, v).to(queries.dtype)
    return out.view(batch, heads, rows, head_size)


def _gather_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[2, len(blocks), block_size * kv_heads * head_size]: K and V of the listed blocks."""
    return kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, blocks)


class TorchSDPABackend(AttentionBackend):
    accept_output_buffer = True
    cudagraph_support = AttentionCGSupport.NEVER
    supports_sliding_window = True
    supports_logits_soft_cap = True

    @staticmethod
    def get_name() -> str:
        return "TORCH_SDPA"

    @staticmethod
    def get_impl_cls() -> type[TorchSDPAImpl]:
        return TorchSDPAImpl

    @staticmethod
    def get_metadata_cls() -> type[TorchSDPAMetadata]:
        return TorchSDPAMetadata

    @staticmethod
    def get_builder_cls() -> type[TorchSDPAMetadataBuilder]:
        return TorchSDPAMetadataBuilder
