"""Qwen2: the Llama architecture with biases on the q/k/v projections (none on o_proj)."""
from typing import Any

from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen2DecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer
