"""Choose an attention backend: a registry of names to lazily imported classes."""
from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from vllm.logger import init_logger

if TYPE_CHECKING:
    import torch

    from vllm.attention.backends.abstract import AttentionBackend

logger = init_logger(__name__)

# name -> (module, class); imported only when chosen, so CUDA-only backends never load on a
# machine without CUDA.
_BACKENDS: dict[str, tuple[str, str]] = {
    "TORCH_SDPA": ("vllm.attention.backends.torch_sdpa", "TorchSDPABackend"),
    "TRITON_ATTN": ("vllm.attention.backends.triton_attn", "TritonAttentionBackend"),
}


def registered_backends() -> list[str]:
    return sorted(_BACKENDS)


# The backend every platform can run that implements every feature (sliding windows, logits
# soft-capping).
_FALLBACK = "TORCH_SDPA"


def default_backend_name() -> str:
    """`VLLM_ATTENTION_BACKEND` if set; else TRITON_ATTN on CUDA where Triton is installed (its
    decode batches run inside full CUDA graphs), TORCH_SDPA everywhere else."""
    from vllm import envs

    if envs.VLLM_ATTENTION_BACKEND:
        return envs.VLLM_ATTENTION_BACKEND.upper()
    from vllm.platforms import current_platform

    if current_platform.is_cuda() and importlib.util.find_spec("triton") is not None:
        return "TRITON_ATTN"
    return _FALLBACK


def _load(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is not registered; choose one of "
                         + ", ".join(registered_backends()))
    module, cls_name = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls_name)


def default_backend() -> type[AttentionBackend]:
    """The backend layers get when none is named (what config resolution plans for)."""
    return _load(default_backend_name())


def missing_features(backend: type[AttentionBackend], sliding_window: int | None,
                      logits_soft_cap: float | None) -> list[tuple[str, str, str]]:
    """The features a layer needs that `backend` would ignore: (feature, the layer's value,
    what such layers have) for messages."""
    missing = []
    if sliding_window is not None and not backend.supports_sliding_window:
        missing.append(("sliding-window attention", f"sliding_window={sliding_window}",
                        "a window"))
    if logits_soft_cap is not None and not backend.supports_logits_soft_cap:
        missing.append(("logits soft-capping", f"logits_soft_cap={logits_soft_cap}",
                        "a soft cap"))
    return missing


def get_attn_backend(head_size: int, dtype: torch.dtype | None = None,
                     kv_cache_dtype: str | None = None, block_size: int | None = None,
                     backend_name: str | None = None, sliding_window: int | None = None,
                     logits_soft_cap: float | None = None) -> type[AttentionBackend]:
    """The backend class for these shapes: `backend_name`, else `default_backend_name()`.

    A layer with a `sliding_window` or a `logits_soft_cap` never gets a backend that would
    ignore it: a default choice that cannot apply it falls back to TORCH_SDPA (logged); a
    named one is an error."""
    del dtype, kv_cache_dtype, block_size
    name = (backend_name or default_backend_name()).upper()
    backend = _load(name)
    missing = missing_features(backend, sliding_window, logits_soft_cap)
    if missing:
        if backend_name is not None:
            needs = " or ".join(f"{feature} ({value})" for feature, value, _ in missing)
            raise ValueError(f"attention backend {name} does not support {needs}; use "
                             f"{_FALLBACK}")
        for feature, _, having in missing:
            logger.info_once("attention backend %s does not support %s: layers with %s use "
                             "%s", name, feature, having, _FALLBACK)
        name, backend = _FALLBACK, _load(_FALLBACK)
    reason = backend.unavailable_reason()
    if reason is not None:
        raise ValueError(f"attention backend {name} cannot run here: {reason}")
    if not backend.supports_head_size(head_size):
        raise ValueError(f"attention backend {name} does not support head_size {head_size}")
    return backend
