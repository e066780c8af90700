"""Tensor- and pipeline-parallel process groups.

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
    flashinfer_all_reduce: Any = None
    """The group's FlashInfer fused all-reduce workspace (vllm/distributed/
    flashinfer_all_reduce.py), when the AllReduce+RMSNorm fusion is on and CUDA can serve it."""

    @property
    def all_reduce_is_fusable(self) -> bool:
        """Whether the group's all-reduce is emitted as `torch.ops.vllm.all_reduce`, the op the
        AllReduce+RMSNorm pass matches (vllm/distributed/all_reduce_ops.py)."""
        return self.world_size > 1 and self.group is not None and (
            self.shm_all_reduce is not None or self.flashinfer_all_reduce is not None)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """The global rank after this one in the group (pipeline: the next stage)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """The global rank before this one in the group (pipeline: the previous stage)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]


_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None


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
                              pipeline_model_parallel_size: int = 1,
                              backend: str | None = None) -> None:
    """Create the tensor-parallel and pipeline-parallel groups over the default group.

    Global rank r is pipeline stage r // tp and tensor-parallel rank r % tp (upstream's
    layout): stage s holds ranks [s*tp, (s+1)*tp), and the pipeline group of tensor-parallel
    rank t is [t, t+tp, t+2*tp, ...]. Every rank creates every group (torch.distributed's
    rule), in the same order."""
    global _TP, _PP
    import torch.distributed as dist

    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if tp * pp == 1 and not dist.is_initialized():
        _TP = GroupCoordinator(group=None, rank_in_group=0, world_size=1, ranks=[0])
        _PP = GroupCoordinator(group=None, rank_in_group=0, world_size=1, ranks=[0])
        return
    if not dist.is_initialized():
        raise RuntimeError("tensor/pipeline parallelism > 1 needs init_distributed_environment() "
                           "first")
    world = dist.get_world_size()
    if world != tp * pp:
        raise ValueError(f"tensor_model_parallel_size ({tp}) x pipeline_model_parallel_size "
                         f"({pp}) must equal the world size ({world})")
    backend = backend or dist.get_backend()
    rank = dist.get_rank()
    for stage in range(pp):
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            _TP = GroupCoordinator(group=group, rank_in_group=ranks.index(rank), world_size=tp,
                                   ranks=ranks, backend=str(backend))
    for tp_rank in range(tp):
        ranks = list(range(tp_rank, world, tp))
        # (point-to-point sends go over the default group; a group of one needs none)
        group = dist.new_group(ranks, backend=backend) if pp > 1 else None
        if rank in ranks:
            _PP = GroupCoordinator(group=group, rank_in_group=ranks.index(rank), world_size=pp,
                                   ranks=ranks, backend=str(backend))
    if tp > 1:
        import vllm.distributed.all_reduce_ops  # noqa: F401  (the group's graph ops)
    if _TP is not None and _TP.world_size > 1 and str(backend) == "gloo":
        # Ranks of one host all-reduce through shared memory (collective over the TP group).
        from vllm.distributed.shm_all_reduce import init_shm_all_reduce

        _TP.shm_all_reduce = init_shm_all_reduce(_TP.group, _TP.rank_in_group, tp,
                                                 src_rank=_TP.ranks[0])


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def get_tp_group() -> GroupCoordinator:
    """The tensor-parallel group; a world of one when none was initialised."""
    if _TP is None:
        return GroupCoordinator(group=None, rank_in_group=0, world_size=1, ranks=[0])
    return _TP


def get_pp_group() -> GroupCoordinator:
    """The pipeline-parallel group (this rank's stage and its neighbours); a world of one
    when none was initialised."""
    if _PP is None:
        return GroupCoordinator(group=None, rank_in_group=0, world_size=1, ranks=[0])
    return _PP


def get_pipeline_model_parallel_rank() -> int:
    return get_pp_group().rank_in_group


def get_pipeline_model_parallel_world_size() -> int:
    return get_pp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def destroy_model_parallel() -> None:
    global _TP, _PP
    if _TP is not None and _TP.shm_all_reduce is not None:
        from vllm.distributed.shm_all_reduce import destroy_shm_all_reduce

        destroy_shm_all_reduce(_TP.group.group_name)
    if _TP is not None and _TP.flashinfer_all_reduce is not None:
        from vllm.distributed.flashinfer_all_reduce import destroy_flashinfer_all_reduce

        destroy_flashinfer_all_reduce(_TP.group.group_name)
    _TP = None
    _PP = None


def destroy_distributed_environment() -> None:
    import torch.distributed as dist

    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
