"""Parallelism settings: tensor and pipeline parallelism through torch.distributed, ranks run
by one process ("uni"), local processes ("mp") or Ray actors ("ray", multi-node)."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from vllm.config.utils import hash_fields

EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    """"uni" (one process), "mp" (one local process per rank) or "ray" (one Ray actor per
    rank, any node of a Ray cluster). None: uni for a world of 1; ray inside a Ray job or when
    the world is larger than this machine (GPUs on CUDA, cores on the CPU) and Ray is
    installed; else mp."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.data_parallel_size != 1:
            raise ValueError("data_parallel_size > 1 is not supported")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError("distributed_executor_backend must be one of "
                             f"{', '.join(map(repr, EXECUTOR_BACKENDS))}, got "
                             f"{self.distributed_executor_backend!r}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = default_executor_backend(self.world_size)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def compute_hash(self) -> str:
        return hash_fields(self, exclude=("distributed_executor_backend",))


def local_device_count() -> int:
    """Ranks this machine holds: its GPUs on CUDA, else its cores."""
    if os.environ.get("VLLM_PLATFORM", "").strip().lower() != "cpu":
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            return torch.cuda.device_count()
    return os.cpu_count() or 1


def default_executor_backend(world_size: int) -> str:
    if world_size == 1:
        return "uni"
    ray = sys.modules.get("ray")  # (inside a Ray job ray is imported; never import it here)
    if ray is not None and ray.is_initialized():
        return "ray"
    if world_size > local_device_count():
        import importlib.util

        # (without Ray installed the local processes oversubscribe the machine)
        if importlib.util.find_spec("ray") is not None:
            return "ray"
    return "mp"
