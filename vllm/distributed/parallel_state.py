"""Tensor-parallel process groups.

With no group initialised every getter answers "rank 0 of a world of 1", so tensor
parallelism of size 1 needs no torch.distributed at all. `init_distributed_environment` plus
`initialize_model_parallel` set up the default process group (gloo on the CPU, nccl on CUDA)
and the tensor-parallel group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GroupCoordinator:
    """One process group and this process's place in it."""

    group: Any  # torch.distributed.ProcessGroup, or None for a world of one
    rank_in_group: int
    world_size: int
    ranks: list[int]
    backend: str = "gloo"
    shm_all_reduce: Any = None
    """The group's shared-memory all-reduce (vllm/distributed/shm_all_reduce.py), when all its
    ranks are on one host and the CPU path is on; None: torch.distributed's all-reduce."""

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0


_TP: GroupCoordinator | None = None


def init_distributed_environment(world_size: int, rank: int, backend: str = "gloo",
                                 distributed_init_method: str = "env://",
                                 local_rank: int = 0) -> None:
    """Initialise torch.distributed's default group (no-op if it already is)."""
    import torch.distributed as dist

    del local_rank
    if dist.is_initialized():
        return
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} processes")
    dist.init_process_group(backend=backend, init_method=distributed_init_method,
                            world_size=world_size, rank=rank)


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              backend: str | None = None) -> None:
    """Create the tensor-parallel group over all ranks of the default group."""
    global _TP
    import torch.distributed as dist

    if tensor_model_parallel_size == 1 and not dist.is_initialized():
        _TP = GroupCoordinator(group=None, rank_in_group=0, world_size=1, ranks=[0])
        return
    if not dist.is_initialized():
        raise RuntimeError("tensor_model_parallel_size > 1 needs init_distributed_environment() "
                           "first")
    world = dist.get_world_size()
    if world != tensor_model_parallel_size:
        raise ValueError(f"tensor_model_parallel_size ({tensor_model_parallel_size}) must equal "
                         f"the world size ({world}); pipeline parallelism is not supported")
    backend = backend or dist.get_backend()
    ranks = list(range(world))
    group = dist.new_group(ranks, backend=backend)
    _TP = GroupCoordinator(group=group, rank_in_group=dist.get_rank(), world_size=world,
                           ranks=ranks, backend=str(backend))
    if _TP is not None and _TP.world_size > 1 and str(backend) == "gloo":
        # Ranks of one host all-reduce through shared memory (collective over the TP group).
        from vllm.distributed.shm_all_reduce import init_shm_all_reduce

        _TP.shm_all_reduce = init_shm_all_reduce(_TP.group, _TP.rank_in_group, world,
                                                 src_rank=_TP.ranks[0])


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def get_tp_group() -> GroupCoordinator:
    """The tensor-parallel group; a world of one when none was initialised."""
    if _TP is None:
        return GroupCoordinator(group=None, rank_in_group=0, world_size=1, ranks=[0])
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def destroy_model_parallel() -> None:
    global _TP
    if _TP is not None and _TP.shm_all_reduce is not None:
        from vllm.distributed.shm_all_reduce import destroy_shm_all_reduce

        destroy_shm_all_reduce(_TP.group.group_name)
    _TP = None


def destroy_distributed_environment() -> None:
    import torch.distributed as dist

    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
