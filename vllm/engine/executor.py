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
        self.vllm_config = vllm_config
        start = time.perf_counter()
        self.worker = Worker(vllm_config)
        self.worker.init_device()
        self.worker.load_model(load_format)
        loaded = time.perf_counter()
        self.num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(self.num_blocks)
        self._log_kv_cache()
        self.worker.compile_or_warm_up_model()
        self.startup_times = {"load_model_s": loaded - start,
                              "kv_cache_and_warm_up_s": time.perf_counter() - loaded}

    def _log_kv_cache(self) -> None:
        cc, sc = self.vllm_config.cache_config, self.vllm_config.scheduler_config
        usable = self.num_blocks - 1
        tokens = usable * cc.block_size
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.3f GiB, %d bytes per block; %s); "
            "maximum concurrency for %d-token requests: %.2fx", usable, cc.block_size, tokens,
            self.num_blocks * self.worker.block_bytes / GiB, self.worker.block_bytes,
            self.worker.kv_source, sc.max_model_len, tokens / sc.max_model_len)

    @property
    def model(self):
        return self.worker.model_runner.model

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
