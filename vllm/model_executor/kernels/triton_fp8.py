"""Triton kernels of the FP8 quant ops on CUDA (fp8_ops.py dispatches here for CUDA tensors).

One program per row (token): the row is loaded once, the producer (copy, RMSNorm with or
without the residual add, SiluAndMul) runs in float32 with the same roundings to the model
dtype as the plain-torch form, then the row is quantized to float8_e4m3fn with a static
per-tensor scale or dynamic scales per group (a group = the whole row for per-token scales).

Triton is imported only inside `_kernels()`, on the first CUDA call: importing this module
never imports Triton, so the package loads on machines without it. Every function returns
the op's outputs (see fp8_ops.py for the contracts).
"""
from __future__ import annotations

import functools
from typing import Any

import torch

FP8_MAX = 448.0
MIN_SCALE = 1.0 / (448.0 * 512.0)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _kernels() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _quantize_row(y, q_row, s_row, scale_ptr, n, n_groups, STATIC: tl.constexpr,
                      BLOCK: tl.constexpr, GROUP: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        if STATIC:
            s = tl.load(scale_ptr).to(tl.float32)
            q = tl.clamp(y / s, -448.0, 448.0)
            tl.store(q_row + offs, q.to(tl.float8e4nv), mask=offs < n)
        else:
            yg = tl.reshape(y, (BLOCK // GROUP, GROUP))
            amax = tl.max(tl.abs(yg), axis=1)
            s = tl.maximum(amax / 448.0, 1.0 / (448.0 * 512.0))
            q = tl.clamp(yg / s[:, None], -448.0, 448.0)
            q = tl.reshape(q, (BLOCK,))
            tl.store(q_row + offs, q.to(tl.float8e4nv), mask=offs < n)
            # The row's groups: groups past n are padding (a row of n < BLOCK per token is one
            # group of BLOCK, where n // GROUP would be 0).
            g = tl.arange(0, BLOCK // GROUP)
            tl.store(s_row + g, s, mask=g < n_groups)

    @triton.jit
    def quant_kernel(x_ptr, q_ptr, s_ptr, scale_ptr, n, n_groups, STATIC: tl.constexpr,
                     BLOCK: tl.constexpr, GROUP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        y = tl.load(x_ptr + row * n + offs, mask=offs < n, other=0.0).to(tl.float32)
        _quantize_row(y, q_ptr + row * n, s_ptr + row * n_groups, scale_ptr, n, n_groups, STATIC,
                      BLOCK, GROUP)

    @triton.jit
    def rms_quant_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, q_ptr, s_ptr, scale_ptr, eps, n,
                         n_groups, HAS_RES: tl.constexpr, STATIC: tl.constexpr,
                         BLOCK: tl.constexpr, GROUP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + row * n + offs, mask=mask, other=0.0)
        dtype = x.dtype
        v = x.to(tl.float32)
        if HAS_RES:
            v = v + tl.load(res_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(res_out_ptr + row * n + offs, v.to(dtype), mask=mask)
        inv = tl.rsqrt(tl.sum(v * v, axis=0) / n + eps)
        y = (v * inv).to(dtype)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        y = (y.to(tl.float32) * w.to(tl.float32)).to(dtype).to(tl.float32)
        _quantize_row(y, q_ptr + row * n, s_ptr + row * n_groups, scale_ptr, n, n_groups, STATIC,
                      BLOCK, GROUP)

    @triton.jit
    def silu_quant_kernel(x_ptr, q_ptr, s_ptr, scale_ptr, d, n_groups, STATIC: tl.constexpr,
                          BLOCK: tl.constexpr, GROUP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < d
        gate = tl.load(x_ptr + row * 2 * d + offs, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * 2 * d + d + offs, mask=mask, other=0.0)
        dtype = gate.dtype
        g = gate.to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dtype)
        y = (s.to(tl.float32) * up.to(tl.float32)).to(dtype).to(tl.float32)
        _quantize_row(y, q_ptr + row * d, s_ptr + row * n_groups, scale_ptr, d, n_groups, STATIC,
                      BLOCK, GROUP)

    class Kernels:
        pass

    k = Kernels()
    k.triton = triton
    k.quant = quant_kernel
    k.rms_quant = rms_quant_kernel
    k.silu_quant = silu_quant_kernel
    return k


def _geometry(n: int, group_size: int | None):
    """(BLOCK, GROUP, number of groups) for a row of n (group_size None: static)."""
    import triton

    block = triton.next_power_of_2(n)
    if group_size is None:
        return block, block, 0
    group = n if group_size <= 0 else group_size
    if n % group:
        raise ValueError(f"hidden size {n} is not a multiple of the group size {group}")
    if group == n:
        return block, block, 1
    if group & (group - 1):
        raise ValueError(f"the Triton FP8 kernels need a power-of-two group size, got {group}")
    return block, group, n // group


def _outputs(x: torch.Tensor, n: int, groups: int):
    q = torch.empty((*x.shape[:-1], n), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((*x.shape[:-1], max(groups, 1)), dtype=torch.float32, device=x.device)
    return q, s


def quant(x: torch.Tensor, scale: torch.Tensor | None, group_size: int):
    x = x.contiguous()
    n = x.shape[-1]
    rows = x.numel() // max(n, 1)
    block, group, groups = _geometry(n, None if scale is not None else group_size)
    q, s = _outputs(x, n, groups)
    if rows:
        _kernels().quant[(rows,)](x, q, s, scale if scale is not None else s, n, max(groups, 1),
                                  STATIC=scale is not None, BLOCK=block, GROUP=group)
    return q, s


def rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   eps: float, scale: torch.Tensor | None, group_size: int):
    x = x.contiguous()
    n = x.shape[-1]
    rows = x.numel() // max(n, 1)
    block, group, groups = _geometry(n, None if scale is not None else group_size)
    q, s = _outputs(x, n, groups)
    res_out = torch.empty_like(x) if residual is not None else x
    res = residual.contiguous() if residual is not None else x
    if rows:
        _kernels().rms_quant[(rows,)](
            x, res, res_out, weight.contiguous(), q, s, scale if scale is not None else s,
            float(eps), n, max(groups, 1), HAS_RES=residual is not None,
            STATIC=scale is not None, BLOCK=block, GROUP=group)
    return q, s, res_out


def silu_and_mul_quant(x: torch.Tensor, scale: torch.Tensor | None, group_size: int):
    x = x.contiguous()
    d = x.shape[-1] // 2
    rows = x.numel() // max(2 * d, 1)
    block, group, groups = _geometry(d, None if scale is not None else group_size)
    q, s = _outputs(x, d, groups)
    if rows:
        _kernels().silu_quant[(rows,)](x, q, s, scale if scale is not None else s, d,
                                       max(groups, 1), STATIC=scale is not None, BLOCK=block,
                                       GROUP=group)
    return q, s


# ---- the op signatures (fp8_ops dispatches by op name) -----------------------------------
def static_scaled_fp8_quant(x, scale):
    return quant(x, scale, 0)[0]


def dynamic_scaled_fp8_quant(x, group_size):
    return quant(x, None, group_size)


def rms_norm_static_fp8_quant(x, weight, scale, epsilon):
    return rms_norm_quant(x, None, weight, epsilon, scale, 0)[0]


def fused_add_rms_norm_static_fp8_quant(x, residual, weight, scale, epsilon):
    q, _, res = rms_norm_quant(x, residual, weight, epsilon, scale, 0)
    return q, res


def rms_norm_dynamic_fp8_quant(x, weight, epsilon, group_size):
    q, s, _ = rms_norm_quant(x, None, weight, epsilon, None, group_size)
    return q, s


def fused_add_rms_norm_dynamic_fp8_quant(x, residual, weight, epsilon, group_size):
    return rms_norm_quant(x, residual, weight, epsilon, None, group_size)


def silu_and_mul_static_fp8_quant(x, scale):
    return silu_and_mul_quant(x, scale, 0)[0]


def silu_and_mul_dynamic_fp8_quant(x, group_size):
    return silu_and_mul_quant(x, None, group_size)
