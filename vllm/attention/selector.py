"""Choose an attention backend: a registry of names to lazily imported classes."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from vllm.attention.backends.abstract import AttentionBackend

# name -> (module, class); imported only when chosen, so CUDA-only backends never load on a
# machine without CUDA.
_BACKENDS: dict[str, tuple[str, str]] = {
    "TORCH_SDPA": ("vllm.attention.backends.torch_sdpa", "TorchSDPABackend"),
}


def registered_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attn_backend(head_size: int, dtype: torch.dtype | None = None,
                     kv_cache_dtype: str | None = None, block_size: int | None = None,
                     backend_name: str | None = None) -> type[AttentionBackend]:
    """The backend class for these shapes (TORCH_SDPA on every platform for now)."""
    del dtype, kv_cache_dtype, block_size
    name = (backend_name or "TORCH_SDPA").upper()
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is not registered; choose one of "
                         + ", ".join(registered_backends()))
    module, cls_name = _BACKENDS[name]
    backend = getattr(importlib.import_module(module), cls_name)
    if not backend.supports_head_size(head_size):
        raise ValueError(f"attention backend {name} does not support head_size {head_size}")
    return backend
