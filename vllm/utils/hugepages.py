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

A model's weights are many tensors, most of them no whole number of huge pages (the 50M Llama's
1 MiB o_proj, the 1.1 MiB tail of its 3 MiB qkv_proj; in bfloat16 most of its linears are under
2 MiB): one mapping each left 37% of its float32 layer weights (70% in bfloat16) in 4 KiB
pages. `HugePageArena` carves them one after another out of shared mappings advised whole, so
every byte but a mapping's last partial huge page is in huge pages. Measured (Zen 4, built as
AVX2): the 32 layer linears of a 50M batch-1 step called back to back 3.06-3.72 -> 2.71-3.00
ms (one 104 MB product of the same bytes: 2.55-2.87 ms); a whole batch-1 decode step, paired
in one engine (benchmarks/bench_weight_arena.py), 0.98-0.99x the time. The model loader
(`materialize`) and the weight prepacker allocate through one, and weights made after loading
(an FP8 checkpoint's dequantized linears: `weight_zeros`) through the loader's `weight_arena`.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import math
import mmap
import sys
import weakref
from collections.abc import Iterator

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


ARENA_ALIGN = 64
"""Bytes each arena tensor starts on a multiple of (a cache line, as torch's CPU allocator)."""
ARENA_MIN_MAPPING = 64 << 20
"""Bytes of address space an arena maps at least when it needs a new mapping (only what is
written becomes resident)."""
PAGE_BYTES = mmap.PAGESIZE


class _ArenaMapping:
    """One anonymous mapping of an arena: `capacity` bytes from `base` (a huge page boundary),
    advised for huge pages. Kept alive by the arena while it carves from it and by each tensor
    carved from it; unmapped when the last is gone."""

    def __init__(self, capacity: int) -> None:
        capacity = -(-capacity // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        self.mapping = mmap.mmap(-1, capacity + HUGE_PAGE_BYTES,
                                 flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # (a ctypes view of the mapping's first byte: its address; it pins the mapping open)
        self._anchor = ctypes.c_uint8.from_buffer(self.mapping)
        self.base = -ctypes.addressof(self._anchor) % HUGE_PAGE_BYTES
        self.capacity = capacity
        self.used = 0
        try:
            self.mapping.madvise(mmap.MADV_HUGEPAGE, self.base, capacity)
        except (OSError, AttributeError):  # a kernel without THP: still a valid mapping
            pass

    def carve(self, nbytes: int) -> ctypes.Array | None:
        """A buffer of `nbytes` zero bytes (never written before) after the last one carved;
        None when the mapping has no room left."""
        start = -(-self.used // ARENA_ALIGN) * ARENA_ALIGN
        if start + nbytes > self.capacity:
            return None
        self.used = start + nbytes
        offset = self.base + start
        buffer = (ctypes.c_uint8 * nbytes).from_address(ctypes.addressof(self._anchor) + offset)
        buffer.arena_mapping = self  # (the mapping lives as long as any tensor on it)
        weakref.finalize(buffer, self.release, offset, nbytes).atexit = False
        return buffer

    def release(self, offset: int, nbytes: int) -> None:
        """A carved tensor is gone: the 4 KiB pages wholly inside it go back to the kernel
        (a weight replaced after loading, say a dequantized one, holds no memory twice)."""
        lo = -(-offset // PAGE_BYTES) * PAGE_BYTES
        hi = (offset + nbytes) // PAGE_BYTES * PAGE_BYTES
        if hi > lo and not self.mapping.closed:
            try:
                self.mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (OSError, AttributeError):
                pass


class HugePageArena:
    """Zero-filled CPU tensors carved one after another (cache-line aligned) out of shared
    anonymous mappings advised whole for transparent huge pages: the weights of a model, so
    that tensors of any size, and the tails of large ones, sit in huge pages (the module's
    docstring has the measurements). Each tensor has its own storage (its own version counter
    and data pointer); a mapping is unmapped when the arena and every tensor carved from it are
    gone, and the memory of a tensor that dies before its neighbours goes back to the kernel.
    Where `huge_pages_enabled()` is false, `zeros` is `torch.zeros`.

    `capacity`: the bytes the first mapping holds (the caller's total, when it knows it:
    one mapping, nothing left over); later mappings hold at least ARENA_MIN_MAPPING."""

    def __init__(self, capacity: int = 0) -> None:
        self._capacity = max(int(capacity), 0)
        self._mapping: _ArenaMapping | None = None

    @staticmethod
    def room(shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype) -> int:
        """The bytes a tensor takes in an arena, alignment included (to size `capacity`)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN

    def zeros(self, shape: tuple[int, ...] | list[int] | torch.Size,
              dtype: torch.dtype) -> torch.Tensor:
        """A contiguous zero-filled CPU tensor in the arena's memory."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0 or not huge_pages_enabled():
            return torch.zeros(shape, dtype=dtype)
        buffer = self._mapping.carve(nbytes) if self._mapping is not None else None
        if buffer is None:
            self._mapping = _ArenaMapping(max(nbytes, self._capacity or ARENA_MIN_MAPPING))
            self._capacity = 0
            buffer = self._mapping.carve(nbytes)
        return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


_current_arena: contextvars.ContextVar[HugePageArena | None] = contextvars.ContextVar(
    "vllm_weight_arena", default=None)


@contextlib.contextmanager
def weight_arena(capacity: int = 0) -> Iterator[HugePageArena]:
    """A HugePageArena that `weight_zeros` carves from inside the block (the model loader's,
    around the weights' processing after loading)."""
    arena = HugePageArena(capacity)
    token = _current_arena.set(arena)
    try:
        yield arena
    finally:
        _current_arena.reset(token)


def weight_zeros(shape: tuple[int, ...] | list[int] | torch.Size,
                 dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor for a weight made after loading: from the current
    `weight_arena`, else `cpu_zeros`."""
    arena = _current_arena.get()
    return arena.zeros(shape, dtype) if arena is not None else cpu_zeros(shape, dtype)
