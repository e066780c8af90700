"""KV cache settings: block size, how much memory the cache gets, prefix caching."""
from __future__ import annotations

from dataclasses import dataclass

from vllm.config.utils import hash_fields, parse_human_size

_CACHE_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
                        "float": "float32", "fp32": "float32"}
# FP8 caches: the torch dtype each name stores ("fp8" is E4M3, as upstream's).
FP8_CACHE_TORCH_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                    "fp8_e5m2": "float8_e5m2"}
CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", *FP8_CACHE_TORCH_DTYPES)


@dataclass
class CacheConfig:
    block_size: int = 16
    """Tokens per KV cache block."""
    gpu_memory_utilization: float = 0.9
    """CUDA: fraction of the device memory the engine may use (weights, activations, KV cache)."""
    kv_cache_memory: int | str | None = None
    """CPU: bytes for the KV cache (human readable like 4GiB). Default: VLLM_CPU_KVCACHE_SPACE
    (GiB) or 4 GiB."""
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    """Use exactly this many KV blocks (tests, debugging)."""
    cache_dtype: str = "auto"
    """"auto" = the model's compute dtype; "bfloat16", "float16", "float32"; "fp8" (=
    "fp8_e4m3") or "fp8_e5m2": one byte per value, each layer's K and V divided by its
    k_scale / v_scale (from the checkpoint, else 1.0) and saturated."""

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_human_size(self.kv_cache_memory, "kv_cache_memory")
            if self.kv_cache_memory <= 0:
                raise ValueError(
                    f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be at least 2 (one block is reserved "
                             f"for padding), got {self.num_gpu_blocks_override}")
        self.cache_dtype = _CACHE_DTYPE_ALIASES.get(str(self.cache_dtype), self.cache_dtype)
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(CACHE_DTYPES)}; "
                             f"got {self.cache_dtype!r}")

    def compute_hash(self) -> str:
        # Memory sizing never changes the compiled graph.
        return hash_fields(self, exclude=("gpu_memory_utilization", "kv_cache_memory",
                                          "num_gpu_blocks_override", "enable_prefix_caching"))
