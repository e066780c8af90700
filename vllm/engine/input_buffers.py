"""Persistent max-size input buffers, allocated once and owned by the model runner.

The model always reads leading slices of these tensors, in eager and CUDA-graph modes alike,
so a captured graph sees the same addresses at every replay. On CUDA each device buffer has a
pinned host twin that is filled with numpy and copied over without blocking; on the CPU the
host buffer is the device buffer.
"""
from __future__ import annotations

import torch


class InputBuffers:
    def __init__(self, max_num_tokens: int, max_num_reqs: int, device: torch.device) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.device = device
        on_cpu = device.type == "cpu"
        pin = not on_cpu and torch.cuda.is_available()

        def host(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, pin_memory=pin)

        self.input_ids_cpu = host(max_num_tokens)
        self.positions_cpu = host(max_num_tokens)
        self.logits_indices_cpu = host(max_num_reqs)
        self.input_ids_np = self.input_ids_cpu.numpy()
        self.positions_np = self.positions_cpu.numpy()
        self.logits_indices_np = self.logits_indices_cpu.numpy()
        if on_cpu:
            self.input_ids = self.input_ids_cpu
            self.positions = self.positions_cpu
            self.logits_indices = self.logits_indices_cpu
        else:
            self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
            self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
            self.logits_indices = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)

    def check_fits(self, num_tokens: int, num_reqs: int) -> None:
        if num_tokens > self.max_num_tokens or num_reqs > self.max_num_reqs:
            raise ValueError(f"batch of {num_tokens} tokens / {num_reqs} requests exceeds the "
                             f"input buffers ({self.max_num_tokens} tokens, "
                             f"{self.max_num_reqs} requests)")

    def commit_tokens(self, num_tokens: int, num_padded: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero the padding lanes [num_tokens, num_padded) and move the first `num_padded`
        ids and positions to the device. Returns (input_ids, positions) views."""
        if num_padded > num_tokens:
            self.input_ids_np[num_tokens:num_padded] = 0
            self.positions_np[num_tokens:num_padded] = 0
        if self.input_ids is not self.input_ids_cpu:
            self.input_ids[:num_padded].copy_(self.input_ids_cpu[:num_padded], non_blocking=True)
            self.positions[:num_padded].copy_(self.positions_cpu[:num_padded], non_blocking=True)
        return self.input_ids[:num_padded], self.positions[:num_padded]

    def commit_logits_indices(self, indices: list[int]) -> torch.Tensor:
        n = len(indices)
        self.logits_indices_np[:n] = indices
        if self.logits_indices is not self.logits_indices_cpu:
            self.logits_indices[:n].copy_(self.logits_indices_cpu[:n], non_blocking=True)
        return self.logits_indices[:n]
