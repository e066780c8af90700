"""Executor: runs the workers. One process for tensor_parallel_size 1."""
from __future__ import annotations

import multiprocessing
import os
import socket
import traceback
import weakref
from typing import TYPE_CHECKING, Any

from vllm.engine.worker import GiB, Worker
from vllm.logger import init_logger, set_process_prefix

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
        if pc.world_size == 1:
            return UniProcExecutor
        if pc.distributed_executor_backend == "uni":
            raise NotImplementedError(
                f"tensor_parallel_size={pc.tensor_parallel_size} needs one process per rank: "
                "use distributed_executor_backend='mp' (the default for tensor parallelism).")
        return MultiprocExecutor

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    """The worker lives in this process."""

    def __init__(self, vllm_config: VllmConfig, load_format: str = "auto") -> None:
        self.vllm_config = vllm_config
        self.worker = Worker(vllm_config)
        self._start(load_format)

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        """Run a Worker method on every rank; results in rank order."""
        return [getattr(self.worker, method)(*args)]

    def _start(self, load_format: str) -> None:
        """Start every worker; each step is a phase of the process-wide start-up timer, less
        the Dynamo trace, compiles and captures run inside it (phases of their own)."""
        from vllm.compilation.monitor import CPU_KERNEL_BUILD, get_startup_timer

        timer = get_startup_timer()
        # Phases recorded where they happen, inside the two below: on CUDA the KV cache sizing's
        # profiling forward is the first forward (the trace and the compiles run there), else
        # the warm-up's.
        nested = ("dynamo tracing", "graph loading", "inductor compilation",
                  "cudagraph capture", "weight prepacking", CPU_KERNEL_BUILD)
        self._call_all("init_device")
        with timer.phase_around("weight loading", (CPU_KERNEL_BUILD,)):
            self._call_all("load_model", load_format)
        with timer.phase_around("kv cache allocation", nested):
            # Every rank must fit the cache: take the smallest.
            self.num_blocks = min(self._call_all("determine_num_blocks"))
            self._call_all("initialize_cache", self.num_blocks)
        self._log_kv_cache()
        with timer.phase_around("warm-up", nested):
            self._call_all("compile_or_warm_up_model")

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

    def shutdown(self) -> None:
        self.worker.shutdown()


class MultiprocExecutor(UniProcExecutor):
    """Tensor parallelism: rank 0 runs in this process, ranks 1..N-1 in spawned processes.

    Every call goes to all ranks (the workers first, since the forward holds collectives) and
    waits for each rank's answer, so a failure on any rank surfaces here with its traceback
    instead of hanging the others.
    """

    def __init__(self, vllm_config: VllmConfig, load_format: str = "auto") -> None:
        self.vllm_config = vllm_config
        world = vllm_config.parallel_config.world_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = multiprocessing.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        for rank in range(1, world):
            parent, child = context.Pipe()
            proc = context.Process(target=_worker_main, name=f"vllm-tp-worker-{rank}",
                                   args=(vllm_config, rank, init_method, child), daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        self.worker = Worker(vllm_config, rank=0, local_rank=0,
                             distributed_init_method=init_method)
        try:
            self._wait_until_started()
            self._start(load_format)
        except BaseException:
            self.shutdown()
            raise

    def _wait_until_started(self) -> None:
        """Each worker says "started" once it runs: rank 0 must not enter the process-group
        rendezvous (which waits for every rank, for minutes) with a worker that died while
        starting (e.g. a script without `if __name__ == "__main__":`, which spawned workers
        re-import)."""
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns), start=1):
            try:
                while not conn.poll(0.2):
                    if not proc.is_alive():
                        raise EOFError
                conn.recv()
            except EOFError:
                proc.join(timeout=5)
                raise RuntimeError(
                    f"tensor-parallel worker rank {rank} exited while starting (exit code "
                    f"{proc.exitcode}; its error is printed above). Workers are spawned "
                    "processes that import the main script again: in a script, start the "
                    "engine under `if __name__ == \"__main__\":`.") from None

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        for conn in self._conns:
            conn.send((method, args))
        # On a failure here the workers may be stuck in a collective waiting for rank 0:
        # the error propagates and shutdown() stops them.
        results = [getattr(self.worker, method)(*args)]
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns), start=1):
            while not conn.poll(1.0):
                if not proc.is_alive():
                    raise RuntimeError(f"tensor-parallel worker rank {rank} died (exit code "
                                       f"{proc.exitcode}) during {method}")
            status, value = conn.recv()
            if status == "error":
                raise RuntimeError(f"tensor-parallel worker rank {rank} failed in {method}:\n"
                                   f"{value}")
            results.append(value)
        return results

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call_all("execute_model", scheduler_output)[0]

    def shutdown(self) -> None:
        self._finalizer()
        self.worker.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_workers(procs: list[Any], conns: list[Any]) -> None:
    for conn in conns:
        try:
            conn.send(("shutdown", ()))
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
    for conn in conns:
        conn.close()


def _worker_main(vllm_config: VllmConfig, rank: int, init_method: str, conn: Any) -> None:
    """A tensor-parallel rank > 0: run Worker methods as rank 0 asks, answer each call."""
    set_process_prefix(f"(TP rank={rank} pid={os.getpid()}) ")
    conn.send(("started", None))
    worker = Worker(vllm_config, rank=rank, local_rank=rank,
                    distributed_init_method=init_method)
    try:
        while True:
            try:
                method, args = conn.recv()
            except EOFError:
                return
            if method == "shutdown":
                return
            try:
                result = getattr(worker, method)(*args)
                # Only rank 0 samples; the others' results are not needed.
                conn.send(("ok", None if method == "execute_model" else result))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    finally:
        worker.shutdown()
