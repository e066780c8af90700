"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (an RMSNorm over each query
and key head, q/k/v/o bias from `attention_bias`, False in the released checkpoints) with
Qwen2-MoE's sparse block minus the shared expert.

Router as Qwen2-MoE: float32 softmax over `num_experts` (config.json may call it
`num_local_experts`; transformers maps one name to the other), top `num_experts_per_tok`,
renormalised when `norm_topk_prob` (True in the released checkpoints). `decoder_sparse_step`
and `mlp_only_layers` choose the layers with a dense MLP of `intermediate_size`, as in
Qwen2-MoE. Sliding windows as transformers' Qwen3-MoE: with `use_sliding_window`,
`config.sliding_window` on every layer; none otherwise. Checkpoint names and tensor
parallelism as Qwen2-MoE (see qwen2_moe.py).
"""
from typing import Any

from vllm.model_executor.models.llama import LlamaDecoderLayer, config_sliding_window
from vllm.model_executor.models.qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3Attention


def qwen3_moe_sliding_window(config: Any, layer_idx: int) -> int | None:
    """`config.sliding_window` on every layer, but only with `use_sliding_window`."""
    del layer_idx
    if not getattr(config, "use_sliding_window", False):
        return None
    return config_sliding_window(config)


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    attention_cls = Qwen3Attention
    attention_biases = staticmethod(LlamaDecoderLayer.attention_biases)
    layer_sliding_window = staticmethod(qwen3_moe_sliding_window)

    @staticmethod
    def shared_expert_size(config: Any) -> int:
        return 0  # Qwen3-MoE has no shared expert


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
