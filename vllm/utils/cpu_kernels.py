"""Build and load small C++ CPU kernels at first use, cached under the vllm cache root.

    if load_cpu_extension("cpu_paged_attention", "/path/to/cpu_paged_attention.cpp",
                          "VLLM_CPU_ATTENTION_KERNEL"):
        torch.ops.<namespace>.<op>(...)

A kernel source registers its ops with `TORCH_LIBRARY` itself. The library is built with
`torch.utils.cpp_extension.load` once per machine (seconds to tens of seconds) in
`<VLLM_CACHE_ROOT>/cpu_kernels_<name>/<hash>`; the hash covers the source, the compiler flags,
the torch version and the CPU's instruction-set flags (the code is built with -march=native),
so a changed source or another machine never loads a stale library. Loading a built library
takes milliseconds. When VLLM_CACHE_ROOT points elsewhere (tests, benchmarks with a fresh cache
root), the identical build in the default root (~/.cache/vllm) is loaded instead of building
again: the hash makes it the same library. A failed build (no compiler, no headers) is logged
once and returns False: callers keep their plain-torch path. Setting the kernel's environment
switch to 0 disables it.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time

from vllm.logger import init_logger
from vllm.utils.cpu_info import cpu_flags_text
from vllm.utils.file_utils import atomic_write
from vllm.utils.progress import waiting

logger = init_logger(__name__)

CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]

_lock = threading.Lock()
_loaded: dict[str, bool] = {}


def _default_cache_root() -> str:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return os.path.join(xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache"), "vllm")


def switched_off(env_switch: str) -> bool:
    return os.environ.get(env_switch, "1").strip().lower() in ("0", "false", "off", "no")


def load_cpu_extension(name: str, source_path: str, env_switch: str,
                       source_text: str | None = None) -> bool:
    """Build (first call on this machine) and load `source_path` (or `source_text`, the full
    source when headers are pasted in, saved under that file name); True when its ops are
    registered. Thread-safe; one try per process and name."""
    if name not in _loaded:
        with _lock:
            if name not in _loaded:
                _loaded[name] = False if switched_off(env_switch) else _build_and_load(
                    name, source_path, source_text)
    return _loaded[name]


def cpu_extension_loaded(name: str) -> bool:
    """Whether `load_cpu_extension(name, ...)` already succeeded in this process."""
    return _loaded.get(name, False)


def _build_and_load(name: str, source_path: str, source_text: str | None) -> bool:
    try:
        import torch

        from vllm import envs

        if source_text is None:
            with open(source_path) as f:
                source_text = f.read()
        source = source_text
        digest = hashlib.sha256("\n".join([source, " ".join(CFLAGS), torch.__version__,
                                           cpu_flags_text()]).encode()).hexdigest()[:16]
        ext_name = f"vllm_{name}_{digest}"
        subdir = os.path.join(f"cpu_kernels_{name}", digest)
        directory = os.path.join(envs.VLLM_CACHE_ROOT, subdir)
        for root in dict.fromkeys([envs.VLLM_CACHE_ROOT, _default_cache_root()]):
            built = os.path.join(root, subdir, f"{ext_name}.so")
            if os.path.isfile(built):
                try:
                    torch.ops.load_library(built)
                    return True
                except OSError:  # a half-written library (an interrupted build): rebuild
                    pass
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, os.path.basename(source_path))
        if not os.path.isfile(path):
            atomic_write(path, source)
        # (imported only to build: ~0.1 s, which a start that finds the library skips)
        from torch.utils.cpp_extension import load

        start = time.perf_counter()
        # Tens of seconds on a busy machine (the first start on it): say so while it lasts.
        with waiting(logger, f"Building the CPU kernel {name}",
                     announce=f"Building the CPU kernel {name} (once per machine: up to a "
                     "minute or two on a busy one) ...",
                     done=f"Built the CPU kernel {name} into {directory}"):
            load(name=ext_name, sources=[path], extra_cflags=CFLAGS,
                 extra_ldflags=["-fopenmp"], build_directory=directory, is_python_module=False,
                 verbose=False)
        elapsed = time.perf_counter() - start
        from vllm.utils.startup_timer import CPU_KERNEL_BUILD, get_startup_timer

        get_startup_timer().record(CPU_KERNEL_BUILD, elapsed, kernel=name)
        return True
    except Exception as e:  # no compiler, missing headers, a compile error...
        first_line = str(e).splitlines()[0] if str(e) else ""
        logger.warning("Could not build the CPU kernel %s (%s: %s); its callers use plain "
                       "torch", name, type(e).__name__, first_line)
        return False
