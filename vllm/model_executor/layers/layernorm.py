"""RMSNorm with an optional fused residual add."""
from __future__ import annotations

import torch
import torch.nn as nn

from vllm.model_executor.custom_op import CustomOp


@CustomOp.register("rms_norm")
class RMSNorm(CustomOp):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 like transformers.

    `forward(x)` returns y; `forward(x, residual)` first adds `residual` to `x` and returns
    `(y, x + residual)` (the new residual), which is what every decoder layer needs. `x` may
    have any leading shape; the norm runs over the last dimension (`hidden_size`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, has_weight: bool = True,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.has_weight = has_weight
        if has_weight:
            self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        else:
            self.weight = None

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        if residual is not None:
            x = x + residual.to(torch.float32)
            residual = x.to(orig_dtype)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = (x * torch.rsqrt(variance + self.variance_epsilon)).to(orig_dtype)
        if self.weight is not None:
            x = x * self.weight
        return x if residual is None else (x, residual)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # ATen's fused rms_norm: one pass over x instead of four elementwise kernels.
        orig_dtype = x.dtype
        if residual is not None:
            summed = x.to(torch.float32) + residual.to(torch.float32)
            residual = summed.to(orig_dtype)
            x32 = summed
        else:
            x32 = x.to(torch.float32)
        out = torch.nn.functional.rms_norm(x32, (self.hidden_size,), None,
                                           self.variance_epsilon).to(orig_dtype)
        if self.weight is not None:
            out = out * self.weight
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"


@CustomOp.register("gemma_rms_norm")
class GemmaRMSNorm(CustomOp):
    """Gemma's RMSNorm: y = x / sqrt(mean(x^2) + eps) * (1 + weight).

    Unlike `RMSNorm`, the weight multiplies in float32 and only the product is cast back to
    x's dtype (transformers' Gemma, Gemma 2 and Gemma 3 norms); checkpoints store the weight
    centred on 0, so a zero weight is the identity scale. `forward(x, residual)` adds
    `residual` in x's dtype first (as those models' `residual + hidden` does), normalises
    that sum and returns `(y, sum)`. The norm runs over the last dimension of x."""

    identity_weight = 0.0
    """The weight that makes the scale 1 (dummy weights use it)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def _add_residual(self, x: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            return x, None
        summed = (x.to(torch.float32) + residual.to(torch.float32)).to(x.dtype)
        return summed, summed

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        x, residual = self._add_residual(x, residual)
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon)
        out = (x32 * (1.0 + self.weight.to(torch.float32))).to(x.dtype)
        return out if residual is None else (out, residual)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # ATen's fused rms_norm, with the (1 + weight) scale folded in, all in float32.
        x, residual = self._add_residual(x, residual)
        scale = 1.0 + self.weight.to(torch.float32)
        out = torch.nn.functional.rms_norm(x.to(torch.float32), (self.hidden_size,), scale,
                                           self.variance_epsilon).to(x.dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"
