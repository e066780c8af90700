"""Worker: one device. Loads the model, sizes and allocates the KV cache, runs steps."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from vllm.engine.model_runner import ModelRunner
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.engine.sched_output import ModelRunnerOutput, SchedulerOutput

logger = init_logger(__name__)

GiB = 1024**3
DEFAULT_CPU_KV_CACHE_BYTES = 4 * GiB


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_cache_dtype(vllm_config: VllmConfig) -> torch.dtype:
    from vllm.config.cache import FP8_CACHE_TORCH_DTYPES

    name = vllm_config.cache_config.cache_dtype
    if name == "auto":
        return vllm_config.model_config.torch_dtype
    return getattr(torch, FP8_CACHE_TORCH_DTYPES.get(name, name))


def bytes_per_block(attention_layers: dict, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block, summed over the attention layers."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return sum(2 * block_size * layer.num_kv_heads * layer.head_size * elem
               for layer in attention_layers.values())


def determine_num_blocks(vllm_config: VllmConfig, block_bytes: int,
                         available_bytes: int | None = None) -> tuple[int, str]:
    """How many KV blocks to allocate (including the reserved block 0), and why.

    `num_gpu_blocks_override` wins, then `cache_config.kv_cache_memory` bytes on any device
    (upstream's kv_cache_memory_bytes: it overrides gpu_memory_utilization on CUDA). Otherwise
    CUDA uses `available_bytes` (from gpu_memory_utilization) and the CPU VLLM_CPU_KVCACHE_SPACE
    GiB, else 4 GiB. Fixed amounts are capped at what max_num_seqs sequences of max_model_len
    can use. Raises ValueError when one max-length sequence does not fit.
    """
    from vllm import envs

    cc, sc = vllm_config.cache_config, vllm_config.scheduler_config
    blocks_per_seq = _cdiv(sc.max_model_len, cc.block_size)
    needed = blocks_per_seq + 1  # + the reserved dummy block
    cap = sc.max_num_seqs * blocks_per_seq + 1
    if cc.num_gpu_blocks_override is not None:
        num_blocks = cc.num_gpu_blocks_override
        source = "num_gpu_blocks_override"
        memory = num_blocks * block_bytes
    elif available_bytes is not None and cc.kv_cache_memory is None:
        memory = max(available_bytes, 0)
        num_blocks = memory // block_bytes
        source = (f"gpu_memory_utilization={cc.gpu_memory_utilization} leaves "
                  f"{memory / GiB:.2f} GiB for the KV cache")
    else:
        if cc.kv_cache_memory is not None:
            memory, source = int(cc.kv_cache_memory), "kv_cache_memory"
        elif envs.VLLM_CPU_KVCACHE_SPACE is not None:
            memory = int(envs.VLLM_CPU_KVCACHE_SPACE * GiB)
            source = "VLLM_CPU_KVCACHE_SPACE"
        else:
            memory, source = DEFAULT_CPU_KV_CACHE_BYTES, "default 4 GiB"
        num_blocks = memory // block_bytes
        if num_blocks > cap:
            num_blocks = cap
            source += (f", capped at max_num_seqs ({sc.max_num_seqs}) x max_model_len "
                       f"({sc.max_model_len})")
    if num_blocks < needed:
        raise ValueError(
            f"The KV cache is too small for one sequence of max_model_len={sc.max_model_len}: "
            f"{block_bytes} bytes per block of {cc.block_size} tokens, {needed} blocks needed "
            f"({blocks_per_seq} + 1 reserved), {num_blocks} available ({source}; "
            f"{memory / GiB:.3f} GiB). Give the cache more memory (kv_cache_memory / "
            "VLLM_CPU_KVCACHE_SPACE on the CPU, gpu_memory_utilization on CUDA, or "
            "num_gpu_blocks_override) or lower max_model_len.")
    return num_blocks, source


def available_cpu_memory() -> int | None:
    """Bytes the kernel could give this process now without killing anything: MemAvailable
    plus SwapFree of /proc/meminfo; None where that cannot be read (not Linux)."""
    from vllm.utils.cpu_threads import read_text_or_none

    fields = {}
    try:
        for line in (read_text_or_none("/proc/meminfo") or "").splitlines():
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024  # kB
    except (ValueError, IndexError):
        return None
    if "MemAvailable" not in fields:
        return None
    return fields["MemAvailable"] + fields.get("SwapFree", 0)


def check_cpu_memory_for_kv_cache(num_blocks: int, block_bytes: int) -> None:
    """Raise ValueError, naming the sizes and the knobs, when a CPU KV cache of `num_blocks`
    blocks of `block_bytes` cannot fit in the memory the machine has free now. The cache's
    pages are taken as steps first write them (model_runner.initialize_kv_cache), so without
    this check a cache too large would end the process (the kernel's OOM killer) mid-run, its
    requests lost."""
    kv_bytes = num_blocks * block_bytes
    available = available_cpu_memory()
    if available is None or kv_bytes <= available:
        return
    raise ValueError(
        f"The KV cache ({num_blocks} blocks of {block_bytes} bytes, {kv_bytes / GiB:.2f} GiB) "
        f"does not fit in the memory this machine has free ({available / GiB:.2f} GiB "
        "available, swap included). Give it less: VLLM_CPU_KVCACHE_SPACE (GiB), "
        "kv_cache_memory_bytes, num_gpu_blocks_override, or a lower max_num_seqs or "
        "max_model_len.")


def output_rank(vllm_config: VllmConfig) -> int:
    """The rank that samples and answers each step: tensor-parallel rank 0 of the last
    pipeline stage (global rank = stage * tp + tp rank)."""
    pc = vllm_config.parallel_config
    return (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size


class Worker:
    def __init__(self, vllm_config: VllmConfig, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None) -> None:
        self.vllm_config = vllm_config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.platform = vllm_config.platform
        self.model_runner: ModelRunner | None = None
        self.num_blocks = 0
        self._saved_num_threads: int | None = None
        self._saved_affinity: list[int] | None = None
        self._thread_governor = None

    def init_device(self) -> None:
        self.platform.verify_can_run()
        device = self.platform.torch_device()
        if device.type == "cuda":
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        self.device = device
        self._init_distributed()
        if device.type == "cpu":
            self._init_cpu_threads()
            from vllm import envs
            from vllm.utils.cpu_malloc import keep_freed_memory

            keep_freed_memory(envs.VLLM_CPU_MALLOC_TOP_PAD_MB << 20)
        torch.manual_seed(self.vllm_config.model_config.seed)
        self.model_runner = ModelRunner(self.vllm_config, device,
                                        is_driver=self.rank == output_rank(self.vllm_config))

    def _init_distributed(self) -> None:
        world = self.vllm_config.parallel_config.world_size
        if world == 1:
            return
        from vllm.distributed import init_distributed_environment, initialize_model_parallel

        init_distributed_environment(world, self.rank, self.platform.dist_backend,
                                     self.distributed_init_method, self.local_rank)
        pc = self.vllm_config.parallel_config
        initialize_model_parallel(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        if self.device.type == "cuda":
            # With the AllReduce+RMSNorm fusion on, the TP group's FlashInfer workspace
            # (collective; None when FlashInfer cannot serve it).
            from vllm.distributed import get_tp_group
            from vllm.distributed.flashinfer_all_reduce import init_flashinfer_all_reduce

            tp = get_tp_group()
            tp.flashinfer_all_reduce = init_flashinfer_all_reduce(tp, self.vllm_config)

    def _init_cpu_threads(self) -> None:
        """Intra-op threads from the CPUs this rank may use (affinity, cgroup quota, its share
        of the ranks; the user's own setting wins), and the contention governor that runs
        fewer threads while another process is busy on them (vllm/utils/cpu_threads.py)."""
        from vllm import envs
        from vllm.utils import cpu_threads
        from vllm.utils.cpu_contention import ThreadGovernor
        from vllm.utils.omp_env import check_omp_env

        check_omp_env()
        world = self.vllm_config.parallel_config.world_size
        plan = cpu_threads.plan_threads(world, self.rank)
        self._saved_num_threads = torch.get_num_threads()
        self._saved_affinity = cpu_threads.apply_thread_plan(plan, self.rank)
        self._thread_governor = ThreadGovernor(plan, adjust=envs.VLLM_CPU_ADAPTIVE_THREADS)

    def load_model(self, load_format: str = "auto") -> None:
        self.model_runner.load_model(load_format)

    def determine_num_blocks(self) -> int:
        runner = self.model_runner
        dtype = kv_cache_dtype(self.vllm_config)
        block_bytes = bytes_per_block(runner.attention_layers,
                                      self.vllm_config.cache_config.block_size, dtype)
        available = None
        cache = self.vllm_config.cache_config
        if (self.device.type == "cuda" and cache.num_gpu_blocks_override is None
                and cache.kv_cache_memory is None):
            available = self._cuda_available_kv_bytes()
        num_blocks, source = determine_num_blocks(self.vllm_config, block_bytes, available)
        self.block_bytes = block_bytes
        self.kv_source = source
        return num_blocks

    def _cuda_available_kv_bytes(self) -> int:
        """total * gpu_memory_utilization - memory in use after loading the weights - the
        activation peak of a full-budget forward."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        self.model_runner.profile_run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used = total - free
        budget = int(total * self.vllm_config.cache_config.gpu_memory_utilization)
        logger.info("CUDA memory: %.2f GiB total, %.2f GiB in use after loading, activation "
                    "peak %.2f GiB", total / GiB, used / GiB, peak / GiB)
        return budget - used - peak

    def initialize_cache(self, num_blocks: int) -> None:
        dtype = kv_cache_dtype(self.vllm_config)
        if self.device.type == "cpu":
            check_cpu_memory_for_kv_cache(num_blocks, bytes_per_block(
                self.model_runner.attention_layers, self.vllm_config.cache_config.block_size,
                dtype))
        self.num_blocks = num_blocks
        self.model_runner.initialize_kv_cache(num_blocks, dtype)

    def compile_or_warm_up_model(self) -> None:
        """Warm-up forwards that compile the model (Dynamo trace, the dynamic graph, each
        compile size) and capture the CUDA graphs, before the engine reports ready."""
        from vllm.model_executor.layers.cpu_prepacked_linear import (
            finish_prepacking_in_background,
        )
        from vllm.utils.startup_timer import get_startup_timer

        self.model_runner.compile_or_warm_up_model()
        if self._thread_governor is not None:
            self._thread_governor.poll()  # busy CPUs since the start: act before requests
        # The weights queued while loading (CPU, -O2/-O3) are finished after ready: until then
        # their products take the plain weights' routes.
        pending = finish_prepacking_in_background()
        if pending:
            get_startup_timer().record("weight prepacking", 0.0,
                                       note=f"{pending} weights left, finished after ready")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        governor = self._thread_governor
        if governor is None:
            return self.model_runner.execute_model(scheduler_output)
        start = time.perf_counter()
        output = self.model_runner.execute_model(scheduler_output)
        governor.step(time.perf_counter() - start,
                      (scheduler_output.total_num_scheduled_tokens,
                       len(scheduler_output.num_scheduled_tokens)))
        return output

    @torch.inference_mode()
    def check_health(self) -> None:
        """Raise if this rank can no longer run the model: a forward over a dummy request
        (its KV in the reserved block 0, the warm-up's token count, so no recompile), the
        logits of one row and, on the driver, greedy sampling. Touches no request's state.
        Every rank must run it together (the forward holds the tensor-parallel
        collectives)."""
        from vllm.model_executor.layers.sampler import SamplingMetadata

        runner = self.model_runner
        num_tokens, _ = runner.warm_up_sizes()
        hidden = runner.dummy_run(num_tokens)
        logits = runner.model.compute_logits(hidden[:1])
        if runner.is_driver:
            runner.sampler(logits, SamplingMetadata(temperature=None, all_greedy=True,
                                                    all_random=False))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a sticky device error shows up here

    def shutdown(self) -> None:
        """Leave the process group (tensor parallelism) and restore the thread count."""
        if self.vllm_config.parallel_config.world_size > 1:
            from vllm.distributed import destroy_distributed_environment

            destroy_distributed_environment()
        self._thread_governor = None
        if self._saved_affinity is not None:
            from vllm.utils.cpu_threads import bind_process

            bind_process(self._saved_affinity)  # undo VLLM_CPU_OMP_THREADS_BIND's binding
            self._saved_affinity = None
        if self._saved_num_threads is not None:
            torch.set_num_threads(self._saved_num_threads)
            self._saved_num_threads = None
