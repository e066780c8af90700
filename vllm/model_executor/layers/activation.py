"""Activations: SiluAndMul (the gated MLP's silu(gate) * up)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.model_executor.custom_op import CustomOp


@CustomOp.register("silu_and_mul")
class SiluAndMul(CustomOp):
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:]  of shape [..., d]."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        out = F.silu(x[..., :d])
        return out.mul_(x[..., d:])


def get_act_and_mul_fn(hidden_act: str) -> CustomOp:
    """The gated activation for a config's `hidden_act` (only silu is supported)."""
    if hidden_act not in ("silu", "swish"):
        raise ValueError(f"hidden_act={hidden_act!r} is not supported; supported: silu")
    return SiluAndMul()
