"""Build and load the CPU C++ kernels of the FP8 ops, cached under the vllm cache root.

    load_cpu_fp8_kernels()   # True once the kernels are registered for the CPU dispatch key

The library (cpu_fp8.cpp with cpu_fp8_kernels.h pasted in) registers its kernels with the
dispatcher (`TORCH_LIBRARY_IMPL(vllm, CPU, ...)`) for ops whose schemas fp8_ops.py defines:
after loading, a CPU call of `torch.ops.vllm.<op>` goes from the dispatcher straight to C++
(about 2 us per call, against about 12 us through a Python custom op).

The build runs `torch.utils.cpp_extension.load` once per machine (tens of seconds on a slow
machine; loading a built library takes milliseconds). Its directory is
`<VLLM_CACHE_ROOT>/cpu_kernels/<hash>`, the hash covering the source, the compiler flags, the
torch version and the CPU's instruction-set flags (the code is built with -march=native), so a
changed source or another machine never loads a stale library; torch's build lock keeps
concurrent processes from building the same directory twice.

A failed build (no compiler, no headers) is logged once and the ops keep their plain-torch
implementation: the kernels are an optimisation, never a requirement.
"""
from __future__ import annotations

import hashlib
import os
import threading

from vllm.logger import init_logger

logger = init_logger(__name__)

_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_DIR, "cpu_fp8.cpp")
_HEADER = os.path.join(_DIR, "cpu_fp8_kernels.h")
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]

_lock = threading.Lock()
_state: dict[str, bool] = {}
_allowed = True


def set_cpu_kernels_allowed(allowed: bool) -> None:
    """Whether a later `load_cpu_fp8_kernels()` may load the library (tests and benchmarks
    of the plain-torch path call this before anything loads it; a loaded library stays)."""
    global _allowed
    _allowed = bool(allowed)


def read_source() -> str:
    """cpu_fp8.cpp with cpu_fp8_kernels.h pasted in place of its #include."""
    with open(_HEADER) as f:
        header = f.read()
    with open(_SOURCE) as f:
        source = f.read()
    return source.replace('#include "cpu_fp8_kernels.h"', header)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def build_dir_for(source: str) -> str:
    import torch

    from vllm import envs

    key = hashlib.sha256("|".join([source, " ".join(_CFLAGS), torch.__version__,
                                   _cpu_flags()]).encode()).hexdigest()[:16]
    return os.path.join(envs.VLLM_CACHE_ROOT, "cpu_kernels", key)


def cpu_fp8_kernels_loaded() -> bool:
    return _state.get("loaded", False)


def load_cpu_fp8_kernels() -> bool:
    """Build (first time on this machine) and load the kernels; True when they are
    registered. Thread-safe; tries once per process."""
    if "loaded" in _state:
        return _state["loaded"]
    if not _allowed:
        return False
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _build_and_load()
    return _state["loaded"]


def _build_and_load() -> bool:
    import time

    # The schemas must exist before the library registers kernels for them.
    import vllm.model_executor.kernels.fp8_ops  # noqa: F401

    try:
        from torch.utils.cpp_extension import load

        source = read_source()
        directory = build_dir_for(source)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "cpu_fp8_full.cpp")
        if not os.path.isfile(path):
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(source)
            os.replace(tmp, path)
        name = "vllm_cpu_fp8_" + os.path.basename(directory)
        start = time.perf_counter()
        load(name=name, sources=[path], extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
             build_directory=directory, is_python_module=False, verbose=False)
        elapsed = time.perf_counter() - start
        if elapsed > 1.0:
            logger.info("Built the CPU FP8 kernels in %.1f s (cached in %s)", elapsed, directory)
        return True
    except Exception as e:  # no compiler, missing headers, a compile error...
        first_line = str(e).splitlines()[0] if str(e) else ""
        logger.warning("Could not build the CPU FP8 kernels (%s: %s); the FP8 ops use their "
                       "plain-torch implementation", type(e).__name__, first_line)
        return False
