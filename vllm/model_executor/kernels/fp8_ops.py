"""FP8 quantization custom ops (`torch.ops.vllm.*`), alone and fused with their producer.

Every op is functional (returns new tensors, mutates nothing), so it needs no
functionalization and the fusion passes can put it in a graph as it is. Implementations:
  CPU:  C++ kernels (cpu_fp8.cpp) registered for the CPU dispatch key, built and loaded at the
        first CPU call (or earlier, by `cpu_loader.load_cpu_fp8_kernels()`);
  CUDA: Triton kernels (triton_fp8.py, imported only on CUDA);
  else, or when neither is available: the plain-torch reference below, which is also the
  definition of the result (the kernels reproduce its rounding steps bit for bit, up to the
  order of the float32 sums of squares).

Scales: static = one float32 scale for the tensor (a tensor with one element); dynamic =
float32 scales computed per group of `group_size` consecutive columns, `group_size=-1` being
one scale per token (row). Dynamic scale = max(amax / 448, MIN_SCALE). Quantized values are
x / scale clamped to +-448, as float8_e4m3fn.

Ops (x: [..., hidden]; q: float8_e4m3fn of x's shape; s: [..., hidden // group] float32):
  static_scaled_fp8_quant(x, scale) -> q
  dynamic_scaled_fp8_quant(x, group_size) -> (q, s)
  rms_norm_static_fp8_quant(x, weight, scale, epsilon) -> q
  fused_add_rms_norm_static_fp8_quant(x, residual, weight, scale, epsilon) -> (q, residual_out)
  rms_norm_dynamic_fp8_quant(x, weight, epsilon, group_size) -> (q, s)
  fused_add_rms_norm_dynamic_fp8_quant(x, residual, weight, epsilon, group_size)
      -> (q, s, residual_out)
  silu_and_mul_static_fp8_quant(x [..., 2d], scale) -> q [..., d]
  silu_and_mul_dynamic_fp8_quant(x [..., 2d], group_size) -> (q [..., d], s)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
"""Smallest dynamic scale: keeps an all-zero row from dividing by zero."""
PER_TOKEN = -1
"""group_size meaning "one scale per row"."""


# ---- plain-torch reference (the definition; also the fallback) ---------------------------
def ref_static_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def ref_dynamic_quant(x: torch.Tensor, group_size: int = PER_TOKEN
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x.to(torch.float32)
    if group_size == PER_TOKEN or group_size == x.shape[-1]:
        amax = x32.abs().amax(dim=-1, keepdim=True)
        scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
        q = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q, scale
    groups = x32.unflatten(-1, (-1, group_size))
    amax = groups.abs().amax(dim=-1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).flatten(-2)
    return q, scale.squeeze(-1)


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 residual: torch.Tensor | None = None):
    """RMSNorm.forward_native: returns y, or (y, residual_out) with a residual."""
    orig = x.dtype
    x32 = x.to(torch.float32)
    if residual is not None:
        x32 = x32 + residual.to(torch.float32)
        residual = x32.to(orig)
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    y = (x32 * torch.rsqrt(variance + eps)).to(orig)
    if weight is not None:
        y = y * weight
    return y if residual is None else (y, residual)


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


# ---- op registration ----------------------------------------------------------------------
# Schemas are defined here; the implementation registered below (CompositeExplicitAutograd)
# serves every device without a more specific kernel. Loading the CPU library
# (cpu_loader.load_cpu_fp8_kernels) registers C++ kernels for the CPU key, which the
# dispatcher then prefers: a CPU call never enters Python.
_lib = torch.library.Library("vllm", "FRAGMENT")  # noqa: TOR901


def _define(name: str, schema: str, fake):
    _lib.define(name + schema)
    qualname = f"vllm::{name}"
    torch.library.register_fake(qualname, fake, lib=_lib)

    def decorator(fn):
        def impl(*args):
            x = args[0]
            if x.device.type == "cpu":
                from vllm.model_executor.kernels.cpu_loader import (
                    cpu_fp8_kernels_loaded,
                    load_cpu_fp8_kernels,
                )

                # First CPU call before the library was loaded: load it, then dispatch again
                # (to the C++ kernel now registered for the CPU key).
                if not cpu_fp8_kernels_loaded() and load_cpu_fp8_kernels():
                    return getattr(torch.ops.vllm, name).default(*args)
            elif x.is_cuda:
                triton_ops = _triton_ops()
                if triton_ops is not None:
                    return getattr(triton_ops, name)(*args)
            return fn(*args)

        _lib.impl(name, impl, "CompositeExplicitAutograd")
        return getattr(torch.ops.vllm, name).default

    return decorator


def _triton_ops():
    from vllm.model_executor.kernels import triton_fp8

    return triton_fp8 if triton_fp8.available() else None


def _like_fp8(x: torch.Tensor, *_):
    return torch.empty_like(x, dtype=FP8_DTYPE)


def _q_and_scales(x: torch.Tensor, hidden, group_size: int):
    q = x.new_empty((*x.shape[:-1], hidden), dtype=FP8_DTYPE)
    groups = 1 if group_size in (PER_TOKEN, 0) else hidden // group_size
    return q, x.new_empty((*x.shape[:-1], groups), dtype=torch.float32)


@_define("static_scaled_fp8_quant", "(Tensor x, Tensor scale) -> Tensor", _like_fp8)
def static_scaled_fp8_quant(x, scale):
    return ref_static_quant(x, scale)


@_define("dynamic_scaled_fp8_quant", "(Tensor x, int group_size) -> (Tensor, Tensor)",
         lambda x, group_size: _q_and_scales(x, x.shape[-1], group_size))
def dynamic_scaled_fp8_quant(x, group_size):
    return ref_dynamic_quant(x, group_size)


@_define("rms_norm_static_fp8_quant",
         "(Tensor x, Tensor weight, Tensor scale, float epsilon) -> Tensor", _like_fp8)
def rms_norm_static_fp8_quant(x, weight, scale, epsilon):
    return ref_static_quant(ref_rms_norm(x, weight, epsilon), scale)


@_define("fused_add_rms_norm_static_fp8_quant",
         "(Tensor x, Tensor residual, Tensor weight, Tensor scale, float epsilon) "
         "-> (Tensor, Tensor)",
         lambda x, *_: (torch.empty_like(x, dtype=FP8_DTYPE), torch.empty_like(x)))
def fused_add_rms_norm_static_fp8_quant(x, residual, weight, scale, epsilon):
    y, res = ref_rms_norm(x, weight, epsilon, residual)
    return ref_static_quant(y, scale), res


@_define("rms_norm_dynamic_fp8_quant",
         "(Tensor x, Tensor weight, float epsilon, int group_size) -> (Tensor, Tensor)",
         lambda x, weight, epsilon, group_size: _q_and_scales(x, x.shape[-1], group_size))
def rms_norm_dynamic_fp8_quant(x, weight, epsilon, group_size):
    return ref_dynamic_quant(ref_rms_norm(x, weight, epsilon), group_size)


@_define("fused_add_rms_norm_dynamic_fp8_quant",
         "(Tensor x, Tensor residual, Tensor weight, float epsilon, int group_size) "
         "-> (Tensor, Tensor, Tensor)",
         lambda x, residual, weight, epsilon, group_size: (
             *_q_and_scales(x, x.shape[-1], group_size), torch.empty_like(x)))
def fused_add_rms_norm_dynamic_fp8_quant(x, residual, weight, epsilon, group_size):
    y, res = ref_rms_norm(x, weight, epsilon, residual)
    q, s = ref_dynamic_quant(y, group_size)
    return q, s, res


@_define("silu_and_mul_static_fp8_quant", "(Tensor x, Tensor scale) -> Tensor",
         lambda x, scale: x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=FP8_DTYPE))
def silu_and_mul_static_fp8_quant(x, scale):
    return ref_static_quant(ref_silu_and_mul(x), scale)


@_define("silu_and_mul_dynamic_fp8_quant", "(Tensor x, int group_size) -> (Tensor, Tensor)",
         lambda x, group_size: _q_and_scales(x, x.shape[-1] // 2, group_size))
def silu_and_mul_dynamic_fp8_quant(x, group_size):
    return ref_dynamic_quant(ref_silu_and_mul(x), group_size)
