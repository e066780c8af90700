"""CPU tensors in transparent huge pages: the weights, their packed copies and the KV cache.

A decode step streams every weight from memory once. With 4 KiB pages each page is a TLB
miss (in a virtual machine a two-level page walk) and the hardware prefetchers restart at
every page boundary; with 2 MiB pages neither happens. Measured on the Zen 4 dev machine
(a 2-vCPU VM, THP "madvise"): a plain sum over 128 MiB read 18 GB/s on one thread with 4 KiB
pages against 32-36 with 2 MiB pages; on two threads 30-59 against 40-73 (paired runs, the
host's load moving both); all the linears of a batch-1 decode step of the 50M Llama in
bfloat16 1.14-1.31x, of the Qwen2.5-0.5B shape in float32 1.04x.

Linux gives an anonymous private mapping huge pages where THP is "always", or "madvise" and
the mapping is advised MADV_HUGEPAGE (most distributions' default is one of the two). torch's
allocator advises nothing, so `cpu_zeros` maps each tensor of 2 MiB or more itself: a mapping
of its own, advised, the tensor starting on a 2 MiB boundary of it. The pages are the kernel's
fresh zero pages until written (zero-filled). Only the tensor's whole 2 MiB pages are advised:
its tail, and the rest of the mapping, stay in 4 KiB pages (with THP "madvise"). Elsewhere
(another OS, THP "never", VLLM_CPU_HUGE_PAGES=0, smaller tensors) it is `torch.zeros`.

The tensor's storage is the whole mapping (2 MiB more than the tensor, never touched, so never
resident), kept alive by the storage like any other.
"""
from __future__ import annotations

import functools
import math
import mmap
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def transparent_huge_pages() -> str:
    """The kernel's THP mode ("always", "madvise" or "never"); "" where it cannot be read."""
    try:
        with open(THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def huge_pages_enabled() -> bool:
    """Whether `cpu_zeros` maps large tensors itself: Linux with THP "always" or "madvise",
    unless VLLM_CPU_HUGE_PAGES=0 (a value that is not on/off is a ValueError naming it)."""
    from vllm import envs

    if not envs.VLLM_CPU_HUGE_PAGES:
        return False
    return sys.platform.startswith("linux") and transparent_huge_pages() in ("always",
                                                                             "madvise")


def cpu_zeros(shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous zero-filled CPU tensor; from HUGE_PAGE_BYTES on (and `huge_pages_enabled`)
    in an anonymous mapping of its own advised for transparent huge pages, starting on a huge
    page boundary."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_BYTES or not huge_pages_enabled():
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    try:
        # only the tensor's whole huge pages: a partial last one would hold up to 2 MiB that
        # the tensor does not use (~0.2 GB over the 0.5B shape's weights and panel copies)
        mapping.madvise(mmap.MADV_HUGEPAGE, offset,
                        nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    except (OSError, AttributeError):  # a kernel without THP: still a valid mapping
        pass
    return raw[offset:offset + nbytes].view(dtype).view(shape)
