"""CudagraphDispatcher: batch -> (CUDA-graph runtime mode, BatchDescriptor). Pure Python.

The valid keys per runtime mode are the single source of truth; `dispatch` pads the token
count to the smallest capture size that holds it (a table built once) and tries, in order:
the FULL key of a uniform decode batch, the FULL key of a mixed batch, the PIECEWISE key,
else NONE. Batches above the largest capture size run without graphs, unpadded.
The runner pads its inputs to `descriptor.num_tokens`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import BatchDescriptor

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class CudagraphDispatcher:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        cc = vllm_config.compilation_config
        self.capture_sizes = sorted(set(cc.cudagraph_capture_sizes or []))
        self.max_capture_size = self.capture_sizes[-1] if self.capture_sizes else 0
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.cudagraph_mode = CUDAGraphMode.NONE
        self.uniform_decode_query_len = 1
        self.keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.FULL: set(), CUDAGraphMode.PIECEWISE: set()}
        # padded[n] = smallest capture size >= n, for 0 <= n <= max capture size.
        self.padded: list[int] = []
        self._build_padding_table()
        self.keys_initialized = False

    def _build_padding_table(self) -> None:
        table = [0] * (self.max_capture_size + 1)
        sizes = iter(self.capture_sizes)
        current = next(sizes, 0)
        for n in range(1, self.max_capture_size + 1):
            while current < n:
                current = next(sizes)
            table[n] = current
        self.padded = table

    def pad(self, num_tokens: int) -> int:
        """The capture size a batch of num_tokens runs at (itself above the largest)."""
        if 0 < num_tokens <= self.max_capture_size:
            return self.padded[num_tokens]
        return num_tokens

    def _descriptor(self, padded: int, uniform_decode: bool, mode_has_full: bool
                    ) -> BatchDescriptor:
        if uniform_decode and mode_has_full:
            num_reqs = min(padded // self.uniform_decode_query_len, self.max_num_seqs)
            return BatchDescriptor(padded, num_reqs, True)
        return BatchDescriptor(padded, min(padded, self.max_num_seqs), False)

    def initialize_cudagraph_keys(self, cudagraph_mode: CUDAGraphMode,
                                  uniform_decode_query_len: int = 1) -> None:
        """Build the key sets for `cudagraph_mode` (resolved after the attention backends are
        known); the runner captures exactly these keys. A compile size these graphs would pad
        is a ValueError ("would be padded to")."""
        self.vllm_config.compilation_config.check_compile_sizes_padding(cudagraph_mode)
        self.cudagraph_mode = cudagraph_mode
        self.uniform_decode_query_len = uniform_decode_query_len
        for keys in self.keys.values():
            keys.clear()
        if cudagraph_mode == CUDAGraphMode.NONE:
            self.keys_initialized = True
            return
        mixed = cudagraph_mode.mixed_mode()
        if mixed == CUDAGraphMode.PIECEWISE:
            for size in self.capture_sizes:
                self.keys[CUDAGraphMode.PIECEWISE].add(BatchDescriptor(size))
        elif mixed == CUDAGraphMode.FULL:
            for size in self.capture_sizes:
                self.keys[CUDAGraphMode.FULL].add(BatchDescriptor(
                    size, min(size, self.max_num_seqs), False))
        if cudagraph_mode.separate_routine() and \
                cudagraph_mode.decode_mode() == CUDAGraphMode.FULL:
            q = uniform_decode_query_len
            for size in self.capture_sizes:
                if q <= size <= q * self.max_num_seqs:
                    self.keys[CUDAGraphMode.FULL].add(self._descriptor(size, True, True))
        self.keys_initialized = True

    def dispatch(self, num_tokens: int, num_reqs: int, uniform_decode: bool
                 ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """(runtime mode, descriptor); `descriptor.num_tokens` is the padded token count."""
        if not self.keys_initialized or self.cudagraph_mode == CUDAGraphMode.NONE \
                or num_tokens > self.max_capture_size:
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens, num_reqs, uniform_decode)
        padded = self.pad(num_tokens)
        full_keys = self.keys[CUDAGraphMode.FULL]
        if full_keys:
            key = self._descriptor(padded, uniform_decode, True)
            if key in full_keys:
                return CUDAGraphMode.FULL, key
            mixed_key = self._descriptor(padded, False, True)
            if mixed_key in full_keys:
                return CUDAGraphMode.FULL, mixed_key
        piecewise_key = BatchDescriptor(padded)
        if piecewise_key in self.keys[CUDAGraphMode.PIECEWISE]:
            return CUDAGraphMode.PIECEWISE, piecewise_key
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens, num_reqs, uniform_decode)

    def capture_descriptors(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """What the runner captures, in capture order: PIECEWISE first, then FULL, largest
        batches first within each."""
        order = []
        for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            keys = sorted(self.keys[mode], key=lambda d: (-d.num_tokens, not d.uniform))
            order += [(mode, key) for key in keys]
        return order
