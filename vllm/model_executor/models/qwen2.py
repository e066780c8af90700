"""Qwen2: the Llama architecture with biases on the q/k/v projections (none on o_proj), and
sliding-window attention per layer (`use_sliding_window`, `layer_types`)."""
from typing import Any

from vllm.model_executor.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    layer_types_sliding_window,
)


class Qwen2DecoderLayer(LlamaDecoderLayer):
    # The window only with use_sliding_window, on the layers layer_types marks sliding.
    layer_sliding_window = staticmethod(layer_types_sliding_window)

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer
