"""Collectives over the tensor-parallel group: identity at world size 1.

They use torch's functional collectives, which Dynamo can trace, so a model with
`tensor_model_parallel_all_reduce` in its forward compiles as one graph.
"""
from __future__ import annotations

import torch

from vllm.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel ranks (returns `x` itself at size 1)."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(x, "sum", tp.group))


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `x` along `dim`, in rank order."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    import torch.distributed._functional_collectives as funcol

    dim = dim % x.dim()
    gathered = funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), 0, tp.group))
    if dim == 0:
        return gathered
    # all_gather_tensor stacks along dim 0; move each rank's chunk to `dim`.
    chunks = gathered.chunk(tp.world_size, dim=0)
    return torch.cat(chunks, dim=dim)
