"""Build and load small C++ CPU kernels at first use, cached under the vllm cache root.

    if load_cpu_extension("cpu_paged_attention", "/path/to/cpu_paged_attention.cpp",
                          "VLLM_CPU_ATTENTION_KERNEL"):
        torch.ops.<namespace>.<op>(...)

A kernel source registers its ops with `TORCH_LIBRARY` itself. The library is built with
`torch.utils.cpp_extension.load` once per machine and instruction-set level (seconds to tens of
seconds) in `<VLLM_CACHE_ROOT>/cpu_kernels_<name>/<level>-<hash>`.

Instruction-set levels (vllm/utils/cpu_info.py): every library is built for one level with
that level's explicit flags (avx2: -mavx2 -mfma -mf16c ...; avx512: + AVX-512 F/BW/VL/DQ;
avx512_bf16: + AVX512-BF16), never -march=native, so an AVX-512 machine builds, tests and
measures the AVX2 code too. The level is the best the CPU has, or a lower one forced with
VLLM_CPU_ISA=avx2|avx512|avx512_bf16 (a level the CPU lacks is a ValueError). Two builds of
one library register the same op namespace, so a process loads all its kernels at one level:
the first call fixes it (`kernels_isa_level()`; the engine's start-up line names it). A CPU
below AVX2 (or not x86) builds with -march=native (level "native").

Processes starting together take turns building (a lock per library), and each build runs in
its own folder and is copied into place atomically, so a library a process has loaded is never
rewritten.

The hash covers the source, the compiler flags, the torch version and the CPU's flags (the
code is tuned with -mtune=native), so a changed source or another machine never loads a stale
library. Loading a built library takes milliseconds. When VLLM_CACHE_ROOT points elsewhere
(tests, benchmarks with a fresh cache root), the identical build in the default root
(~/.cache/vllm) is loaded instead of building again: the hash makes it the same library. A
failed build (no compiler, no headers) is logged once and returns False: callers keep their
plain-torch path. Setting the kernel's environment switch to 0 disables it.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time

from vllm.logger import init_logger
from vllm.utils.cpu_info import cpu_flags_text, cpu_isa_level, isa_level
from vllm.utils.file_utils import atomic_path, atomic_write
from vllm.utils.progress import waiting

logger = init_logger(__name__)

CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]
"""Flags of every build; the level's instruction-set flags (and -mtune=native) come after."""
SHARED_HEADERS = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc",
                               "cpu_isa_level.h"),)
"""Headers any kernel source may include (`#include "<file name>"`): every build pastes them."""

_lock = threading.Lock()
_loaded: dict[str, bool] = {}
_loaded_isa: dict[str, str] = {}
_process_isa: str | None = None


def kernels_isa_level() -> str:
    """The instruction-set level this process builds and loads its C++ kernels for (fixed by
    the first call: VLLM_CPU_ISA or the CPU's best level). A ValueError for a VLLM_CPU_ISA
    the CPU cannot run."""
    global _process_isa
    if _process_isa is None:
        level = cpu_isa_level()
        with _lock:
            if _process_isa is None:
                _process_isa = level
    return _process_isa


def isa_cflags(level: str) -> list[str]:
    """The compiler flags of a library built for `level` (e.g. "avx2")."""
    flags = list(CFLAGS) + list(isa_level(level).cflags)
    if level != "native":
        flags.append("-mtune=native")  # scheduling for this CPU; the instruction set stays
    return flags


def loaded_isa_level(name: str) -> str | None:
    """The level the library `name` was built for, when this process loaded it."""
    return _loaded_isa.get(name)


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
        level = None if switched_off(env_switch) else kernels_isa_level()
        with _lock:
            if name not in _loaded:
                ok = level is not None and _build_and_load(name, source_path, source_text, level)
                if ok:
                    _loaded_isa[name] = level
                _loaded[name] = ok
    return _loaded[name]


def source_with_headers(source_path: str, *header_paths: str) -> str:
    """The text of `source_path` with each header pasted in place of its
    `#include "<file name>"` line (the build compiles one file, and the hash covers it all)."""
    with open(source_path) as f:
        return paste_headers(f.read(), header_paths)


