"""The attention backend interface: metadata, its builder, the kernel, the KV cache layout."""
from __future__ import annotations

import enum
import math
import numbers
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


def check_sliding_window(window: Any, what: str = "sliding_window") -> int | None:
    """`window` as a positive int, or None (no window); ValueError naming a bad value."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{what} must be a positive integer (the number of keys a query sees, "
                         f"itself included) or None for full attention; got {window!r}")
    return window


def check_logits_soft_cap(cap: Any, what: str = "logits_soft_cap") -> float | None:
    """`cap` as a positive finite float, or None (no soft-capping); ValueError naming a bad
    value. A cap c maps each scaled score s to c * tanh(s / c) before the mask and softmax
    (Gemma 2's `attn_logit_softcapping`)."""
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not math.isfinite(cap) \
            or cap <= 0:
        raise ValueError(f"{what} must be a positive finite number (scores become "
                         f"cap * tanh(score / cap)) or None for no soft-capping; got {cap!r}")
    return float(cap)


class AttentionCGSupport(enum.Enum):
    """Which batches a backend can run inside a full CUDA graph."""

    NEVER = 0  # per-batch host-side decisions: only piecewise graphs (attention runs eagerly)
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


class AttentionMetadata:
    """Per-batch data every attention layer of one forward shares (built once per step)."""


class AttentionImpl(ABC):
    """Computes attention for one layer: writes the new K/V into its paged cache, then reads
    the cache. Tensors: query [T, num_heads*head_size], key/value [T, num_kv_heads*head_size],
    output [T, num_heads*head_size] (written in place)."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, **kwargs: Any) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = check_sliding_window(sliding_window)
        """None, or W: the query at position p attends to the keys at positions p - W < j <= p
        (W keys including itself), as transformers' sliding-window causal mask."""
        self.logits_soft_cap = check_logits_soft_cap(logits_soft_cap)
        """None, or c: each scaled score s becomes c * tanh(s / c) before the mask and the
        softmax (Gemma 2)."""
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")

    @classmethod
    def fused_output_quant_supported(cls, quant_dtype: torch.dtype, static: bool,
                                     per_tensor: bool) -> bool:
        """Whether `forward(..., output_scale=s)` can write `output` quantized to
        `quant_dtype` (the attention+quant fusion asks before rewriting a layer)."""
        return False

    @abstractmethod
    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                output: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class AttentionMetadataBuilder(ABC):
    @abstractmethod
    def build(self, *args: Any, **kwargs: Any) -> AttentionMetadata:
        raise NotImplementedError


class AttentionBackend(ABC):
    """A family of attention kernels and the data they need."""

    accept_output_buffer: ClassVar[bool] = True
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    supports_sliding_window: ClassVar[bool] = False
    """Whether the impl applies `sliding_window`; the selector never gives a layer with a
    window a backend that would ignore it."""
    supports_logits_soft_cap: ClassVar[bool] = False
    """Whether the impl applies `logits_soft_cap`; the selector never gives a layer with a
    cap a backend that would ignore it."""

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        raise NotImplementedError

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        """The layout of one layer's cache: K and V stacked on the first dimension."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size > 0

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run in this process (a missing package, the wrong
        device), or None."""
        return None
