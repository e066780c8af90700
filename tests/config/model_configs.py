"""In-memory Hugging Face configs (no files) for the level tests: dense, FP8, MoE."""
from __future__ import annotations

from transformers import LlamaConfig, MixtralConfig

from vllm.config import ModelConfig

_SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
          "max_position_embeddings": 512}


def dense() -> ModelConfig:
    return ModelConfig(model="tiny-llama", hf_config=LlamaConfig(**_SMALL,
                                                                 architectures=["LlamaForCausalLM"]))


def fp8(activation_scheme: str = "static") -> ModelConfig:
    cfg = LlamaConfig(**_SMALL, architectures=["LlamaForCausalLM"])
    cfg.quantization_config = {"quant_method": "fp8", "activation_scheme": activation_scheme}
    return ModelConfig(model="tiny-llama-fp8", hf_config=cfg)


def compressed_tensors_fp8(dynamic: bool) -> ModelConfig:
    cfg = LlamaConfig(**_SMALL, architectures=["LlamaForCausalLM"])
    cfg.quantization_config = {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
            "input_activations": {"type": "float", "num_bits": 8, "dynamic": dynamic,
                                  "strategy": "tensor" if not dynamic else "token"},
        }},
    }
    return ModelConfig(model="tiny-llama-ct", hf_config=cfg)


def moe() -> ModelConfig:
    cfg = MixtralConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2,
                        architectures=["MixtralForCausalLM"])
    return ModelConfig(model="tiny-mixtral", hf_config=cfg)


MODELS = {"none": lambda: None, "dense": dense, "fp8": fp8, "moe": moe}
