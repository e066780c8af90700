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

Graphs call it through `torch.ops.vllm.all_reduce` (vllm/distributed/all_reduce_ops.py), for
tensors up to `VLLM_SHM_ALLREDUCE_MAX_BYTES` (default 4 MiB, the slot size) of float32 /
bfloat16 / float16, gloo beyond (all ranks decide alike: the size is the same on every rank);
the kernel's fused entry also adds the residual, normalises and quantises each row in one
pass over the reduced data (the AllReduce+RMSNorm fusion's CPU op).

A waiting rank spins a few microseconds, then yields, then sleeps with a growing back-off
(never burning a core on a slow peer); it raises when a peer process exited, or after
`VLLM_SHM_ALLREDUCE_TIMEOUT_S` (default 1800 s, as torch.distributed's timeout).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import socket
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


def get_shm_all_reduce(group_name: str) -> ShmAllReduce | None:
    """The group's segment, when it has one."""
    return _COMMS.get(group_name)


def get_group(group_name: str) -> Any:
    """The process group registered at set-up under `group_name` (None if none)."""
    return _GROUPS.get(group_name)
