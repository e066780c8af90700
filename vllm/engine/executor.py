"""Executor: runs the workers. One process for tensor_parallel_size 1."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from vllm.engine.worker import GiB, Worker
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.engine.sched_output import ModelRunnerOutput, SchedulerOutput

logger = init_logger(__name__)


class Executor:
    """Interface: after construction, `num_blocks` is the KV cache size (blocks, including the
    reserved block 0) shared by all workers."""

    num_blocks: int

    @staticmethod
    def get_class(vllm_config: VllmConfig) -> type[Executor]:
        pc = vllm_config.parallel_config
        if pc.world_size > 1:
            raise NotImplementedError(
                f"tensor_parallel_size={pc.tensor_parallel_size} needs the multiprocess executor, "
                "which is not implemented yet; run with tensor_parallel_size=1.")
        return UniProcExecutor

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    """The worker lives in this process."""

    def __init__(self, vllm_config: VllmConfig, load_format: str = "auto") -> None:
        from vllm.compilation.monitor import get_startup_timer

        self.vllm_config = vllm_config
        timer = get_startup_timer()
        self.startup_phases: dict[str, float] = {}

        def timed(phase: str, fn, *args):
            start = time.perf_counter()
            with timer.phase(phase):
                result = fn(*args)
            self.startup_phases[phase] = time.perf_counter() - start
            return result

        self.worker = Worker(vllm_config)
        self.worker.init_device()
        timed("weight loading", self.worker.load_model, load_format)
        self.num_blocks = timed("kv cache allocation", self._allocate_kv_cache)
        self._log_kv_cache()
        timed("warm-up", self.worker.compile_or_warm_up_model)

    def _allocate_kv_cache(self) -> int:
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(num_blocks)
        return num_blocks

    def _log_kv_cache(self) -> None:
        cc, sc = self.vllm_config.cache_config, self.vllm_config.scheduler_config
        usable = self.num_blocks - 1
        tokens = usable * cc.block_size
        size = self.num_blocks * self.worker.block_bytes
        size_text = f"{size / GiB:.2f} GiB" if size >= GiB / 10 else f"{size / 2**20:.2f} MiB"
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %s, %d bytes per block; %s); "
            "maximum concurrency for %d-token requests: %.2fx", usable, cc.block_size, tokens,
            size_text, self.worker.block_bytes, self.worker.kv_source, sc.max_model_len,
            tokens / sc.max_model_len)

    @property
    def model(self):
        return self.worker.model_runner.model

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
