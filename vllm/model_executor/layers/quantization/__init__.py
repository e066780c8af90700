"""Quantized checkpoints: the config classes that read `quantization_config` and give each
linear layer its `quant_method`.

    quant_config = get_quantization_config(model_config)   # None for an unquantized model
    method = quant_config.get_quant_method(layer, prefix)  # None: leave the layer unquantized

Linear layers built without an explicit `quant_config` ask `current_quant_config()`, which
reads the model of the current VllmConfig (set while the model is built), so model code does
not have to pass the config around.

Supported `quant_method`s: "fp8" (Hugging Face / vLLM FP8 checkpoints: per-tensor or
block-wise weight scales, static or dynamic activations) and "compressed-tensors" (FP8
weights per tensor, channel or block; static per-tensor, dynamic per-token or per-group
activations).
"""
from __future__ import annotations

import importlib
from typing import Any

from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

QUANTIZATION_METHODS: dict[str, str] = {
    "fp8": "vllm.model_executor.layers.quantization.fp8:Fp8Config",
    "compressed-tensors":
        "vllm.model_executor.layers.quantization.compressed_tensors:CompressedTensorsConfig",
}

_CACHE_ATTR = "_vllm_quant_config"


def get_quantization_config_class(method: str) -> type[QuantizationConfig]:
    path = QUANTIZATION_METHODS.get(method)
    if path is None:
        raise ValueError(f"quantization method {method!r} is not supported; supported: "
                         + ", ".join(sorted(QUANTIZATION_METHODS)))
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def get_quantization_config(model_config: Any) -> QuantizationConfig | None:
    """The parsed quantization config of a ModelConfig (built once, then cached on it)."""
    if model_config is None:
        return None
    cached = model_config.__dict__.get(_CACHE_ATTR)
    if cached is not None:
        return cached or None
    raw = getattr(model_config, "quantization_config", None)
    config: Any = False
    if raw is not None:
        method = str(raw.get("quant_method", "")).lower()
        config = get_quantization_config_class(method).from_config(raw)
    model_config.__dict__[_CACHE_ATTR] = config
    return config or None


def current_quant_config() -> QuantizationConfig | None:
    """The quantization config of the model being built (from the current VllmConfig)."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    if config is None:
        return None
    return get_quantization_config(config.model_config)


__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "current_quant_config",
           "get_quantization_config", "get_quantization_config_class"]
