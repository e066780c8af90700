"""Qwen3: the Llama architecture with an RMSNorm over each query and key head before RoPE
(`q_norm`, `k_norm`, weights of size head_dim) and no q/k/v bias by default; sliding
windows per layer as Qwen2 (`use_sliding_window`, `layer_types`)."""
from typing import Any

import torch

from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    layer_types_sliding_window,
)


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps=eps)
        self.k_norm = RMSNorm(self.head_dim, eps=eps)

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = q.shape[0]
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        return q.view(num_tokens, self.q_size), k.view(num_tokens, self.kv_size)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention
    # The window only with use_sliding_window, on the layers layer_types marks sliding.
    layer_sliding_window = staticmethod(layer_types_sliding_window)


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
