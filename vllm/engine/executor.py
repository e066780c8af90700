"""Executor: runs the workers. One process for tensor_parallel_size 1."""
from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.engine.errors import EngineFatalError
from vllm.engine.worker import GiB, Worker, kv_cache_dtype, output_rank
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
        if pc.distributed_executor_backend == "ray":  # (also for one rank, when asked)
            from vllm.engine.ray_executor import RayExecutor

            return RayExecutor
        if pc.world_size == 1:
            return UniProcExecutor
        if pc.distributed_executor_backend == "uni":
            raise NotImplementedError(
                f"tensor_parallel_size={pc.tensor_parallel_size} x pipeline_parallel_size="
                f"{pc.pipeline_parallel_size} needs one process per rank: "
                "use distributed_executor_backend='mp' (the default for tensor parallelism).")
        return MultiprocExecutor

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if the workers can no longer run the model (see `Worker.check_health`)."""

    def start_health_monitor(self, on_dead: Callable[[BaseException], None]) -> None:
        """Call `on_dead(error)` from another thread when the executor dies between calls
        (a worker process exits). One process has nothing to watch."""

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
        from vllm.utils.startup_timer import CPU_KERNEL_BUILD, get_startup_timer

        timer = get_startup_timer()
        # Phases recorded where they happen, inside the two below: on CUDA the KV cache sizing's
        # profiling forward is the first forward (the trace and the compiles run there), else
        # the warm-up's.
        nested = ("dynamo tracing", "graph loading", "inductor compilation",
                  "cudagraph capture", "weight prepacking", CPU_KERNEL_BUILD)
        self._call_all("init_device")
        with timer.phase_around("weight loading", (CPU_KERNEL_BUILD,)):
            self._call_all("load_model", load_format)
            timer.add_events(self._worker_startup_events())
        with timer.phase_around("kv cache allocation", nested):
            # Every rank must fit the cache: take the smallest.
            self.num_blocks = min(self._call_all("determine_num_blocks"))
            self._call_all("initialize_cache", self.num_blocks)
            timer.add_events(self._worker_startup_events())
        self._log_kv_cache()
        with timer.phase_around("warm-up", nested):
            self._call_all("compile_or_warm_up_model")
            timer.add_events(self._worker_startup_events())

    def _worker_startup_events(self) -> list:
        """Start-up events rank 0 recorded in another process since the last call (its
        compiles, kernel builds, captures): none here, rank 0 records into this process's
        timer."""
        return []

    def _log_kv_cache(self) -> None:
        cc, sc = self.vllm_config.cache_config, self.vllm_config.scheduler_config
        usable = self.num_blocks - 1
        tokens = usable * cc.block_size
        block_bytes, kv_source = self._kv_info()
        size = self.num_blocks * block_bytes
        size_text = f"{size / GiB:.2f} GiB" if size >= GiB / 10 else f"{size / 2**20:.2f} MiB"
        dtype = str(kv_cache_dtype(self.vllm_config)).removeprefix("torch.")
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %s, %s, %d bytes per block; %s); "
            "maximum concurrency for %d-token requests: %.2fx", usable, cc.block_size, tokens,
            size_text, dtype, block_bytes, kv_source, sc.max_model_len,
            tokens / sc.max_model_len)

    def _kv_info(self) -> tuple[int, str]:
        """(bytes per KV block, where the cache size came from) of rank 0."""
        return self.worker.block_bytes, self.worker.kv_source

    @property
    def model(self):
        return self.worker.model_runner.model

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def check_health(self) -> None:
        self._call_all("check_health")

    def shutdown(self) -> None:
        self.worker.shutdown()


WORKER_REPLY_TIMEOUT_S = 30.0
"""After rank 0 failed a call: how long the other ranks may take to answer it. One that does
not is presumably stuck in a collective that rank 0 left, and the engine is dead."""


_SERVING_METHODS = frozenset({"execute_model", "check_health"})
"""Calls after which the engine may go on: a failure on rank 0 still waits for the other
ranks' answers, so that the next call reads its own."""


