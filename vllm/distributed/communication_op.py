"""Collectives over the tensor-parallel group: identity at world size 1.

They call torch's functional collective ops (`torch.ops._c10d_functional`), which Dynamo can
trace, so a model with `tensor_model_parallel_all_reduce` in its forward compiles as one
graph. The ops are called directly, not through the Python API in
`torch.distributed._functional_collectives`: that wraps eager results in a tensor subclass
through a `torch.library.custom_op`, whose first call imports Dynamo (~0.8 s of a start-up,
also at -O0 and on a warm start that loads the compiled pieces without it).

A group with a fusable all-reduce (ranks sharing one host on the CPU: shared memory; CUDA with
FlashInfer's fused all-reduce set up) calls `torch.ops.vllm.all_reduce` instead
(vllm/distributed/all_reduce_ops.py), the op the AllReduce+RMSNorm fusion pass matches.
"""
from __future__ import annotations

import torch

from vllm.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel ranks (returns `x` itself at size 1)."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    if tp.all_reduce_is_fusable:  # (initialize_model_parallel imported the op)
        return torch.ops.vllm.all_reduce(x, tp.group.group_name)
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_reduce(x, "sum", tp.group.group_name))


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `x` along `dim`, in rank order."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    ops = torch.ops._c10d_functional
    dim = dim % x.dim()
    gathered = ops.wait_tensor(ops.all_gather_into_tensor(x.contiguous(), tp.world_size,
                                                          tp.group.group_name))
    if dim == 0:
        return gathered
    # The ranks' tensors are stacked along dim 0; move each rank's chunk to `dim`.
    chunks = gathered.chunk(tp.world_size, dim=0)
    return torch.cat(chunks, dim=dim)
