"""The API process's side of the engine core (`vllm.engine.core`).

`EngineCoreClient` starts the core process and stands in for `LLMEngine` under `AsyncLLM`
(the same methods: add_request, abort_request, step, has_unfinished_requests, stats,
pop_request_errors, start_health_monitor, reset_prefix_cache, shutdown), so the servers do
not change. What stays in this process: validating and tokenizing prompts
(`InputProcessor.prepare_request`), incremental detokenization, stop strings and logprob
dicts (`OutputProcessor`), and the streams. What moves: the scheduler, the model and the
executor (with its tensor-parallel workers), which run in the core's own interpreter.

Threads here: the AsyncLLM engine thread owns the command socket and calls `step()`, which
waits (GIL released) for the core's next step message and turns it into RequestOutputs; one
receiver thread owns the reply socket, decodes each message, keeps the newest stats and hands
step messages over; one monitor thread waits on the core process and reports its death
(`EngineFatalError`) to the callback `start_health_monitor` registered (AsyncLLM then fails
every stream with EngineDeadError).
"""
from __future__ import annotations

import concurrent.futures
import itertools
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from typing import Any

from vllm.engine.core import (
    Abort,
    AddRequest,
    Dead,
    FinishSequences,
    Ready,
    Shutdown,
    StartFailed,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    make_encoder,
    pickled,
    reply_decoder,
    run_engine_core,
)
from vllm.engine.errors import EngineFatalError
from vllm.engine.llm_engine import InputProcessor, PromptType
from vllm.engine.output_processor import OutputProcessor
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.utils.startup_timer import StartupTimer

logger = init_logger(__name__)

__all__ = ["EngineCoreClient"]

_DIED = object()  # in the inbox: the core is gone


def _import_tokenizer_modules() -> None:
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401
    except Exception:  # noqa: BLE001 - only a warm-up: the real load reports any problem
        logger.debug("tokenizer imports failed", exc_info=True)


