"""TRITON_ATTN: TORCH_SDPA plus a Triton paged-decode kernel that runs inside full CUDA graphs.

A batch whose every request decodes one token (a uniform decode batch: the batches full CUDA
graphs are captured for) writes its K/V with `index_copy_` and attends with one launch of
`triton_decode_kernel.paged_decode`; both read only device tensors. The metadata builder keeps
those tensors (slot mapping, sequence lengths, block table) in buffers allocated once, and
copies each step's values into them, so a graph captured for N tokens finds the next batch's
values at the addresses it recorded. Rows past the live requests (padding up to the captured
size) get sequence length 0: the kernel writes zeros there, and their K/V goes to the reserved
block 0.

Every other batch (prompts, chunks, mixed) runs TORCH_SDPA's path; under FULL_AND_PIECEWISE
those batches replay piecewise graphs, with attention eager between the pieces. So the backend
reports `UNIFORM_SINGLE_TOKEN_DECODE`: full graphs for decode, piecewise for the rest.

A layer's sliding window and logits soft-cap are applied on both paths (the kernel takes
them as arguments).

Needs Triton; on the CPU the kernel runs only in Triton's interpreter (tests).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.attention.backends.abstract import AttentionCGSupport
from vllm.attention.backends.cache_storage import byte_view, kv_scales, to_cache
from vllm.attention.backends.torch_sdpa import (
    DUMMY_BLOCK_ID,
    TorchSDPABackend,
    TorchSDPAImpl,
    TorchSDPAMetadata,
    TorchSDPAMetadataBuilder,
)


@dataclass
class TritonAttentionMetadata(TorchSDPAMetadata):
    decode_seq_lens: torch.Tensor | None = None
    """Uniform decode batches only: [num_tokens] int32 (padded rows 0), a view of the
    builder's persistent buffer; None for every other batch."""
    decode_block_table: torch.Tensor | None = None
    """Uniform decode batches only: [num_tokens, max_blocks] int32, a view of the builder's
    persistent buffer (columns past a row's blocks hold stale ids the kernel never reads)."""


