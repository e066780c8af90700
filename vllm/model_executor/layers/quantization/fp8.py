"""Fp8Config: `quant_method: "fp8"` checkpoints (Hugging Face / vLLM FP8 format).

config.json:
    "quantization_config": {"quant_method": "fp8",
                            "activation_scheme": "static" | "dynamic",
                            "weight_block_size": [128, 128],          # optional
                            "ignored_layers" | "modules_to_not_convert": [...]}
Tensors per quantized linear layer: `weight` (float8_e4m3fn), then either `weight_scale`
(per-tensor, shape [] or [1]) or, with weight_block_size, `weight_scale_inv`
([ceil(N / bn), ceil(K / bk)], the factor that dequantizes each block despite its name);
with activation_scheme "static" also `input_scale` (shape [] or [1]).
Dynamic activations are quantized per token, or per group of bk columns with block weights.
"""
from __future__ import annotations

from typing import Any

from vllm.model_executor.layers.quantization.base_config import QuantizationConfig


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, activation_scheme: str = "dynamic",
                 weight_block_size: list[int] | None = None,
                 ignore: list[str] | None = None) -> None:
        super().__init__(ignore)
        if activation_scheme not in ("static", "dynamic"):
            raise ValueError(f"FP8 activation_scheme {activation_scheme!r} is not supported; "
                             "use 'static' or 'dynamic'")
        if weight_block_size is not None:
            if len(weight_block_size) != 2 or any(int(b) <= 0 for b in weight_block_size):
                raise ValueError(f"weight_block_size must be two positive integers, got "
                                 f"{weight_block_size!r}")
            if activation_scheme == "static":
                raise ValueError("block-wise FP8 weights (weight_block_size) need "
                                 "activation_scheme 'dynamic'")
        self.activation_scheme = activation_scheme
        self.weight_block_size = [int(b) for b in weight_block_size] if weight_block_size \
            else None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        ignore = (config.get("ignored_layers") or config.get("modules_to_not_convert")
                  or config.get("ignore") or [])
        return cls(str(config.get("activation_scheme", "dynamic")).lower(),
                   config.get("weight_block_size"), list(ignore))

    @property
    def is_fp8(self) -> bool:
        return True

    @property
    def has_static_activation_scales(self) -> bool:
        return self.activation_scheme == "static"

    def activation_quant(self) -> tuple[bool, int | None]:
        if self.activation_scheme == "static":
            return True, None
        return False, (self.weight_block_size[1] if self.weight_block_size else None)

    def get_quant_method(self, layer: Any, prefix: str) -> Any:
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.quantization.fp8_linear import Fp8LinearMethod

        if not isinstance(layer, LinearBase) or self.is_layer_skipped(prefix):
            return None
        if self.weight_block_size is not None:
            return Fp8LinearMethod("block", act_static=False,
                                   block_size=tuple(self.weight_block_size),
                                   weight_scale_name="weight_scale_inv")
        return Fp8LinearMethod("tensor", act_static=self.activation_scheme == "static")

    def __repr__(self) -> str:
        return (f"Fp8Config(activation_scheme={self.activation_scheme!r}, "
                f"weight_block_size={self.weight_block_size}, ignore={self.ignore})")
