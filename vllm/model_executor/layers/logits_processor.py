"""Hidden states -> float32 logits over the real vocabulary (gathers the TP shards)."""
from __future__ import annotations

import torch
import torch.nn as nn

from vllm.distributed import tensor_model_parallel_all_gather
from vllm.model_executor.layers.cpu_linear import dispatch_linear
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead


class LogitsProcessor(nn.Module):

    def __init__(self, vocab_size: int, scale: float = 1.0,
                 soft_cap: float | None = None) -> None:
        """`soft_cap`: None, or c > 0 to return c * tanh(logits / c) (Gemma 2's
        `final_logit_softcapping`), applied in float32 before `scale`."""
        super().__init__()
        if soft_cap is not None and (isinstance(soft_cap, bool)
                                     or not isinstance(soft_cap, (int, float))
                                     or not 0 < soft_cap < float("inf")):
            raise ValueError(f"logits soft_cap={soft_cap!r}; allowed: None or a finite number "
                             "> 0")
        self.vocab_size = vocab_size
        self.scale = scale
        self.soft_cap = None if soft_cap is None else float(soft_cap)

    def forward(self, lm_head: ParallelLMHead, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] -> logits [N, vocab_size] in float32."""
        logits = dispatch_linear(hidden_states, lm_head.weight, lm_head.bias)
        if lm_head.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        logits = logits[..., :self.vocab_size].float()
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, scale={self.scale}, soft_cap={self.soft_cap}"
