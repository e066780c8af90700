"""Shared-memory all-reduce for tensor-parallel ranks on one host (the CPU platform).

gloo's all-reduce between processes of one machine goes through TCP loopback: at decode sizes
(a few KiB to a few hundred KiB per call, two calls per layer) its latency dominates. Ranks on
one host instead exchange their tensors through one POSIX shared-memory segment per
tensor-parallel group and each sums the ranks' copies itself (csrc/shm_all_reduce.cpp, a C++
kernel built like the engine's other CPU kernels; the protocol is described there).

Set-up (`init_shm_all_reduce`, collective over the group's gloo group, at
`initialize_model_parallel`): the ranks compare host identities; rank 0 creates the segment
and broadcasts its name; the others attach; once every rank has attached (or failed to),
rank 0 unlinks the name. From then on the segment lives exactly as long as some rank maps it:
a rank that dies leaves nothing behind in /dev/shm, and a clean shutdown unmaps it
(`destroy_shm_all_reduce`). Any failure on any rank (no compiler, not enough /dev/shm, ranks
on different hosts, `VLLM_CPU_SHM_ALLREDUCE=0`) makes every rank keep gloo.

In graphs the all-reduce is the op `torch.ops.vllm.all_reduce(x, group_name)`: the shared
memory for tensors up to `VLLM_SHM_ALLREDUCE_MAX_BYTES` (default 4 MiB, the slot size) of
float32 / bfloat16 / float16, gloo beyond (all ranks decide alike: the size is the same on
every rank). The AllReduce+RMSNorm fusion pass replaces all-reduce -> (residual add) ->
RMSNorm [-> static FP8 quant] with `torch.ops.vllm.fused_all_reduce_rms_norm[_static_fp8_quant]`,
which sums, adds the residual, normalises and quantises each row in one pass over the
reduced data.

A waiting rank spins a few microseconds, then yields, then sleeps with a growing back-off
(never burning a core on a slow peer); it raises when a peer process exited, or after
`VLLM_SHM_ALLREDUCE_TIMEOUT_S` (default 1800 s, as torch.distributed's timeout).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vllm.logger import init_logger
from vllm.utils.cpu_kernels import load_cpu_extension, switched_off

logger = init_logger(__name__)

ENV_SWITCH = "VLLM_CPU_SHM_ALLREDUCE"
ENV_MAX_BYTES = "VLLM_SHM_ALLREDUCE_MAX_BYTES"
DEFAULT_MAX_BYTES = 4 << 20
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc",
                       "shm_all_reduce.cpp")
_KERNEL_NAME = "shm_all_reduce"


def shm_all_reduce_enabled() -> bool:
    """The environment switch (on unless VLLM_CPU_SHM_ALLREDUCE is 0/false/off/no)."""
    return not switched_off(ENV_SWITCH)


def max_bytes_from_env() -> int:
    text = os.environ.get(ENV_MAX_BYTES, "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value <= 0:
        raise ValueError(f"{ENV_MAX_BYTES}={text!r}: use a positive number of bytes")
    return value


def load_kernel() -> bool:
    return load_cpu_extension(_KERNEL_NAME, _SOURCE, ENV_SWITCH)


def host_identity() -> str:
    """Equal for processes of one machine (one boot of one host)."""
    boot = ""
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    return f"{socket.gethostname()}/{boot}"


@dataclass
class ShmAllReduce:
    """This rank's attachment to its group's segment."""

    handle: int
    rank: int
    world_size: int
    max_bytes: int
    group_name: str
    name: str

    def usable(self, x: torch.Tensor) -> bool:
        return (x.dtype in SUPPORTED_DTYPES and x.device.type == "cpu"
                and x.numel() * x.element_size() <= self.max_bytes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.vllm_shm_ar.all_reduce(x, self.handle)

    def close(self) -> None:
        if self.handle >= 0:
            torch.ops.vllm_shm_ar.detach(self.handle)
            self.handle = -1


_COMMS: dict[str, ShmAllReduce] = {}
_GROUPS: dict[str, Any] = {}


def init_shm_all_reduce(group: Any, rank: int, world_size: int, src_rank: int,
                        max_bytes: int | None = None) -> ShmAllReduce | None:
    """Collective over `group` (every rank calls it): attach this rank to a new shared-memory
    segment for the group; None on every rank when any rank cannot (they then keep gloo).
    `src_rank` is the global rank of the group's first rank."""
    import torch.distributed as dist

    if world_size < 2:
        return None
    max_bytes = max_bytes if max_bytes is not None else max_bytes_from_env()
    slot_bytes = (max_bytes + 63) // 64 * 64
    enabled = shm_all_reduce_enabled()
    ready = enabled and load_kernel()
    views: list[Any] = [None] * world_size
    dist.all_gather_object(views, (enabled, ready, host_identity()), group=group)
    if not all(v[0] for v in views):
        logger.info("Shared-memory all-reduce is off (%s=0): tensor parallelism all-reduces "
                    "over gloo", ENV_SWITCH)
        return None
    if len({v[2] for v in views}) > 1:
        logger.info("Tensor-parallel ranks are on %d hosts: all-reduce over gloo",
                    len({v[2] for v in views}))
        return None
    if not all(v[1] for v in views):
        logger.warning("The shared-memory all-reduce kernel could not be built on every rank: "
                       "tensor parallelism all-reduces over gloo")
        return None

    handle, error = -1, ""
    name = ""
    if rank == 0:
        name = f"/vllm_ar_{os.getpid()}_{secrets.token_hex(4)}"
        need = 4096 + world_size * 2 * slot_bytes
        try:
            stat = os.statvfs("/dev/shm")
            free = stat.f_bavail * stat.f_frsize
        except OSError:
            free = need
        if free < need:
            error = f"/dev/shm has {free} bytes free, the segment needs {need}"
            name = ""
        else:
            try:
                handle = torch.ops.vllm_shm_ar.attach(name, slot_bytes, 0, world_size, True)
            except RuntimeError as e:
                error, name = str(e).splitlines()[0], ""
    names = [name]
    dist.broadcast_object_list(names, src=src_rank, group=group)
    name = names[0]
    if rank != 0 and name:
        try:
            handle = torch.ops.vllm_shm_ar.attach(name, slot_bytes, rank, world_size, False)
        except RuntimeError as e:
            error = str(e).splitlines()[0]
    results: list[Any] = [None] * world_size
    dist.all_gather_object(results, (handle >= 0, error), group=group)
    if rank == 0 and name:
        torch.ops.vllm_shm_ar.unlink(name)  # every rank has attached (or given up)
    if not all(ok for ok, _ in results):
        if handle >= 0:
            torch.ops.vllm_shm_ar.detach(handle)
        reason = next(err for ok, err in results if not ok) or "no segment"
        logger.warning("Shared-memory all-reduce unavailable (%s): all-reduce over gloo",
                       reason)
        return None
    comm = ShmAllReduce(handle, rank, world_size, slot_bytes, group.group_name, name)
    _COMMS[group.group_name] = comm
    _GROUPS[group.group_name] = group
    logger.info("Tensor-parallel all-reduce through shared memory (%d ranks, up to %d bytes "
                "per call; gloo beyond)", world_size, slot_bytes)
    return comm