def paste_headers(text: str, header_paths) -> str:
    """`text` with each header's content in place of its `#include "<file name>"` line."""
    for header in header_paths:
        with open(header) as f:
            text = text.replace(f'#include "{os.path.basename(header)}"', f.read())
    return text


def cpu_extension_loaded(name: str) -> bool:
    """Whether `load_cpu_extension(name, ...)` already succeeded in this process."""
    return _loaded.get(name, False)


def _load_built(path: str) -> bool:
    """Load a library a build left at `path`; False when there is none (or a broken one)."""
    import torch

    if not os.path.isfile(path):
        return False
    try:
        torch.ops.load_library(path)
        return True
    except OSError:  # not a library (a file from before builds were atomic): build again
        return False


def _build(ext_name: str, file_name: str, source: str, cflags: list[str],
           directory: str) -> None:
    """Build `source` into `directory/<ext_name>.so` and load it (or load what another
    process built while this one waited for the directory's lock).

    Processes that start together (test workers, TP ranks, replicas) take turns on one lock,
    and each build runs in a fresh folder whose library is then copied into place atomically:
    a library another process has loaded is never rewritten under it (cold pages of a library
    changed on disk crash that process, typically when it first throws an exception)."""
    import fcntl
    import shutil
    import tempfile

    # (imported only to build: ~0.1 s, which a start that finds the library skips)
    from torch.utils.cpp_extension import load

    final = os.path.join(directory, f"{ext_name}.so")
    with open(os.path.join(directory, "build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _load_built(final):
            return
        build_dir = tempfile.mkdtemp(prefix="build-", dir=directory)
        try:
            path = os.path.join(build_dir, file_name)
            atomic_write(path, source)
            load(name=ext_name, sources=[path], extra_cflags=cflags,
                 extra_ldflags=["-fopenmp"], build_directory=build_dir,
                 is_python_module=False, verbose=False)
            with atomic_path(final) as tmp:  # (torch loaded the library from build_dir)
                shutil.copyfile(os.path.join(build_dir, f"{ext_name}.so"), tmp)
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)


def _build_and_load(name: str, source_path: str, source_text: str | None, level: str) -> bool:
    try:
        import torch

        from vllm import envs

        if source_text is None:
            with open(source_path) as f:
                source_text = f.read()
        source = paste_headers(source_text, SHARED_HEADERS)
        cflags = isa_cflags(level)
        digest = hashlib.sha256("\n".join([source, " ".join(cflags), torch.__version__,
                                           cpu_flags_text()]).encode()).hexdigest()[:16]
        ext_name = f"vllm_{name}_{level}_{digest}"
        subdir = os.path.join(f"cpu_kernels_{name}", f"{level}-{digest}")
        directory = os.path.join(envs.VLLM_CACHE_ROOT, subdir)
        for root in dict.fromkeys([envs.VLLM_CACHE_ROOT, _default_cache_root()]):
            if _load_built(os.path.join(root, subdir, f"{ext_name}.so")):
                return True
        os.makedirs(directory, exist_ok=True)
        start = time.perf_counter()
        # Tens of seconds on a busy machine (the first start on it): say so while it lasts.
        with waiting(logger, f"Building the CPU kernel {name}",
                     announce=f"Building the CPU kernel {name} (once per machine and ISA level, "
                     f"here {level}: up to a minute or two on a busy one) ...",
                     done=f"Built the CPU kernel {name} into {directory}"):
            _build(ext_name, os.path.basename(source_path), source, cflags, directory)
        elapsed = time.perf_counter() - start
        from vllm.utils.startup_timer import CPU_KERNEL_BUILD, get_startup_timer

        get_startup_timer().record(CPU_KERNEL_BUILD, elapsed, kernel=name)
        return True
    except Exception as e:  # no compiler, missing headers, a compile error...
        first_line = str(e).splitlines()[0] if str(e) else ""
        logger.warning("Could not build the CPU kernel %s (%s: %s); its callers use plain "
                       "torch", name, type(e).__name__, first_line)
        return False
