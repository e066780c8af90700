"""QuantFP8: activation quantization to float8_e4m3fn, as a CustomOp named "quant_fp8".

    quant = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)
    q, scale = quant(x, scale)            # static: the given per-tensor scale
    quant = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)
    q, scales = quant(x)                  # dynamic: scales [..., 1]
    quant = QuantFP8(static=False, group_shape=GroupShape(1, 128))
    q, scales = quant(x)                  # dynamic per group of 128 columns: [..., K // 128]

forward_native is plain torch (what Inductor sees and the fusion passes match); forward_cpu
and forward_cuda call the `torch.ops.vllm` quant ops (C++ on the CPU, Triton on CUDA), which
the fusion passes also match. Both give the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.kernels import fp8_ops
from vllm.model_executor.kernels.fp8_ops import PER_TOKEN


@dataclass(frozen=True)
class GroupShape:
    """The block of elements sharing one scale: (rows, columns), -1 = the whole extent."""

    row: int
    col: int

    PER_TENSOR: ClassVar[GroupShape]
    PER_TOKEN: ClassVar[GroupShape]

    @property
    def is_per_tensor(self) -> bool:
        return self.row == -1 and self.col == -1

    @property
    def is_per_token(self) -> bool:
        return self.row == 1 and self.col == -1

    @property
    def is_per_group(self) -> bool:
        return self.row == 1 and self.col > 0

    @property
    def group_size(self) -> int:
        """The `group_size` argument of the quant ops (-1: one scale per token)."""
        return self.col if self.is_per_group else PER_TOKEN

    def __str__(self) -> str:
        if self.is_per_tensor:
            return "per-tensor"
        if self.is_per_token:
            return "per-token"
        return f"per-group 1x{self.col}"


GroupShape.PER_TENSOR = GroupShape(-1, -1)
GroupShape.PER_TOKEN = GroupShape(1, -1)


@CustomOp.register("quant_fp8")
class QuantFP8(CustomOp):
    """x [..., K] (float32/bfloat16/float16) -> (q float8_e4m3fn [..., K], scale).

    static: per-tensor only, `scale` (float32, one element) is given and returned as it is.
    dynamic: per-token (scales [..., 1]) or per-group 1xG (scales [..., K // G]), computed
    as max(amax / 448, MIN_SCALE)."""

    def __init__(self, static: bool, group_shape: GroupShape) -> None:
        if static and not group_shape.is_per_tensor:
            raise ValueError(f"static FP8 quantization is per-tensor only, not {group_shape}")
        if not static and not (group_shape.is_per_token or group_shape.is_per_group):
            raise ValueError(f"dynamic FP8 quantization is per-token or per-group, not "
                             f"{group_shape}")
        super().__init__()
        self.static = static
        self.group_shape = group_shape

    def forward_native(self, x: torch.Tensor, scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.static:
            return fp8_ops.ref_static_quant(x, scale), scale
        return fp8_ops.ref_dynamic_quant(x, self.group_shape.group_size)

    def forward_cuda(self, x: torch.Tensor, scale: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.static:
            return torch.ops.vllm.static_scaled_fp8_quant(x, scale), scale
        return torch.ops.vllm.dynamic_scaled_fp8_quant(x, self.group_shape.group_size)

    def forward_cpu(self, x: torch.Tensor, scale: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_cuda(x, scale)

    def extra_repr(self) -> str:
        return f"{'static' if self.static else 'dynamic'} {self.group_shape}"