class MultiprocExecutor(UniProcExecutor):
    """Tensor parallelism: rank 0 runs in this process, ranks 1..N-1 in spawned processes.

    Every call goes to all ranks (the workers first, since the forward holds collectives) and
    waits for each rank's answer, also when rank 0 failed (so the next call reads its own
    answers), so a failure on any rank surfaces here with its traceback instead of hanging
    the others. A worker that dies or stops answering raises EngineFatalError naming its rank
    and pid; between calls a monitor thread watches the worker processes, so an idle engine
    learns of a death at once (`start_health_monitor`).
    """

    def __init__(self, vllm_config: VllmConfig, load_format: str = "auto") -> None:
        self.vllm_config = vllm_config
        world = vllm_config.parallel_config.world_size
        self._output_rank = output_rank(vllm_config)
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
        self._watch = _WorkerWatch(self._procs)
        # (also when the engine is only dropped, `del llm`, without shutdown())
        self._finalizer = weakref.finalize(self, _release_ranks, self._procs, self._conns,
                                           self._watch)
        self.worker = Worker(vllm_config, rank=0, local_rank=0,
                             distributed_init_method=init_method)
        try:
            self._wait_until_started()
            self._start(load_format)
        except BaseException:
            self.shutdown()
            raise
        self._watch.start()

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
        if self._watch.error is not None:
            raise EngineFatalError(str(self._watch.error))
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns), start=1):
            try:
                conn.send((method, args))
            except OSError:  # (BrokenPipeError) it is gone
                raise self._watch.report(_death(rank, proc, f"before {method}")) from None
        try:
            results = [getattr(self.worker, method)(*args)]
            failed: Exception | None = None
        except Exception as exc:  # noqa: BLE001 - re-raised once the workers answered
            if method not in _SERVING_METHODS:
                raise  # (start-up: the engine is not built, shutdown() stops the workers)
            results, failed = [None], exc
        deadline = time.monotonic() + WORKER_REPLY_TIMEOUT_S if failed is not None else None
        errors = []
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns), start=1):
            status, value = self._answer(rank, proc, conn, method, deadline)
            if status == "error":
                errors.append(f"tensor-parallel worker rank {rank} failed in {method}:\n"
                              f"{value}")
            results.append(value)
        if failed is not None:
            raise failed
        if errors:
            raise RuntimeError("\n".join(errors))
        return results

    def _answer(self, rank: int, proc: Any, conn: Any, method: str,
                deadline: float | None) -> tuple[str, Any]:
        while not conn.poll(0.5):
            if not proc.is_alive():
                raise self._watch.report(_death(rank, proc, f"during {method}"))
            if deadline is not None and time.monotonic() > deadline:
                raise self._watch.report(EngineFatalError(
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) did not answer "
                    f"{method} within {WORKER_REPLY_TIMEOUT_S:.0f} s after rank 0 failed it: "
                    "it is presumably stuck in a collective"))
        try:
            return conn.recv()
        except (EOFError, OSError):
            raise self._watch.report(_death(rank, proc, f"during {method}")) from None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call_all("execute_model", scheduler_output)[self._output_rank]

    def start_health_monitor(self, on_dead: Callable[[BaseException], None]) -> None:
        self._watch.add_callback(on_dead)

    def shutdown(self) -> None:
        self._finalizer()
        self.worker.shutdown()


class _WorkerWatch:
    """Watches the worker processes from a daemon thread; the first death (or hang) is the
    engine's: it is kept in `error` and handed to every callback, once."""

    def __init__(self, procs: list[Any]) -> None:
        self.procs = procs
        self.error: EngineFatalError | None = None
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[BaseException], None]] = []
        self._wake_reader, self._wake_writer = multiprocessing.Pipe(duplex=False)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        # Before multiprocessing's own exit hook ends the (daemonic) workers: that is no death.
        atexit.register(self.stop)
        self._thread = threading.Thread(target=self._run, name="vllm-tp-worker-watch",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Before the workers are stopped on purpose: their exits are no death."""
        self.stopping.set()
        try:
            self._wake_writer.send_bytes(b"stop")
        except OSError:
            pass

    def add_callback(self, callback: Callable[[BaseException], None]) -> None:
        with self._lock:
            error = self.error
            if error is None:
                self._callbacks.append(callback)
        if error is not None:
            callback(error)

    def report(self, error: EngineFatalError) -> EngineFatalError:
        """Record the engine's death (the first one wins) and tell the callbacks; returns the
        recorded error."""
        with self._lock:
            if self.error is not None or self.stopping.is_set():
                return self.error or error
            self.error = error
            callbacks, self._callbacks = self._callbacks, []
        logger.error("%s: the engine is dead", error)
        for callback in callbacks:
            try:
                callback(error)
            except Exception:  # noqa: BLE001 - one listener must not silence the others
                logger.exception("engine death callback raised")
        return error

    def _run(self) -> None:
        sentinels = {proc.sentinel: (rank, proc) for rank, proc in
                     enumerate(self.procs, start=1)}
        ready = multiprocessing.connection.wait([*sentinels, self._wake_reader])
        if self.stopping.is_set():
            return
        for item in ready:
            if item in sentinels:
                rank, proc = sentinels[item]
                proc.join(timeout=1)  # (reaps it: exitcode)
                self.report(_death(rank, proc))
                return


def _death(rank: int, proc: Any, when: str = "") -> EngineFatalError:
    code = proc.exitcode
    if code is None:
        how = "its pipe closed"
    elif code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    else:
        how = f"exit code {code}"
    when = f" {when}" if when else ""
    return EngineFatalError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) died{when} "
                            f"({how})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _release_ranks(procs: list[Any], conns: list[Any], watch: _WorkerWatch) -> None:
    """Stop ranks 1..N-1 and take rank 0 (this process) out of the process group: an engine
    dropped without shutdown() had left its group behind, and the next LLM in the process
    (of any tensor-parallel size) refused to start."""
    _stop_workers(procs, conns, watch)
    try:
        from vllm.distributed import destroy_distributed_environment

        destroy_distributed_environment()
    except Exception:  # (at interpreter exit the modules may be gone)
        pass


def _stop_workers(procs: list[Any], conns: list[Any], watch: _WorkerWatch) -> None:
    # After a death the others may be stuck in a collective with the dead rank: do not wait
    # for them to read "shutdown".
    patience = 10.0 if watch.error is None else 1.0
    watch.stop()
    for conn in conns:
        try:
            conn.send(("shutdown", ()))
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(timeout=patience)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    for conn in conns:
        conn.close()


def _worker_main(vllm_config: VllmConfig, rank: int, init_method: str, conn: Any) -> None:
    """A rank > 0: run Worker methods as rank 0 asks, answer each call."""
    set_process_prefix(f"(TP rank={rank} pid={os.getpid()}) ")
    sampler = output_rank(vllm_config)
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
                # Only the output rank samples; the others' results are not needed.
                conn.send(("ok", None if method == "execute_model" and rank != sampler
                           else result))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    finally:
        worker.shutdown()
