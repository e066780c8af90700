"""The CPU paged-attention kernel (vllm/attention/csrc/cpu_paged_attention.cpp): build, load,
call, and its plain-torch reference.

    if cpu_paged_attention_available():
        paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, req_indices,
                        scale, out)

The kernel reads each request's K/V straight from the paged cache (no gather into a padded
copy) and handles decode rows and chunks with cached context alike; see the C++ file for the
contract. It is built with `torch.utils.cpp_extension.load` at first use, once per machine,
under `<VLLM_CACHE_ROOT>/cpu_attention/<hash>` (the hash covers the source, the flags, the torch
version and the CPU's instruction-set flags, since the code is built with -march=native).
Loading a built library takes milliseconds. When the build fails (no compiler, no headers)
the failure is logged once and callers keep their plain-torch path. Set
VLLM_CPU_ATTENTION_KERNEL=0 to never build or load it.
"""
from __future__ import annotations

import hashlib
import os
import threading

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc",
                       "cpu_paged_attention.cpp")
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_loaded: bool | None = None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.machine()


def _build_dir(source: str) -> str:
    from vllm import envs

    digest = hashlib.sha256("\n".join([source, " ".join(_CFLAGS), torch.__version__,
                                       _cpu_flags()]).encode()).hexdigest()[:16]
    return os.path.join(envs.VLLM_CACHE_ROOT, "cpu_attention", digest)


def cpu_paged_attention_available() -> bool:
    """Build (first call on this machine) and load the kernel; True when
    `torch.ops.vllm_cpu_attn.paged_attention` is usable. Thread-safe; one try per process."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _build_and_load()
    return _loaded


def _build_and_load() -> bool:
    if os.environ.get("VLLM_CPU_ATTENTION_KERNEL", "1").lower() in ("0", "false", "off"):
        return False
    if hasattr(torch.ops, "vllm_cpu_attn") and hasattr(torch.ops.vllm_cpu_attn,
                                                       "paged_attention"):
        return True
    import time

    try:
        from torch.utils.cpp_extension import load

        with open(_SOURCE) as f:
            source = f.read()
        directory = _build_dir(source)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "cpu_paged_attention.cpp")
        if not os.path.isfile(path):
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(source)
            os.replace(tmp, path)
        start = time.perf_counter()
        load(name="vllm_cpu_attn_" + os.path.basename(directory), sources=[path],
             extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], build_directory=directory,
             is_python_module=False, verbose=False)
        elapsed = time.perf_counter() - start
        if elapsed > 1.0:
            logger.info("Built the CPU paged-attention kernel in %.1f s (cached in %s)",
                        elapsed, directory)
        return True
    except Exception as e:  # no compiler, missing headers, a compile error...
        first_line = str(e).splitlines()[0] if str(e) else ""
        logger.warning("Could not build the CPU paged-attention kernel (%s: %s); attention "
                       "uses its plain-torch path", type(e).__name__, first_line)
        return False


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    req_indices: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Attention of the listed requests' query rows over their paged K/V, written into `out`.

    query/out [T, H, D] (channel dim dense), kv_cache [2, num_blocks, block_size, KVH, D]
    contiguous and of query's dtype, block_table [R, max_blocks] int32, seq_lens [R] int64,
    query_start_loc [R + 1] int64, req_indices [n] int64. Needs
    `cpu_paged_attention_available()`."""
    torch.ops.vllm_cpu_attn.paged_attention(query, kv_cache, block_table, seq_lens,
                                            query_start_loc, req_indices, scale, out)


def paged_attention_reference(query: torch.Tensor, kv_cache: torch.Tensor,
                              block_table: torch.Tensor, seq_lens: torch.Tensor,
                              query_start_loc: torch.Tensor, req_indices: torch.Tensor,
                              scale: float, out: torch.Tensor) -> None:
    """The kernel's contract in plain torch (one request at a time, float32 math)."""
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = query.shape[1] // kv_heads
    for r in req_indices.tolist():
        start, end = int(query_start_loc[r]), int(query_start_loc[r + 1])
        seq_len, query_len = int(seq_lens[r]), end - start
        if query_len == 0:
            continue
        context = seq_len - query_len
        positions = torch.arange(seq_len)
        blocks = block_table[r].long()[positions // block_size]
        keys = kv_cache[0, blocks, positions % block_size].float()  # [S, KVH, D]
        values = kv_cache[1, blocks, positions % block_size].float()
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[start:end].float().transpose(0, 1)  # [H, ql, D]
        scores = q @ keys.transpose(1, 2) * scale  # [H, ql, S]
        visible = positions.unsqueeze(0) <= (torch.arange(query_len) + context).unsqueeze(1)
        scores = scores.masked_fill(~visible, float("-inf"))
        result = scores.softmax(dim=-1) @ values  # [H, ql, D]
        out[start:end] = result.transpose(0, 1).to(out.dtype)
