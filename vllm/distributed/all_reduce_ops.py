"""The graph ops of the tensor-parallel all-reduce and of its fusion with RMSNorm, each
dispatching to the group's fastest path.

    torch.ops.vllm.all_reduce(x, group_name) -> sum of x over the group
    torch.ops.vllm.fused_all_reduce_rms_norm(x, residual, weight, eps, group_name)
        -> (rms_norm(sum + residual) * weight, sum + residual)   [residual None: + 0]
    torch.ops.vllm.fused_all_reduce_rms_norm_static_fp8_quant(x, residual, weight, scale, eps,
                                                             group_name)
        -> (static FP8 quant of that norm, sum + residual)

`tensor_model_parallel_all_reduce` emits the first op when its group has a fusable path (see
`GroupCoordinator.all_reduce_is_fusable`), and the AllReduce+RMSNorm pass
(vllm/compilation/passes/fusion/allreduce_rms_fusion.py) replaces all-reduce -> (residual add)
-> RMSNorm [-> static FP8 quant] with one of the fused ops. Paths, in order:

- the CPU's shared-memory segment (vllm/distributed/shm_all_reduce.py), when the tensor fits
  its slot: one pass over the reduced rows sums, adds, normalises and quantises;
- FlashInfer's fused all-reduce on CUDA (vllm/distributed/flashinfer_all_reduce.py), when the
  group has a workspace and the tensor is within its token limit;
- torch.distributed's all-reduce of the group (gloo or NCCL), then the reference RMSNorm and
  quant (beyond the limits above: every rank decides alike, the shapes being equal).

Within `pattern_tracing()` the ops compute locally (no communication): the fusion patterns
are traced by running them on example tensors.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from vllm.distributed import flashinfer_all_reduce, shm_all_reduce

_pattern_tracing = False


@contextlib.contextmanager
def pattern_tracing() -> Iterator[None]:
    """Within the block the ops compute locally (no communication)."""
    global _pattern_tracing
    previous, _pattern_tracing = _pattern_tracing, True
    try:
        yield
    finally:
        _pattern_tracing = previous


def _group(group_name: str) -> Any:
    group = shm_all_reduce.get_group(group_name) or flashinfer_all_reduce.get_group(group_name)
    if group is None:
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group_name)
    return group


def _torch_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    import torch.distributed as dist

    out = x.contiguous().clone()
    dist.all_reduce(out, group=_group(group_name))
    return out


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of `x` over the group: through shared memory when the group has a segment and `x`
    fits, else torch.distributed."""
    comm = shm_all_reduce.get_shm_all_reduce(group_name)
    if comm is not None and comm.usable(x):
        return comm.all_reduce(x)
    if _pattern_tracing:
        return x.clone()
    return _torch_all_reduce(x, group_name)


def reference_rms_norm(reduced: torch.Tensor, residual: torch.Tensor | None,
                       weight: torch.Tensor, epsilon: float, scale: torch.Tensor | None):
    """RMSNorm.forward_native (+ static FP8 quant) on the reduced tensor: (out, residual_out),
    residual_out being the reduced tensor itself without a residual."""
    from vllm.model_executor.kernels.fp8_ops import ref_rms_norm, ref_static_quant

    if residual is not None:
        y, res = ref_rms_norm(reduced, weight, epsilon, residual)
    else:
        y, res = ref_rms_norm(reduced, weight, epsilon), reduced
    if scale is not None:
        y = ref_static_quant(y, scale)
    return y, res


def fused_all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor | None,
                              weight: torch.Tensor, epsilon: float, group_name: str,
                              scale: torch.Tensor | None = None):
    same_dtype = weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
    comm = shm_all_reduce.get_shm_all_reduce(group_name)
    if comm is not None and comm.usable(x) and same_dtype:
        return torch.ops.vllm_shm_ar.all_reduce_rms_norm(x, residual, weight, epsilon, scale,
                                                         comm.handle)
    fused = flashinfer_all_reduce.get_flashinfer_all_reduce(group_name)
    if fused is not None and same_dtype and not _pattern_tracing and fused.usable(x):
        return fused.all_reduce_rms_norm(x, residual, weight, epsilon, scale)
    reduced = x.clone() if _pattern_tracing else _torch_all_reduce(x, group_name)
    return reference_rms_norm(reduced, residual, weight, epsilon, scale)


def _fused_plain(x, residual, weight, epsilon, group_name):
    return fused_all_reduce_rms_norm(x, residual, weight, epsilon, group_name)


def _fused_quant(x, residual, weight, scale, epsilon, group_name):
    return fused_all_reduce_rms_norm(x, residual, weight, epsilon, group_name, scale)


def _fake_all_reduce(x, group_name):
    return torch.empty_like(x)


def _fake_fused_plain(x, residual, weight, epsilon, group_name):
    return torch.empty_like(x), torch.empty_like(x)


def _fake_fused_quant(x, residual, weight, scale, epsilon, group_name):
    return torch.empty_like(x, dtype=torch.float8_e4m3fn), torch.empty_like(x)


# A library fragment rather than torch.library.custom_op (whose per-call wrapper costs ~9 us,
# as much as the shared-memory all-reduce of a decode step itself).
_lib = torch.library.Library("vllm", "FRAGMENT")  # noqa: TOR901
_lib.define("all_reduce(Tensor x, str group_name) -> Tensor")
_lib.define("fused_all_reduce_rms_norm(Tensor x, Tensor? residual, Tensor weight, "
            "float epsilon, str group_name) -> (Tensor, Tensor)")
_lib.define("fused_all_reduce_rms_norm_static_fp8_quant(Tensor x, Tensor? residual, "
            "Tensor weight, Tensor scale, float epsilon, str group_name) -> (Tensor, Tensor)")
for _name, _impl, _fake in (("all_reduce", all_reduce, _fake_all_reduce),
                            ("fused_all_reduce_rms_norm", _fused_plain, _fake_fused_plain),
                            ("fused_all_reduce_rms_norm_static_fp8_quant", _fused_quant,
                             _fake_fused_quant)):
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"vllm::{_name}", _fake, lib=_lib)
