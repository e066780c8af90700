"""CompressedTensorsConfig: `quant_method: "compressed-tensors"` FP8 checkpoints
(llm-compressor's layout), the FP8 schemes only.

config.json:
    "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {
          "targets": ["Linear"],
          "weights": {"num_bits": 8, "type": "float", "strategy": "tensor" | "channel" | "block",
                      "block_structure": [128, 128], "dynamic": false, "symmetric": true},
          "input_activations": {"num_bits": 8, "type": "float",
                                "strategy": "tensor" | "token" | "group", "group_size": 128,
                                "dynamic": false | true, "symmetric": true} | null}},
      "ignore": ["lm_head", "re:.*mlp.gate$"]}
Tensors per quantized linear layer: `weight` (float8_e4m3fn), `weight_scale` ([1], [N, 1] or
block-shaped), and with static activations `input_scale` ([1]). Without input_activations the
activations are quantized dynamically per token (per group with block weights).
"""
from __future__ import annotations

from typing import Any

from vllm.model_executor.layers.quantization.base_config import QuantizationConfig


def _check_fp8(args: dict[str, Any], what: str) -> None:
    if args.get("type") != "float" or int(args.get("num_bits", 0)) != 8:
        raise ValueError(f"compressed-tensors {what} scheme {args!r} is not FP8 (num_bits 8, type "
                         "float); only FP8 schemes are supported")
    if args.get("symmetric") is False:
        raise ValueError(f"asymmetric FP8 {what} are not supported")


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, weight_strategy: str, block_size: list[int] | None, act_static: bool,
                 act_strategy: str, act_group_size: int | None,
                 ignore: list[str] | None = None) -> None:
        super().__init__(ignore)
        self.weight_strategy = weight_strategy
        self.block_size = block_size
        self.act_static = act_static
        self.act_strategy = act_strategy
        self.act_group_size = act_group_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        groups = list((config.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors checkpoints with {len(groups)} config groups "
                             "are not supported (exactly one is)")
        group = groups[0]
        weights = group.get("weights") or {}
        _check_fp8(weights, "weight")
        strategy = str(weights.get("strategy", "tensor")).lower()
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors FP8 weight strategy {strategy!r} is not "
                             "supported (tensor, channel and block are)")
        block = weights.get("block_structure") if strategy == "block" else None
        if strategy == "block" and (not block or len(block) != 2):
            raise ValueError("compressed-tensors block strategy needs block_structure [bn, bk]")
        acts = group.get("input_activations")
        if acts:
            _check_fp8(acts, "activation")
            act_static = acts.get("dynamic") is False
            act_strategy = str(acts.get("strategy", "tensor")).lower()
            if act_static and act_strategy != "tensor":
                raise ValueError(f"static FP8 activations must be per-tensor, got strategy "
                                 f"{act_strategy!r}")
            if not act_static and act_strategy not in ("token", "group", "tensor"):
                raise ValueError(f"dynamic FP8 activation strategy {act_strategy!r} is not "
                                 "supported (token and group are)")
            if not act_static and act_strategy == "tensor":
                act_strategy = "token"  # a finer dynamic scale than asked for: never worse
            group_size = acts.get("group_size")
        else:  # weight-only checkpoint: quantize activations dynamically
            act_static, group_size = False, None
            act_strategy = "group" if strategy == "block" else "token"
        if act_strategy == "group" and not group_size:
            group_size = int(block[1]) if block else 128
        return cls(strategy, [int(b) for b in block] if block else None, act_static,
                   act_strategy, int(group_size) if group_size else None,
                   list(config.get("ignore") or []))

    @property
    def is_fp8(self) -> bool:
        return True

    @property
    def has_static_activation_scales(self) -> bool:
        return self.act_static

    def activation_quant(self) -> tuple[bool, int | None]:
        if self.act_static:
            return True, None
        return False, (self.act_group_size if self.act_strategy == "group" else None)

    def get_quant_method(self, layer: Any, prefix: str) -> Any:
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.quantization.fp8_linear import Fp8LinearMethod
        from vllm.model_executor.layers.quantization.input_quant_fp8 import GroupShape

        if not isinstance(layer, LinearBase) or self.is_layer_skipped(prefix):
            return None
        if self.act_static:
            shape = GroupShape.PER_TENSOR
        elif self.act_strategy == "group":
            shape = GroupShape(1, self.act_group_size)
        else:
            shape = GroupShape.PER_TOKEN
        return Fp8LinearMethod(self.weight_strategy, self.act_static,
                               block_size=tuple(self.block_size) if self.block_size else None,
                               act_group_shape=shape, weight_scale_name="weight_scale")

    def __repr__(self) -> str:
        return (f"CompressedTensorsConfig(weights={self.weight_strategy}"
                f"{self.block_size or ''}, activations="
                f"{'static' if self.act_static else 'dynamic'} {self.act_strategy}, "
                f"ignore={self.ignore})")
