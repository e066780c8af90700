"""Every VLLM_* environment variable the package reads, in one place, read lazily."""
from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str, default: str = "0") -> bool:
    """An on/off variable read as upstream does (an integer, nonzero = on), also taking
    true/false, yes/no, on/off; anything else is a ValueError naming the variable."""
    value = os.environ.get(name, "").strip().lower() or default
    if value in ("true", "yes", "on"):
        return True
    if value in ("false", "no", "off"):
        return False
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"{name}={os.environ.get(name)!r} is not an on/off value; use 1 or "
                         "0 (also true/false, yes/no, on/off)") from None


def _whole_number(name: str, default: int) -> int:
    """A whole number >= 0 from variable `name` (unset or empty: `default`); anything else is
    a ValueError naming the variable and the value."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise ValueError(f"{name}={os.environ.get(name)!r} is not a whole number >= 0")
    return int(raw)


def _cache_root() -> str:
    if "VLLM_CACHE_ROOT" in os.environ:
        return os.path.expanduser(os.environ["VLLM_CACHE_ROOT"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return str(base / "vllm")


_GETTERS = {
    # Force a platform: "cpu", "cuda" or "rocm" (resolves configs as that platform would).
    "VLLM_PLATFORM": lambda: os.environ.get("VLLM_PLATFORM", "").strip().lower() or None,
    "VLLM_CACHE_ROOT": _cache_root,
    "VLLM_DISABLE_COMPILE_CACHE": lambda: _flag("VLLM_DISABLE_COMPILE_CACHE"),
    "VLLM_DEBUG_DUMP_PATH": lambda: os.environ.get("VLLM_DEBUG_DUMP_PATH") or None,
    # KV cache space on the CPU, in GiB (upstream's name and unit).
    "VLLM_CPU_KVCACHE_SPACE": lambda: (float(os.environ["VLLM_CPU_KVCACHE_SPACE"])
                                       if os.environ.get("VLLM_CPU_KVCACHE_SPACE") else None),
    # CPU intra-op threads (vllm/utils/cpu_threads.py): "auto", "nobind" or CPU lists, one per
    # TP rank ("0-3|4-7"), upstream's format; and whether the engine runs fewer threads while
    # other processes are busy on its CPUs (on by default; never over a user's thread count).
    "VLLM_CPU_OMP_THREADS_BIND": lambda: os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "auto",
    "VLLM_CPU_ADAPTIVE_THREADS": lambda: _flag("VLLM_CPU_ADAPTIVE_THREADS", "1"),
    # Weights, packed copies and KV cache of 2 MiB or more in transparent huge pages
    # (vllm/utils/hugepages.py; on by default where the kernel offers them).
    "VLLM_CPU_HUGE_PAGES": lambda: _flag("VLLM_CPU_HUGE_PAGES", "1"),
    # MiB of freed memory glibc's malloc keeps for the next step's large activations
    # (vllm/utils/cpu_malloc.py; 0 leaves malloc as it is).
    "VLLM_CPU_MALLOC_TOP_PAD_MB": lambda: _whole_number("VLLM_CPU_MALLOC_TOP_PAD_MB", 1024),
    # OpenMP wait policy set on `import vllm` before torch's (vllm/utils/omp_env.py).
    "VLLM_CPU_OMP_WAIT_POLICY": lambda: os.environ.get("VLLM_CPU_OMP_WAIT_POLICY") or "auto",
    # Attention backend by name (default: the platform's choice).
    "VLLM_ATTENTION_BACKEND": lambda: os.environ.get("VLLM_ATTENTION_BACKEND") or None,
    "VLLM_API_KEY": lambda: os.environ.get("VLLM_API_KEY") or None,
    # The servers' engine: 1 (default) = scheduler and model in an engine-core process of
    # their own (vllm.engine.core), 0 = an engine thread in the API process.
    "VLLM_ENABLE_MULTIPROCESSING": lambda: _flag("VLLM_ENABLE_MULTIPROCESSING", "1"),
    # Seconds the server's tokenizer thread may spend on one request's tokenizing and chat
    # template rendering before it is interrupted and the request refused.
    "VLLM_TOKENIZE_TIMEOUT_S": lambda: float(os.environ.get("VLLM_TOKENIZE_TIMEOUT_S") or 10.0),
    "VLLM_LOGGING_LEVEL": lambda: os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
    "TORCH_COMPILE_DISABLE": lambda: _flag("TORCH_COMPILE_DISABLE"),
    # Tests: a Dynamo recompile of a compiled model (a guard of its first trace failed) is an
    # error instead of a warning.
    "VLLM_TEST_FAIL_ON_RECOMPILE": lambda: _flag("VLLM_TEST_FAIL_ON_RECOMPILE"),
    # Pipeline parallelism: layers per stage, e.g. "4,4" (models/pipeline.py checks it), and
    # micro-batches per step (default: one per stage; 1 = the whole batch stage by stage).
    "VLLM_PP_LAYER_PARTITION": lambda: os.environ.get("VLLM_PP_LAYER_PARTITION", "").strip(),
    "VLLM_PP_MICRO_BATCHES": lambda: os.environ.get("VLLM_PP_MICRO_BATCHES", "").strip(),
    # Ray executor: seconds the placement group may wait for its bundles.
    "VLLM_RAY_PLACEMENT_TIMEOUT_S": lambda: float(
        os.environ.get("VLLM_RAY_PLACEMENT_TIMEOUT_S") or 120.0),
}


def __getattr__(name: str):
    if name in _GETTERS:
        return _GETTERS[name]()
    raise AttributeError(f"module 'vllm.envs' has no attribute {name!r}")


def __dir__():
    return list(_GETTERS)
