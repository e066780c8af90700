"""The compile cache's key: what it is made of, and where an entry lives.

The key covers everything that changes the compiled code (`VllmConfig.compute_hash()`, torch,
triton and our versions, the traced model source, our compiler source, the pass manager's
uuid, the CPU's instruction set and the one the process is limited to, the GPU) and nothing
memory-sized. Each factor is a short
string, stored in the entry's manifest so that a person can see why two directories differ.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

FORMAT_VERSION = 1
"""Of the cache's layout and entries: a change makes every earlier entry another key."""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def files_hash(paths: list[str | os.PathLike]) -> str:
    """Contents only (the same source installed elsewhere gives the same key)."""
    h = hashlib.sha256()
    for path in sorted(set(map(os.fspath, paths))):
        try:
            with open(path, "rb") as f:
                h.update(f.read())
        except OSError:
            h.update(b"<missing>")
    return h.hexdigest()


def cpu_fingerprint() -> str:
    """The CPU's instruction set, short: a hash of its flags line (`vllm.utils.cpu_info`)."""
    from vllm.utils.cpu_info import cpu_flags_line

    line = cpu_flags_line()
    if line:
        return hashlib.sha256(line.encode()).hexdigest()[:16]
    return platform.processor() or "unknown"


def code_isa() -> str:
    """The instruction sets this process compiles and runs for, which the CPU's flags alone do
    not give: ATen's capability (ATEN_CPU_CAPABILITY; Inductor's C++ kernels are vectorized
    for it) and our C++ kernels' level (VLLM_CPU_ISA). A run limited to AVX2 on an AVX-512
    machine (`bench_vs_llamacpp.py --isa avx2`) had shared its entries with unlimited runs: the
    one that compiled first decided the other's code, and its numerics."""
    import torch

    from vllm.utils.cpu_info import cpu_isa_level

    try:
        ours = cpu_isa_level()
    except ValueError:  # (a bad VLLM_CPU_ISA is refused where the kernels load)
        ours = "invalid"
    return f"{torch.backends.cpu.get_cpu_capability()}/{ours}"


def compiler_source_files() -> list[str]:
    """Our compile stack's own source: a change in it may change the artifacts."""
    here = os.path.dirname(os.path.abspath(__file__))
    files = []
    for dirpath, _, names in os.walk(here):
        files += [os.path.join(dirpath, n) for n in names if n.endswith(".py")]
    return sorted(files)


def compute_cache_factors(vllm_config: VllmConfig, model_source_files: list[str],
                          pass_manager_uuid: str) -> dict[str, str]:
    """What the cache key is made of, each factor as a short string (stored in the manifest,
    so a person can see why two directories differ)."""
    import torch

    from vllm.version import __version__

    try:
        import triton  # noqa: F401

        triton_version = triton.__version__
    except Exception:
        triton_version = "none"
    return {
        "format": str(FORMAT_VERSION),
        "config": vllm_config.compute_hash(),
        "torch": torch.__version__,
        "triton": triton_version,
        "vllm": __version__,
        "model_source": files_hash(model_source_files),
        "compiler_source": files_hash(compiler_source_files()),
        "passes": pass_manager_uuid,
        "machine": f"{platform.machine()}-{cpu_fingerprint()}-{code_isa()}",
        "accelerator": _accelerator(vllm_config),
        "pipeline_stage": _pipeline_stage(),
        "tp_all_reduce": _tp_all_reduce(),
    }


def _pipeline_stage() -> str:
    """"stage/stages": each pipeline stage compiles its own layers (the entry's rank_<r>
    directory is the tensor-parallel rank, the same on every stage)."""
    from vllm.distributed.parallel_state import get_pp_group

    group = get_pp_group()
    return f"{group.rank_in_group}/{group.world_size}"


def _tp_all_reduce() -> str:
    """How the tensor-parallel all-reduce is traced into the graph: "shm" / "flashinfer" (the
    op `vllm.all_reduce`, which the AllReduce+RMSNorm pass fuses, backed by the CPU's shared
    memory / FlashInfer's workspace on CUDA), "c10d" (torch's functional collective: gloo,
    NCCL), "none" without TP. A graph traced one way must not be loaded
    where the group all-reduces the other way: a graph traced with VLLM_CPU_SHM_ALLREDUCE=0
    (or by a rank that could not map the segment) and loaded by a shared-memory run kept gloo,
    its TP=2 decode ~4x slower, with nothing said."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return "none"
    if group.shm_all_reduce is not None:
        return "shm"
    return "flashinfer" if group.flashinfer_all_reduce is not None else "c10d"


def _accelerator(vllm_config: VllmConfig) -> str:
    """The GPU the code is built for (Triton kernels target its architecture, and FP8 layers
    choose their GEMM by its capability): a cache shared by an A100 and an H100 must not hand
    one the other's artifacts. "none" off CUDA."""
    import torch

    if not vllm_config.platform.is_cuda() or not torch.cuda.is_available():
        return "none"
    major, minor = torch.cuda.get_device_capability()
    return f"cuda{torch.version.cuda}-{torch.cuda.get_device_name()}-sm{major}{minor}"


def compute_cache_key(factors: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


def entry_directory(root: str, factors: dict[str, str], rank: int) -> str:
    return os.path.join(root, compute_cache_key(factors)[:10], f"rank_{rank}")


def index_path(root: str, base_factors: dict[str, str], rank: int) -> str:
    """Where the traced-file list lives: keyed by the entry's factors without them."""
    return os.path.join(root, "graph_index",
                        f"{compute_cache_key(base_factors)[:16]}.rank_{rank}.json")


def cache_root(vllm_config: VllmConfig) -> str:
    from vllm import envs

    configured = vllm_config.compilation_config.cache_dir
    if configured:
        return os.path.abspath(os.path.expanduser(configured))
    return os.path.join(envs.VLLM_CACHE_ROOT, "torch_compile_cache")


def cache_disabled_reason(vllm_config: VllmConfig) -> str | None:
    from vllm import envs

    if envs.VLLM_DISABLE_COMPILE_CACHE:
        return f"VLLM_DISABLE_COMPILE_CACHE={os.environ['VLLM_DISABLE_COMPILE_CACHE'].strip()}"
    if vllm_config.compilation_config.debug_dump_path:
        return "debug_dump_path is set: everything is compiled so that the dump is complete"
    if vllm_config.compilation_config.backend != "inductor":
        return f"backend {vllm_config.compilation_config.backend!r} produces nothing to cache"
    return cache_directory_problem(vllm_config)


def cache_directory_problem(vllm_config: VllmConfig) -> str | None:
    """Why the cache root cannot be written (named with the path), or None."""
    from vllm.config.utils import directory_problem

    root = cache_root(vllm_config)
    problem = directory_problem(root)
    return None if problem is None else f"the cache directory {root!r} is not usable: {problem}"