def destroy_shm_all_reduce(group_name: str | None = None) -> None:
    """Unmap the segment of `group_name` (of every group when None)."""
    names = list(_COMMS) if group_name is None else [group_name]
    for name in names:
        comm = _COMMS.pop(name, None)
        _GROUPS.pop(name, None)
        if comm is not None:
            comm.close()


# ---- the graph ops ---------------------------------------------------------------------------
_pattern_tracing = False


@contextlib.contextmanager
def pattern_tracing() -> Iterator[None]:
    """Within the block the ops compute locally (no communication): fusion patterns are
    traced by running them on example tensors."""
    global _pattern_tracing
    previous, _pattern_tracing = _pattern_tracing, True
    try:
        yield
    finally:
        _pattern_tracing = previous


def _group(group_name: str) -> Any:
    group = _GROUPS.get(group_name)
    if group is None:
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group_name)
    return group


def _gloo_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    import torch.distributed as dist

    out = x.contiguous().clone()
    dist.all_reduce(out, group=_group(group_name))
    return out


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of `x` over the group: through shared memory when the group has a segment and `x`
    fits, else gloo."""
    comm = _COMMS.get(group_name)
    if comm is not None and comm.usable(x):
        return torch.ops.vllm_shm_ar.all_reduce(x, comm.handle)
    if _pattern_tracing:
        return x.clone()
    return _gloo_all_reduce(x, group_name)


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
    comm = _COMMS.get(group_name)
    if comm is not None and comm.usable(x) and weight.dtype == x.dtype and (
            residual is None or residual.dtype == x.dtype):
        return torch.ops.vllm_shm_ar.all_reduce_rms_norm(x, residual, weight, epsilon, scale,
                                                         comm.handle)
    reduced = x.clone() if _pattern_tracing else _gloo_all_reduce(x, group_name)
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
