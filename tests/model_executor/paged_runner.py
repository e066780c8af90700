"""Run one of our models step by step over a paged KV cache, as the engine would (tests).

    runner = PagedRunner(model, vllm_config, block_size=16)
    logits = runner.step([("a", prompt_a), ("b", prompt_b)], num_padding=3)
    logits = runner.step([("a", [next_a]), ("b", [next_b])])   # decode, reusing the cache

Each request's blocks are taken from a shuffled free list (never block 0, the dummy block),
so block tables are non-contiguous. `step` returns {request_id: logits [new_tokens, vocab]},
on the CPU; the cache, metadata and inputs live on the model's device (CUDA on a GPU machine).
"""
from __future__ import annotations

import random
from typing import Any

import torch

from vllm.attention.backends.torch_sdpa import TorchSDPAMetadataBuilder
from vllm.attention.layer import bind_kv_cache
from vllm.forward_context import set_forward_context


class PagedRunner:
    def __init__(self, model: Any, vllm_config: Any, block_size: int = 16,
                 num_blocks: int = 64, seed: int = 0) -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.block_size = block_size
        dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.kv_caches = {name: torch.zeros(layer.get_kv_cache_shape(num_blocks, block_size),
                                            dtype=dtype, device=self.device)
                          for name, layer in model.attention_layers.items()}
        bind_kv_cache(model, self.kv_caches)
        self.free_blocks = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def _slots(self, request_id: str, num_new: int) -> tuple[list[int], list[int], int]:
        table = self.block_tables.setdefault(request_id, [])
        start = self.num_computed.get(request_id, 0)
        end = start + num_new
        while len(table) * self.block_size < end:
            table.append(self.free_blocks.pop())
        positions = list(range(start, end))
        slots = [table[p // self.block_size] * self.block_size + p % self.block_size
                 for p in positions]
        self.num_computed[request_id] = end
        return positions, slots, end

    @torch.inference_mode()
    def step(self, batch: list[tuple[str, list[int]]],
             num_padding: int = 0) -> dict[str, torch.Tensor]:
        ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        for request_id, tokens in batch:
            pos, slot, seq_len = self._slots(request_id, len(tokens))
            ids += list(tokens)
            positions += pos
            slots += slot
            query_lens.append(len(tokens))
            seq_lens.append(seq_len)
            tables.append(list(self.block_tables[request_id]))
        num_tokens = len(ids) + num_padding
        metadata = TorchSDPAMetadataBuilder().build(query_lens, seq_lens, tables, slots,
                                                    num_tokens, self.device)
        input_ids = torch.tensor(ids + [0] * num_padding, dtype=torch.int64, device=self.device)
        input_positions = torch.tensor(positions + [0] * num_padding, dtype=torch.int64,
                                       device=self.device)
        with set_forward_context(metadata, self.vllm_config,
                                 attn_layers=self.model.attention_layers):
            hidden = self.model(input_ids, input_positions)
        logits = self.model.compute_logits(hidden[:len(ids)]).cpu()
        out, start = {}, 0
        for (request_id, tokens) in batch:
            out[request_id] = logits[start:start + len(tokens)]
            start += len(tokens)
        return out
