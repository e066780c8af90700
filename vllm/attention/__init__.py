"""Attention: the layer, the custom op (the compile split point) and the backends."""
from vllm.attention.backends.abstract import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
)
from vllm.attention.layer import Attention, bind_kv_cache, collect_attention_layers
from vllm.attention.selector import get_attn_backend

__all__ = ["Attention", "AttentionBackend", "AttentionCGSupport", "AttentionImpl",
           "AttentionMetadata", "AttentionMetadataBuilder", "bind_kv_cache",
           "collect_attention_layers", "get_attn_backend"]
