"""Phi-3 (Phi-3-mini/-medium, Phi-3.5-mini): the Llama architecture without biases, whose
checkpoints store the packed projections already fused.

Checkpoint tensors `self_attn.qkv_proj.weight` ([q; k; v] rows) and
`mlp.gate_up_proj.weight` ([gate; up] rows) carry the names of our packed parameters; their
weight loaders, called without a shard id, split the fused tensor by the known sizes and load
each part as a shard, so every tensor-parallel rank gets its own slice of q, k and v (of gate
and up).

Sliding-window attention is Mistral-style, as transformers' Phi3 applies it: a set
`config.sliding_window` (Phi-3-mini-4k: 2047) on every layer. RoPE may be partial
(`partial_rotary_factor`) and scaled with "longrope" (Phi-3-mini-128k, Phi-3.5; see
`LongRoPEScaledRotaryEmbedding` for how its short/long switch differs from transformers').
"""
from typing import Any

from vllm.model_executor.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    maybe_prefix,
)


class Phi3DecoderLayer(LlamaDecoderLayer):

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        return False, False

    def _init_mlp(self, config: Any, quant_config: Any, prefix: str) -> None:
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            bias=False, quant_config=quant_config,
                            prefix=maybe_prefix(prefix, "mlp"))


class Phi3ForCausalLM(LlamaForCausalLM):
    layer_cls = Phi3DecoderLayer
    # No split q/k/v or gate/up tensors in Phi-3 checkpoints: the fused ones match the
    # parameter names and go through the packed loaders whole (shard id None).
    stacked_params_mapping: list[tuple[str, str, Any]] = []
