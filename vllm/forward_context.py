"""Per-forward state: the attention metadata, the attention layers and the CUDA-graph mode.

The model runner enters `set_forward_context(...)` around each model forward; code inside
the forward (the attention custom op, the CUDA-graph wrapper) reads it with
`get_forward_context()`. Nothing is reset by hand: leaving the `with` block restores "no
context", and entering one inside another is refused (a sign of a bug).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.config.compilation import CUDAGraphMode

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class BatchDescriptor:
    """The shape of a batch as the CUDA-graph dispatcher keys it.

    num_tokens: tokens in the (padded) batch; num_reqs: requests in it, when it matters;
    uniform: every request has the same query length (a pure decode batch)."""

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False

    @property
    def non_uniform(self) -> BatchDescriptor:
        """The same token count, keyed as a mixed batch (what piecewise graphs use)."""
        return BatchDescriptor(self.num_tokens, None, False)


@dataclass
class ForwardContext:
    attn_metadata: Any
    """The attention backend's metadata for this batch (None for a dummy/profile run)."""
    attn_layers: dict[str, Any] = field(default_factory=dict)
    """{layer_name: Attention}: how the attention custom op finds its layer and KV cache."""
    vllm_config: VllmConfig | None = None
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor | None = None


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any, vllm_config: VllmConfig | None,
                        attn_layers: dict[str, Any] | None = None,
                        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
                        batch_descriptor: BatchDescriptor | None = None,
                        ) -> Iterator[ForwardContext]:
    """Make the per-forward state visible to the model's forward for the `with` block."""
    global _forward_context
    if _forward_context is not None:
        raise RuntimeError("set_forward_context() was entered while another forward context is "
                           "active; forward contexts do not nest")
    if cudagraph_runtime_mode not in CUDAGraphMode.valid_runtime_modes():
        raise ValueError(f"cudagraph_runtime_mode must be one of NONE, PIECEWISE, FULL at run "
                         f"time, got {cudagraph_runtime_mode}")
    _forward_context = ForwardContext(
        attn_metadata=attn_metadata, attn_layers=attn_layers if attn_layers is not None else {},
        vllm_config=vllm_config, cudagraph_runtime_mode=cudagraph_runtime_mode,
        batch_descriptor=batch_descriptor)
    try:
        yield _forward_context
    finally:
        _forward_context = None


def get_forward_context() -> ForwardContext:
    """The current forward context; a clear error outside `set_forward_context`."""
    if _forward_context is None:
        raise RuntimeError("No forward context is set: run the model inside "
                           "`with set_forward_context(attn_metadata, vllm_config, attn_layers=...)`"
                           " (vllm.forward_context)")
    return _forward_context


def is_forward_context_available() -> bool:
    return _forward_context is not None
