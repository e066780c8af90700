"""Build and load the CPU C++ kernels of the FP8 ops, cached under the vllm cache root.

    load_cpu_fp8_kernels()   # True once the kernels are registered for the CPU dispatch key

The library (cpu_fp8.cpp with cpu_fp8_kernels.h pasted in) registers its kernels with the
dispatcher (`TORCH_LIBRARY_IMPL(vllm, CPU, ...)`) for ops whose schemas fp8_ops.py defines:
after loading, a CPU call of `torch.ops.vllm.<op>` goes from the dispatcher straight to C++
(about 2 us per call, against about 12 us through a Python custom op).

The build and its cache are `vllm.utils.cpu_kernels.load_cpu_extension` (once per machine,
keyed by the source, flags, torch version and CPU flags); `VLLM_CPU_FP8_KERNELS=0` turns the
kernels off.

A failed build (no compiler, no headers) is logged once and the ops keep their plain-torch
implementation: the kernels are an optimisation, never a requirement.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from vllm.utils.cpu_kernels import cpu_extension_loaded, load_cpu_extension, source_with_headers

_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_DIR, "cpu_fp8.cpp")
_HEADER = os.path.join(_DIR, "cpu_fp8_kernels.h")
_NAME = "fp8"
_allowed = True


@contextlib.contextmanager
def cpu_kernels_held_back() -> Iterator[None]:
    """Within the block `load_cpu_fp8_kernels()` neither builds nor loads the library (one
    loaded already stays): CPU calls of the ops run their plain-torch forms. For tracing
    fusion patterns with CPU example tensors where the model itself runs on a GPU: the traced
    graph is the same, and a fresh GPU machine needs no C++ build for it."""
    global _allowed
    previous, _allowed = _allowed, False
    try:
        yield
    finally:
        _allowed = previous


def cpu_fp8_kernels_loaded() -> bool:
    return cpu_extension_loaded(_NAME)


def load_cpu_fp8_kernels() -> bool:
    """Build (first time on this machine) and load the kernels; True when they are
    registered. Thread-safe; tries once per process."""
    if cpu_fp8_kernels_loaded():
        return True
    if not _allowed:
        return False
    # The schemas must exist before the library registers kernels for them.
    import vllm.model_executor.kernels.fp8_ops  # noqa: F401

    return load_cpu_extension(_NAME, os.path.join(_DIR, "cpu_fp8_full.cpp"),
                              "VLLM_CPU_FP8_KERNELS",
                              source_text=source_with_headers(_SOURCE, _HEADER))