class TritonAttentionMetadataBuilder(TorchSDPAMetadataBuilder):
    """TORCH_SDPA's metadata, plus the persistent decode tensors for uniform decode batches.

    `max_rows` / `max_blocks` size the persistent buffers (default: from the config: the
    larger of max_num_seqs and the largest CUDA-graph capture size, and max_model_len in
    blocks), allocated on `device` at once (else at the first decode batch). A decode batch
    that does not fit (only possible outside the captured sizes) gets fresh tensors instead:
    correct, but not replayable."""

    def __init__(self, vllm_config: Any = None, device: torch.device | str | None = None,
                 max_rows: int | None = None, max_blocks: int | None = None) -> None:
        if vllm_config is not None:
            cc = vllm_config.compilation_config
            block_size = vllm_config.cache_config.block_size
            max_rows = max_rows or max(vllm_config.scheduler_config.max_num_seqs,
                                       cc.max_cudagraph_capture_size or 0)
            max_model_len = vllm_config.model_config.max_model_len
            max_blocks = max_blocks or -(-max_model_len // block_size)
        self.max_rows = max_rows or 256
        self.max_blocks = max_blocks or 256
        self._buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if device is not None:
            self._persistent(device)

    def _persistent(self, device: torch.device | str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._buffers is None or not _same_device(self._buffers[0].device, device):
            self._buffers = (
                torch.zeros(self.max_rows, dtype=torch.int64, device=device),  # slots
                torch.zeros(self.max_rows, dtype=torch.int32, device=device),  # seq lens
                torch.zeros(self.max_rows, self.max_blocks, dtype=torch.int32, device=device))
        return self._buffers

    def build(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              slot_mapping: list[int], num_padded_tokens: int | None = None,
              device: torch.device | str = "cpu") -> TritonAttentionMetadata:
        md = super().build(query_lens, seq_lens, block_tables, slot_mapping,
                           num_padded_tokens=num_padded_tokens, device=device)
        fields = {f.name: getattr(md, f.name) for f in dataclasses.fields(md) if f.init}
        if not query_lens or any(q != 1 for q in query_lens):
            return TritonAttentionMetadata(**fields)
        rows = md.slot_mapping.shape[0]
        width = max(len(row) for row in block_tables)
        num_reqs = len(query_lens)
        host_lens = np.zeros(rows, dtype=np.int32)
        host_lens[:num_reqs] = seq_lens
        host_table = np.full((rows, width), DUMMY_BLOCK_ID, dtype=np.int32)
        for i, row in enumerate(block_tables):
            host_table[i, :len(row)] = row
        if rows > self.max_rows or width > self.max_blocks:
            return TritonAttentionMetadata(
                **fields, decode_seq_lens=torch.from_numpy(host_lens).to(device),
                decode_block_table=torch.from_numpy(host_table).to(device))
        slots_buf, lens_buf, table_buf = self._persistent(device)
        slots_buf[:rows].copy_(md.slot_mapping)
        lens_buf[:rows].copy_(torch.from_numpy(host_lens))
        table_buf[:rows, :width].copy_(torch.from_numpy(host_table))
        fields["slot_mapping"] = slots_buf[:rows]
        return TritonAttentionMetadata(**fields, decode_seq_lens=lens_buf[:rows],
                                       decode_block_table=table_buf[:rows])


def _same_device(have: torch.device, want: torch.device | str) -> bool:
    """`want` without an index ("cuda") means the current device of its type: unequal to
    "cuda:0" as torch.device objects, which would reallocate the buffers every step."""
    want = torch.device(want)
    if have.type != want.type:
        return False
    if want.index is None and want.type == "cuda":
        return have.index == torch.cuda.current_device()
    return want.index is None or have.index == want.index


class TritonAttentionImpl(TorchSDPAImpl):
    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: TorchSDPAMetadata,
                output: torch.Tensor, output_scale: torch.Tensor | None = None) -> torch.Tensor:
        md = attn_metadata
        if getattr(md, "decode_seq_lens", None) is None:
            return super().forward(layer, query, key, value, kv_cache, md, output,
                                   output_scale=output_scale)
        if not kv_cache.is_contiguous():
            raise ValueError("the KV cache tensor must be contiguous "
                             "[2, num_blocks, block_size, num_kv_heads, head_size]")
        rows = query.shape[0]
        heads, kv_heads, head_size = self.num_heads, self.num_kv_heads, self.head_size
        flat = byte_view(kv_cache).view(2, -1, kv_heads, head_size)
        slots = md.slot_mapping[:rows]
        scales = kv_scales(layer, kv_cache)
        # A KV cache of another dtype than the activations is written converted (the kernel
        # reads every operand as float32; an FP8 cache's rows divided by their scale, through
        # byte views): TORCH_SDPA's path would take its sizes from the host, which a full CUDA
        # graph records once.
        for i, (rows_in, scale) in enumerate(zip((key, value), scales)):
            new = to_cache(rows_in.view(rows, kv_heads, head_size), kv_cache.dtype, scale)
            flat[i].index_copy_(0, slots, byte_view(new))
        result = output if output_scale is None else torch.empty_like(query)
        try:
            from vllm.attention.backends.triton_decode_kernel import paged_decode

            paged_decode(query.view(rows, heads, head_size), kv_cache, md.decode_block_table,
                         md.decode_seq_lens, self.scale, result.view(rows, heads, head_size),
                         window=self.sliding_window, soft_cap=self.logits_soft_cap,
                         k_scale=scales[0], v_scale=scales[1])
        except Exception as e:
            raise RuntimeError(
                f"the TRITON_ATTN decode kernel failed ({type(e).__name__}: {e}); "
                "VLLM_ATTENTION_BACKEND=TORCH_SDPA runs without it (no full CUDA graphs)") from e
        if output_scale is not None:
            self._output_scale = output_scale
            output.copy_(self._to_output(result))
        return output


class TritonAttentionBackend(TorchSDPABackend):
    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    supports_sliding_window = True
    supports_logits_soft_cap = True

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed; use TORCH_SDPA"
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from vllm.attention.backends.triton_decode_kernel import interpreter_on

            if interpreter_on():
                return None
            return ("its decode kernel runs on CUDA, or on the CPU only in Triton's interpreter "
                    "(TRITON_INTERPRET=1, for tests); use TORCH_SDPA")
        return None

    @staticmethod
    def get_impl_cls() -> type[TritonAttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[TritonAttentionMetadata]:
        return TritonAttentionMetadata

    @staticmethod
    def get_builder_cls() -> type[TritonAttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder
