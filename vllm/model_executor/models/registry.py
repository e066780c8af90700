"""Architecture name (config.json `architectures`) -> model class, imported lazily."""
from __future__ import annotations

import importlib

import torch.nn as nn

# name -> (module under vllm.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}


class _ModelRegistry:
    def __init__(self) -> None:
        self._models: dict[str, tuple[str, str] | type[nn.Module]] = {}
        for name, (module, cls) in _MODELS.items():
            self._models[name] = (f"vllm.model_executor.models.{module}", cls)

    def get_supported_archs(self) -> list[str]:
        return sorted(self._models)

    def is_supported(self, architecture: str) -> bool:
        return architecture in self._models

    def register_model(self, architecture: str, model: str | type[nn.Module]) -> None:
        """Add an architecture: a class, or "package.module:ClassName" (imported when used)."""
        if isinstance(model, str):
            if ":" not in model:
                raise ValueError(f"model {model!r} must be 'module:ClassName'")
            module, cls = model.split(":", 1)
            self._models[architecture] = (module, cls)
        else:
            self._models[architecture] = model

    def load_model_cls(self, architecture: str) -> type[nn.Module]:
        entry = self._models[architecture]
        if isinstance(entry, tuple):
            module, cls = entry
            return getattr(importlib.import_module(module), cls)
        return entry

    def resolve_model_cls(self, architectures: list[str] | None) -> tuple[type[nn.Module], str]:
        """The class of the first supported architecture; ValueError naming the supported ones
        if there is none."""
        for arch in architectures or []:
            if arch in self._models:
                return self.load_model_cls(arch), arch
        raise ValueError(
            f"Model architectures {list(architectures or [])} are not supported. Supported "
            f"architectures: {', '.join(self.get_supported_archs())}")


ModelRegistry = _ModelRegistry()
