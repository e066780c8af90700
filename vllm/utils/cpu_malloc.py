"""Freed activation memory kept in the process for the next step (glibc's malloc, CPU workers).

glibc's malloc maps a block of its own for an allocation at or above its mapping threshold
(128 KiB, raised by the frees of such blocks up to 32 MiB) and unmaps it on free. A
prefill's large activations are such blocks (the Qwen2.5-0.5B shape at 2048 tokens: gate_up's
output 80 MB, the activation's 40 MB), so every step mapped them afresh and the kernel
faulted in and zeroed each 4 KiB page on first touch, inside whichever op wrote the tensor
first. Measured on the Zen 4 dev machine (2 vCPUs, as AVX2): a compiled SiluMul over
[2048, 9728] float32 took 16-19 ms, 5 ms with the memory kept.

`keep_freed_memory(pad)` sets malloc's top pad (M_TOP_PAD): each time the main heap grows it
grows by `pad` more than asked, and a free returns memory to the kernel only past `pad` bytes
of free space at the heap's top. Large tensors are then carved from that free space (malloc
maps a block of its own only when the heap cannot serve it) and given back to it, their pages
staying resident: the process keeps up to `pad` bytes of freed memory. It takes effect at the
heap's next growth, which the engine's start-up brings long before the first request. Measured
as AVX2 (fresh processes, interleaved; `benchmarks/bench_malloc_pad.py`): the 0.5B shape's
batch-16 prefill of 16 x 128 tokens 8.4-8.7 -> 7.7-7.8 s, its decode steps unchanged
(104.9-108.0 ms against 106.2-106.8). Fixing the mapping threshold at glibc's largest (32 MiB)
as well made decode steps ~4% slower: glibc's own threshold is kept. Only the main arena's heap
grows by the pad: allocations of threads with an arena of their own (the engine thread of
`VLLM_ENABLE_MULTIPROCESSING=0`) keep glibc's behaviour. A user's own MALLOC_TOP_PAD_,
MALLOC_MMAP_THRESHOLD_ or glibc.malloc tunables (GLIBC_TUNABLES) win, and
VLLM_CPU_MALLOC_TOP_PAD_MB=0 leaves malloc as it is; other C libraries are left alone.
"""
from __future__ import annotations

import ctypes
import os
import sys

from vllm.logger import init_logger

logger = init_logger(__name__)

M_TOP_PAD = -2  # mallopt's parameter (glibc's malloc.h)
# Variables by which a user tunes glibc's malloc themselves (then we change nothing), besides
# glibc.malloc.* in GLIBC_TUNABLES.
USER_MALLOC_ENV = ("MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_")


def users_malloc_settings() -> bool:
    """Whether the environment tunes glibc's malloc itself."""
    return (any(os.environ.get(name) for name in USER_MALLOC_ENV)
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""))

_applied: int | None = None


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def heap_top_free(libc) -> int | None:
    """Bytes free at the top of the main heap (mallinfo2's keepcost); None without
    mallinfo2."""
    try:
        info = libc.mallinfo2
    except AttributeError:
        return None
    info.restype = _MallInfo2
    return int(info().keepcost)


def _glibc():
    """The process's C library when it is glibc (it has mallopt and names its version)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_memory(pad_bytes: int) -> bool:
    """Set malloc's top pad to `pad_bytes`; True when glibc took it. Called once per CPU
    worker process; later calls return the first's answer."""
    global _applied
    if _applied is not None:
        return _applied > 0
    _applied = 0
    if pad_bytes <= 0 or users_malloc_settings():
        return False
    libc = _glibc()
    if libc is None:
        return False
    pad = min(pad_bytes, 2**31 - 1)  # (mallopt takes an int)
    if libc.mallopt(M_TOP_PAD, pad):
        _applied = pad
        logger.debug("malloc keeps up to %d MiB of freed memory for reuse", pad >> 20)
    return _applied > 0
