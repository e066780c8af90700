"""Parallelism settings (tensor parallelism through torch.distributed)."""
from __future__ import annotations

from dataclasses import dataclass

from vllm.config.utils import hash_fields


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    """"uni" (one process) or "mp" (one process per rank); None = uni for TP 1, mp otherwise."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.pipeline_parallel_size != 1:
            raise ValueError("pipeline_parallel_size > 1 is not supported; use "
                             "tensor_parallel_size")
        if self.data_parallel_size != 1:
            raise ValueError("data_parallel_size > 1 is not supported")
        if self.distributed_executor_backend not in (None, "uni", "mp"):
            raise ValueError("distributed_executor_backend must be 'uni' or 'mp', got "
                             f"{self.distributed_executor_backend!r}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def compute_hash(self) -> str:
        return hash_fields(self, exclude=("distributed_executor_backend",))
