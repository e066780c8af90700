"""Activations: the gated MLP's act(gate) * up (SiluAndMul, GeluAndMul) and the plain
activations of non-gated MLPs (GPT-2, OPT), chosen by a config's activation name."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm.model_executor.custom_op import CustomOp

# Config activation names -> the approximate= argument of F.gelu.
_GELU_NAMES = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh",
               "gelu_fast": "tanh", "gelu_tanh": "tanh"}


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


@CustomOp.register("gelu_and_mul")
class GeluAndMul(CustomOp):
    """x [..., 2d] -> gelu(x[..., :d]) * x[..., d:]; `approximate` "none" (erf) or "tanh"
    (Gemma's gelu_pytorch_tanh)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate={approximate!r}; supported: 'none', 'tanh'")
        self.approximate = approximate

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        out = F.gelu(x[..., :d], approximate=self.approximate)
        return out.mul_(x[..., d:])

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


def get_act_and_mul_fn(hidden_act: str) -> CustomOp:
    """The gated activation for a config's `hidden_act` / `hidden_activation`."""
    if hidden_act in ("silu", "swish"):
        return SiluAndMul()
    if hidden_act in _GELU_NAMES:
        return GeluAndMul(_GELU_NAMES[hidden_act])
    raise ValueError(f"hidden_act={hidden_act!r} is not supported for a gated MLP; supported: "
                     + ", ".join(["silu", "swish", *_GELU_NAMES]))


def get_act_fn(name: str) -> nn.Module:
    """The plain (non-gated) activation for a config's activation name (GPT-2's
    `activation_function`, OPT's `activation_function`)."""
    if name in _GELU_NAMES:
        return nn.GELU(approximate=_GELU_NAMES[name])
    if name == "relu":
        return nn.ReLU()
    if name in ("silu", "swish"):
        return nn.SiLU()
    raise ValueError(f"activation {name!r} is not supported; supported: "
                     + ", ".join(["relu", "silu", "swish", *_GELU_NAMES]))
