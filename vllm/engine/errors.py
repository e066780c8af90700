"""Which failures mean the engine itself is broken, as opposed to one request being bad.

A step that raises is, by default, a request's problem: the engine fails the requests that
caused it and goes on (`vllm.engine.step_recovery`). The errors below are the exceptions: after
them no later step can be trusted, so the engine is dead and only a restart helps.
"""
from __future__ import annotations

__all__ = ["EngineFatalError", "is_fatal"]

# Messages of errors that leave a device or a process group unusable for every later call
# (a sticky CUDA error, a broken collective), for torch builds that raise them as plain
# RuntimeError rather than as the classes checked below.
_FATAL_MESSAGES = ("CUDA error", "HIP error", "device-side assert", "NCCL error", "ncclInternal",
                   "ncclSystemError", "Connection closed by peer", "Connection reset by peer",
                   "gloo/transport")


class EngineFatalError(RuntimeError):
    """The engine can no longer run steps: a tensor-parallel worker died or stopped answering,
    a collective failed, a device error that sticks, a failed health check, or repeated
    failures that no request can be blamed for."""


def is_fatal(exc: BaseException) -> bool:
    """True when `exc`, raised by a step, means the engine is broken (see the module doc)."""
    if isinstance(exc, EngineFatalError):
        return True
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: not ours to contain
        return True
    import torch

    dist_error = getattr(getattr(torch, "distributed", None), "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)  # sticky CUDA/HIP errors
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return any(marker in text for marker in _FATAL_MESSAGES)
