"""How K/V rows are stored in a paged KV cache of a given dtype, for every attention path.

A cache of the activations' dtype holds the rows as they are; one of another floating dtype
holds them rounded to nearest even; an FP8 cache (float8_e4m3fn or float8_e5m2,
kv_cache_dtype="fp8..."), one byte a value, holds K / k_scale and V / v_scale saturated at the
format's largest finite value, with the layer's scales (`kv_scales`: the checkpoint's, else
1.0). Reading multiplies the scales back. The C++ CPU kernel does the same in its own loops.
"""
from __future__ import annotations

from typing import Any

import torch

FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache(rows: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """K or V rows as a cache of `cache_dtype` stores them: rounded to nearest even; for an FP8
    cache divided by `scale` first and saturated at the format's largest finite value."""
    if cache_dtype in FP8_CACHE_DTYPES:
        limit = torch.finfo(cache_dtype).max
        return (rows.float() / scale).clamp(-limit, limit).to(cache_dtype)
    return rows.to(cache_dtype)


def from_cache(rows: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached K or V rows back in `dtype` (an FP8 cache's times its `scale`)."""
    if rows.dtype in FP8_CACHE_DTYPES:
        return (rows.float() * scale).to(dtype)
    return rows.to(dtype)


def kv_scales(layer: Any, kv_cache: torch.Tensor) -> tuple[float, float]:
    """The layer's (k_scale, v_scale) for an FP8 cache (Attention.set_kv_scale), (1.0, 1.0)
    for any other."""
    if kv_cache.dtype in FP8_CACHE_DTYPES:
        return getattr(layer, "k_scale", 1.0), getattr(layer, "v_scale", 1.0)
    return 1.0, 1.0


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A one-byte tensor's uint8 view (float8 has no index_copy_ kernel); others unchanged."""
    return t.view(torch.uint8) if t.element_size() == 1 else t
