"""Gemma 2: Gemma with four norms per layer, soft-capped attention scores and logits, and
sliding-window attention on alternate layers.

Per layer (transformers' Gemma 2 is the reference):
    h = x + post_attention_layernorm(attn(input_layernorm(x)))
    y = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
Attention scores are scaled by query_pre_attn_scalar**-0.5 and capped as
c * tanh(s / c) with c = attn_logit_softcapping (inside the attention op, before the mask);
the logits as c * tanh(logits / c) with c = final_logit_softcapping. Layers that
`layer_types` marks "sliding_attention" (by default the even ones, 0-based) attend to the last
`sliding_window` positions: query p sees keys p - W < j <= p. The MLP activation is
`hidden_activation` (gelu_pytorch_tanh).
"""
from __future__ import annotations

from typing import Any

import torch

from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.models.gemma import (
    GemmaDecoderLayer,
    GemmaForCausalLM,
    layer_kinds_from_config,
)


class Gemma2DecoderLayer(GemmaDecoderLayer):

    @staticmethod
    def layer_kinds(config: Any) -> list[str]:
        return layer_kinds_from_config(config, pattern=2)

    @staticmethod
    def attention_scaling(config: Any) -> float:
        return float(config.query_pre_attn_scalar) ** -0.5

    @staticmethod
    def attention_soft_cap(config: Any) -> float | None:
        return getattr(config, "attn_logit_softcapping", None)

    @staticmethod
    def hidden_act(config: Any) -> str:
        return getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (post_feedforward_layernorm's output, the residual stream before it is
        added): the next layer's input norm (or the final norm) adds the two."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states = self.post_attention_layernorm(hidden_states)
        # The residual add after attention, fused into the feed-forward's norm.
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return self.post_feedforward_layernorm(hidden_states), residual


class Gemma2ForCausalLM(GemmaForCausalLM):
    layer_cls = Gemma2DecoderLayer