class EngineCoreClient(InputProcessor):
    """Starts the engine core for `engine_args` and waits until its model is ready (raises
    what the core's start raised). See the module docstring."""

    step_wait_s = 0.05
    """The longest `step()` waits for the core before returning no outputs (so the caller can
    take its next commands)."""

    def __init__(self, engine_args: Any) -> None:
        import zmq

        self._zmq = zmq
        self._closing = False
        self._dead: BaseException | None = None
        self._on_dead: list[Callable[[BaseException], None]] = []
        self._dead_lock = threading.Lock()
        self._errors: dict[str, BaseException] = {}
        self._pending: list[Any] = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._encoder = make_encoder()
        self._decoder = reply_decoder()
        self._dir = tempfile.mkdtemp(prefix="vllm-engine-core-")
        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._commands.bind(f"ipc://{self._dir}/commands")
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind(f"ipc://{self._dir}/replies")
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(
            target=run_engine_core, name="vllm-engine-core",
            args=(engine_args, f"ipc://{self._dir}/commands", f"ipc://{self._dir}/replies",
                  os.getpid()))
        try:
            self.process.start()
            # The tokenizer is loaded here once the core is ready; its imports (seconds) can
            # run while the core loads the model.
            threading.Thread(target=_import_tokenizer_modules, daemon=True,
                             name="vllm-tokenizer-imports").start()
            ready = self._wait_until_ready()
            self.startup_seconds = ready.startup_seconds
            self.startup_phases = dict(ready.startup_phases)
            self.startup_report = ready.startup_report
            self._stats: dict[str, Any] = dict(ready.stats)
            self._init_inputs(ready.vllm_config, StartupTimer())
            self.output_processor = OutputProcessor(self.tokenizer)
        except BaseException:
            self.shutdown()
            raise
        self._receiver = threading.Thread(target=self._receive_loop, daemon=True,
                                          name="vllm-core-replies")
        self._receiver.start()
        self._monitor = threading.Thread(target=self._watch_process, daemon=True,
                                         name="vllm-core-monitor")
        self._monitor.start()
        logger.info("Engine core running in process %d", self.process.pid)

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> EngineCoreClient:
        return cls(engine_args)

    def _wait_until_ready(self) -> Ready:
        while True:
            if self._replies.poll(100):
                reply = self._decoder.decode(self._replies.recv())
                if isinstance(reply, Ready):
                    return reply
                if isinstance(reply, StartFailed):
                    error = reply.error
                    if isinstance(error, BaseException):
                        raise error
                    raise RuntimeError(f"the engine core failed to start: {error}\n"
                                       f"{reply.traceback}")
                raise RuntimeError(f"unexpected first message from the engine core: "
                                   f"{type(reply).__name__}")
            if not self.process.is_alive():
                raise RuntimeError(f"the engine core process exited with code "
                                   f"{self.process.exitcode} while starting")

    # ---- the engine's methods (called from the AsyncLLM engine thread) -----------------
    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate here (ValueError at once), then queue the request for the core; it is
        sent with the next `step()` (so the adds between two steps travel as one message)."""
        self._check_alive()
        p = self.prepare_request(request_id, prompt, params, arrival_time)
        self.output_processor.add_request(p.request_id, p.prompt, p.prompt_token_ids,
                                          p.params, p.internal_ids, p.child_params)
        params = pickled(p.params)
        children = ([] if len(p.child_params) == 1 and p.child_params[0] is p.params
                    else [pickled(c) for c in p.child_params])
        self._pending.append(AddRequest(p.request_id, p.prompt_token_ids, params,
                                        p.internal_ids, children, p.max_tokens,
                                        p.arrival_time))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.output_processor.abort_requests(ids)
        self._pending.append(Abort(ids))
        self._flush()  # now: the caller may not step again (nothing left to wait for)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Send what is queued, wait up to `step_wait_s` for the core's step messages (all
        those already there are taken together) and return the RequestOutputs of the requests
        that progressed. Raises EngineFatalError once the core is gone."""
        self._flush()
        try:
            first = self._inbox.get(timeout=self.step_wait_s)
        except queue.Empty:
            self._check_alive()
            return []
        messages = [first]
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        core_outputs: list = []
        failed: dict[str, Any] = {}
        for message in messages:
            if message is _DIED:
                self._check_alive()
            core_outputs.extend(message.outputs)
            failed.update(message.failed)
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        if stopped:  # stop strings found here: the core stops generating for them now
            self._pending.append(FinishSequences(stopped))
            self._flush()
        for request_id, error in failed.items():
            output = self._fail(request_id, error)
            if output is not None:
                outputs.append(output)
        return outputs

    def _fail(self, request_id: str, error: Any) -> RequestOutput | None:
        """A request the core failed (its step raised because of it): its final output,
        finish_reason "error", and its exception for `pop_request_errors`."""
        self._errors[request_id] = (error if isinstance(error, BaseException)
                                    else RuntimeError(str(error)))
        state = self.output_processor.requests.get(request_id)
        if state is None:
            return None
        self.output_processor.abort_requests([request_id])
        for seq in state.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = "error"
        return state.make_output()

    def pop_request_errors(self) -> dict[str, BaseException]:
        errors, self._errors = self._errors, {}
        return errors

    def stats(self) -> dict:
        """The core's stats as of its last message (read by any thread)."""
        return dict(self._stats)

    def live_stats(self) -> dict:
        return self.stats()

    def reset_prefix_cache(self) -> bool:
        return bool(self._call("reset_prefix_cache"))

    def _call(self, method: str, timeout: float = 60.0) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[call_id] = future
        self._pending.append(UtilityCall(call_id, method))
        self._flush()
        try:
            reply = future.result(timeout)
        finally:
            self._calls.pop(call_id, None)
        if reply.error is not None:
            raise (reply.error if isinstance(reply.error, BaseException)
                   else RuntimeError(str(reply.error)))
        return reply.result

    def start_health_monitor(self, on_dead: Callable[[BaseException], None]) -> None:
        """Call `on_dead(error)` (from another thread) when the core process dies or its loop
        reports its death."""
        with self._dead_lock:
            dead = self._dead
            if dead is None:
                self._on_dead.append(on_dead)
        if dead is not None:
            on_dead(dead)

    # ---- plumbing ----------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if not self._closing and not self.process.is_alive():
            self._report_dead(self._exit_error())
            raise self._dead  # type: ignore[misc]

    def _exit_error(self) -> EngineFatalError:
        return EngineFatalError(f"the engine core process (pid {self.process.pid}) exited "
                                f"with code {self.process.exitcode}")

    def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        try:
            self._commands.send(self._encoder.encode(pending), copy=False)
        except self._zmq.ZMQError as exc:
            raise EngineFatalError(f"cannot reach the engine core: {exc}") from exc

    def _report_dead(self, error: BaseException) -> None:
        with self._dead_lock:
            if self._dead is not None or self._closing:
                return
            self._dead = error
            callbacks = list(self._on_dead)
        self._inbox.put(_DIED)
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(error)
        for callback in callbacks:
            try:
                callback(error)
            except Exception:  # noqa: BLE001
                logger.exception("engine-death callback raised")

    def _receive_loop(self) -> None:
        zmq = self._zmq
        sock = self._replies
        while not self._closing:
            try:
                if not sock.poll(100):
                    continue
                frame = sock.recv(copy=False)
            except zmq.ZMQError:
                return
            try:
                reply = self._decoder.decode(frame.buffer)
            except Exception as exc:  # noqa: BLE001 - a broken message: the link is broken
                self._report_dead(EngineFatalError(f"undecodable message from the engine "
                                                   f"core: {exc!r}"))
                return
            if isinstance(reply, StepOutputs):
                self._stats = reply.stats
                self._inbox.put(reply)
            elif isinstance(reply, UtilityResult):
                future = self._calls.get(reply.call_id)
                if future is not None and not future.done():
                    future.set_result(reply)
            elif isinstance(reply, Dead):
                self._report_dead(EngineFatalError(f"the engine core died: {reply.error}"))
                return

    def _watch_process(self) -> None:
        multiprocessing.connection.wait([self.process.sentinel])
        if self._closing:
            return
        self._receiver.join(0.5)  # a `Dead` message still on its way says more
        self._report_dead(self._exit_error())

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (it finishes its step, shuts its executor down and exits), then
        close the sockets. Idempotent."""
        if self._closing and self._ctx.closed:
            return
        self._closing = True
        proc = self.process
        if proc.is_alive():
            try:
                self._commands.send(self._encoder.encode([Shutdown()]), self._zmq.NOBLOCK)
            except self._zmq.ZMQError:
                pass
            proc.join(timeout)
            if proc.is_alive():
                logger.warning("the engine core did not stop in %.0f s: terminating it",
                               timeout)
                proc.kill()
                proc.join(5)
        receiver = getattr(self, "_receiver", None)
        if receiver is not None and receiver is not threading.current_thread():
            receiver.join(2)
        self._commands.close(linger=0)
        self._replies.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
