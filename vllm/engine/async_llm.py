"""AsyncLLM: an `LLMEngine` driven by a background thread, with asyncio streams per request.

The engine is not thread-safe, so exactly one thread touches it: the engine thread. The asyncio
side sends it commands (add, abort, stop) through a queue; between commands the thread calls
`engine.step()` while any request is unfinished, which gives continuous batching across every
request added from any coroutine. Each step's outputs are handed back to the event loop that
added the request (`loop.call_soon_threadsafe`).

Outputs are cumulative (text and token_ids so far), so a slow consumer only ever needs the
newest one: a `RequestStream` keeps the latest output instead of a growing queue.

Contract for callers:
  * `generate(prompt, sampling_params, request_id)` -> async iterator of `RequestOutput`; the
    last one has `finished=True`. Leaving the iteration early (break, cancellation, a client
    that went away) aborts the request and frees its KV blocks.
  * `add_request(...)` -> `RequestStream` raises `ValueError` before anything is streamed
    (prompt too long, bad params) so an HTTP layer can still answer 400. `add_requests([...])`
    hands several to the engine thread as one command, so they are all added between the same
    two steps (a multi-prompt API call is one batch, not one request per step).
  * `abort(request_id)`; `get_stats()` (the engine's `stats()` as of the last step, plus the
    number of requests in flight); `wait_for_idle(timeout)`; `shutdown()`.
  * A request the engine failed on its own (its `pop_request_errors()` names it; the engine
    goes on) ends its stream with `RequestFailedError`.
  * If `engine.step()` raises, or the engine reports its death from another thread (its
    `start_health_monitor(callback)`, e.g. a tensor-parallel worker exited while idle),
    every stream fails with `EngineDeadError`, `errored` turns True (`dead_error` says why)
    and new requests are refused.

Where the engine runs: `from_engine_args` builds an `LLMEngine` in the engine thread, or (the
servers' default; VLLM_ENABLE_MULTIPROCESSING=0 turns it off) an `EngineCoreClient`
(vllm/engine/core_client.py): the scheduler and the model then run in an engine-core process
of their own and the engine thread here only detokenizes their outputs, so HTTP and SSE work
no longer shares the interpreter lock with the model's steps. The contract above is the same
either way; the core process dying is the engine dying (EngineDeadError).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from vllm.logger import init_logger
from vllm.outputs import RequestOutput

logger = init_logger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "EngineError", "RequestFailedError", "RequestStream",
           "StatObserver"]


class EngineError(RuntimeError):
    """A request's outputs cannot come: the base of the two reasons below (what the servers
    answer with a 500 and an OpenAI-style body, or an error event in a stream)."""


class EngineDeadError(EngineError):
    """The engine thread stopped (a step raised, or `shutdown()` was called)."""


class RequestFailedError(EngineError):
    """This request failed inside the engine, which goes on serving the others (whether the
    engine lives is `AsyncLLM.errored`)."""


class StatObserver(Protocol):
    """Receives per-request events from the engine thread (must be thread-safe)."""

    def on_first_token(self, ttft_s: float) -> None: ...

    def on_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None: ...

    def on_inter_token(self, seconds: float, num_tokens: int) -> None: ...

    def on_finished(self, finish_reason: str, e2e_s: float, num_prompt_tokens: int,
                    num_generation_tokens: int) -> None: ...


_STOP = object()
_DEAD = object()  # from the health monitor: the engine died while the thread may be idle


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: Any
    sampling_params: Any
    stream: RequestStream
    done: concurrent.futures.Future


@dataclasses.dataclass
class _AddBatch:
    """Adds the engine thread takes together, between two steps."""
    adds: list[_Add]


@dataclasses.dataclass
class _Abort:
    request_ids: list[str]
    notify: bool  # end the streams with finish_reason "abort" (False: nobody is listening)


@dataclasses.dataclass
class _Call:
    """Run `fn(engine)` in the engine thread between steps; its result goes to `done`."""
    fn: Callable[[Any], Any]
    done: concurrent.futures.Future


class RequestStream:
    """The outputs of one request, read on the event loop that added it.

    Holds only the newest (cumulative) output. `finished` is True once the final output
    (or an error) has been delivered; iteration stops after yielding the final output.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self.last: RequestOutput | None = None
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self.arrival_time = time.monotonic()
        # Engine-thread bookkeeping (only the engine thread reads or writes these).
        self._num_tokens_seen = 0
        self._first_token_seen = False
        self._last_token_time: float | None = None

    # -- called on the event loop ----------------------------------------------------------
    def _put(self, item: RequestOutput | BaseException) -> None:
        if self.finished:
            return
        if isinstance(item, BaseException):
            self._pending = item
        else:
            self.last = item
            # An error already waiting is never replaced by an output.
            if not isinstance(self._pending, BaseException):
                self._pending = item
        self._ready.set()

    def _put_aborted(self) -> None:
        """End the stream as the engine would for an aborted request."""
        self._put(_aborted_output(self.request_id, self.last))

    async def get(self) -> RequestOutput:
        """The newest output not yet returned; raises StopAsyncIteration after the final one."""
        if self.finished and self._pending is None:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        item, self._pending = self._pending, None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        assert item is not None
        if item.finished:
            self.finished = True
        return item

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and self._pending is None:
            raise StopAsyncIteration
        return await self.get()


def _aborted_output(request_id: str, last: RequestOutput | None) -> RequestOutput:
    if last is None:
        return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[],
                             prompt_logprobs=None, outputs=[], finished=True)
    out = copy.copy(last)
    out.outputs = [c if c.finish_reason is not None
                   else dataclasses.replace(c, finish_reason="abort") for c in last.outputs]
    out.finished = True
    return out


def _snapshot(output: RequestOutput) -> RequestOutput:
    """A copy the event loop can read while the engine thread keeps mutating its own."""
    out = copy.copy(output)
    out.outputs = [dataclasses.replace(c, token_ids=list(c.token_ids),
                                       logprobs=None if c.logprobs is None else list(c.logprobs))
                   for c in output.outputs]
    return out


class AsyncLLM:
    """Runs `engine` in a background thread; see the module docstring for the contract."""

    def __init__(self, engine: Any = None, *, build_engine: Callable[[], Any] | None = None,
                 stat_observer: StatObserver | None = None, copy_outputs: bool = False) -> None:
        """`engine`, or `build_engine()` to build it in the engine thread (returns when it is
        built; re-raises what the build raised)."""
        if (engine is None) == (build_engine is None):
            raise TypeError("AsyncLLM needs exactly one of engine and build_engine")
        self.engine = engine
        self.stat_observer = stat_observer
        self._copy_outputs = copy_outputs
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # guarded by _lock
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._stopped = False
        self._stats: dict[str, Any] = {}
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._build_and_run, args=(build_engine, built),
                                        name="vllm-engine-loop", daemon=True)
        self._thread.start()
        built.result()

    @classmethod
    def from_engine_args(cls, engine_args: Any, *, multiprocessing: bool | None = None,
                         **kwargs: Any) -> AsyncLLM:
        """Build the engine (loads the model: slow) and start its loop.

        `multiprocessing`: the scheduler and the model run in an engine-core process
        (`vllm.engine.core`) and the engine thread here drives an `EngineCoreClient`, which
        detokenizes; otherwise an `LLMEngine` is built in the engine thread and runs there.
        None: VLLM_ENABLE_MULTIPROCESSING where it is set, else in-process (the servers pass
        the variable's value, whose default is the core process). (Built in the engine
        thread, not the caller's: a second thread's OpenMP team alive next to the engine
        thread's made the engine's parallel regions ~2.3x slower on the 2-core dev machine, a
        small linear + relu: 36 -> 84 us.)"""
        if multiprocessing is None:
            multiprocessing = multiprocessing_requested(default=False)
        if multiprocessing:
            from vllm.engine.core_client import EngineCoreClient

            return cls(build_engine=lambda: EngineCoreClient.from_engine_args(engine_args),
                       **kwargs)
        from vllm.engine.llm_engine import LLMEngine

        return cls(build_engine=lambda: LLMEngine.from_engine_args(engine_args), **kwargs)

    # ---- engine facts --------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def vllm_config(self) -> Any:
        return self.engine.vllm_config

    @property
    def model_config(self) -> Any:
        return self.engine.vllm_config.model_config

    @property
    def startup_phases(self) -> dict[str, float] | None:
        """Start-up phase seconds if the engine (or its config) records them."""
        for owner in (self.engine, getattr(self.engine, "vllm_config", None)):
            phases = getattr(owner, "startup_phases", None)
            if phases:
                return dict(phases)
        return None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> BaseException | None:
        """What killed the engine (None while it lives)."""
        return self._dead

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def in_flight_ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def get_stats(self) -> dict[str, Any]:
        """The engine's `stats()` as of the last step or command (an engine core's newest,
        whenever it sent them), plus `num_in_flight`."""
        live = getattr(self.engine, "live_stats", None)
        stats = dict(live()) if callable(live) else dict(self._stats)
        stats["num_in_flight"] = self.num_in_flight
        return stats

    # upstream's async accessors (`await engine.get_tokenizer()` ...)
    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def get_model_config(self) -> Any:
        return self.model_config

    async def get_vllm_config(self) -> Any:
        return self.vllm_config

    @property
    def is_stopped(self) -> bool:
        return not self.is_running

    async def reset_prefix_cache(self) -> bool:
        """Drop the cached prefix blocks (in the engine thread, between steps); False when
        requests still hold blocks."""
        self.check_health()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(lambda engine: engine.reset_prefix_cache(), done))
        return await asyncio.wrap_future(done)

    def _submit(self, command: _AddBatch | _Call) -> None:
        """Queue a command for the engine thread. The thread may have died (and drained the
        queue) since the caller checked: the dead flag is set before that drain, so checking
        it after queueing fails the command either here or in the drain, never neither."""
        self._commands.put(command)
        if self._dead is not None:
            _refuse(command, EngineDeadError(f"engine loop stopped: {self._dead!r}"))
        elif self._stopped:
            _refuse(command, EngineDeadError("engine shut down"))

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine thread is gone."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop stopped: {self._dead!r}")
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")

    # ---- requests ------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Any,
                          sampling_params: Any) -> RequestStream:
        """Hand a request to the engine. Raises ValueError (bad prompt or params, duplicate
        id) or EngineDeadError before returning; the stream then yields its outputs."""
        result = (await self.add_requests([(request_id, prompt, sampling_params)]))[0]
        if isinstance(result, BaseException):
            raise result
        return result

    async def add_requests(self, requests: list[tuple[str, Any, Any]]
                           ) -> list[RequestStream | BaseException]:
        """Hand (request_id, prompt, sampling_params) requests to the engine in one command:
        the engine thread adds them all between the same two steps. Each result is the
        request's stream, or the exception that refused it (ValueError: bad prompt or params,
        an id already in flight; EngineDeadError); a refused request is not in flight.
        Raises EngineDeadError when the engine is already gone."""
        self.check_health()
        loop = asyncio.get_running_loop()
        results: list[RequestStream | BaseException | None] = [None] * len(requests)
        adds: list[tuple[int, _Add]] = []
        with self._lock:
            for i, (request_id, prompt, sampling_params) in enumerate(requests):
                if request_id in self._streams:
                    results[i] = ValueError(f"request_id {request_id!r} is already in flight")
                    continue
                stream = RequestStream(request_id, loop)
                self._streams[request_id] = stream
                adds.append((i, _Add(request_id, prompt, sampling_params, stream,
                                     concurrent.futures.Future())))
        if adds:
            self._submit(_AddBatch([add for _, add in adds]))
        try:
            outcomes = await asyncio.gather(*(asyncio.wrap_future(add.done) for _, add in adds),
                                            return_exceptions=True)
        except asyncio.CancelledError:
            # The caller went away while the engine was adding them: undo.
            self._abort_nowait([add.request_id for _, add in adds], notify=False)
            raise
        for (i, add), outcome in zip(adds, outcomes):
            if isinstance(outcome, BaseException):
                with self._lock:
                    if self._streams.get(add.request_id) is add.stream:
                        del self._streams[add.request_id]
                results[i] = outcome
            else:
                results[i] = add.stream
        return results  # type: ignore[return-value]

    async def generate(self, prompt: Any, sampling_params: Any,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (cumulative) until the finished one. Closing the
        iterator early or cancelling the task aborts the request."""
        stream = await self.add_request(request_id, prompt, sampling_params)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self._abort_nowait([request_id], notify=False)

    def abort_nowait(self, request_ids: list[str]) -> None:
        """Abort requests whose streams nobody reads any more (callable from any thread)."""
        self._abort_nowait(list(request_ids), notify=False)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests; their streams end with finish_reason "abort"."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._abort_nowait(ids, notify=True)

    def _abort_nowait(self, request_ids: list[str], notify: bool) -> None:
        if not notify:  # nobody reads these streams any more: forget them now
            with self._lock:
                gone = [s for s in (self._streams.pop(rid, None) for rid in request_ids)
                        if s is not None]
            # Ids no longer in flight are finished or already being aborted.
            request_ids = [s.request_id for s in gone]
            if not request_ids:
                return
            self._count_aborted(gone)
        self._commands.put(_Abort(list(request_ids), notify))

    def _count_aborted(self, streams: list[RequestStream]) -> None:
        if self.stat_observer is None:
            return
        now = time.monotonic()
        for stream in streams:
            self.stat_observer.on_finished("abort", now - stream.arrival_time, 0,
                                           stream._num_tokens_seen)

    async def wait_for_idle(self, timeout: float, poll_s: float = 0.05) -> bool:
        """Wait until no request is in flight; False if `timeout` seconds passed first."""
        deadline = time.monotonic() + timeout
        while self.num_in_flight:
            if time.monotonic() >= deadline or self._dead is not None:
                return self.num_in_flight == 0
            await asyncio.sleep(poll_s)
        return True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight, stop the engine thread and join it. Idempotent."""
        if not self._stopped:
            self._stopped = True
            self._commands.put(_STOP)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        shutdown = getattr(self.engine, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                logger.exception("engine shutdown raised")

    # ---- the engine thread ---------------------------------------------------------------
    def _build_and_run(self, build_engine: Callable[[], Any] | None,
                       built: concurrent.futures.Future) -> None:
        try:
            if build_engine is not None:
                self.engine = build_engine()
            self._stats = self._read_stats()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the constructing thread
            built.set_exception(exc)
            return
        built.set_result(None)
        monitor = getattr(self.engine, "start_health_monitor", None)
        if callable(monitor):
            monitor(self._on_engine_dead)
        self._run()

    def _on_engine_dead(self, error: BaseException) -> None:
        """The engine's monitor (another thread) saw it die: fail everything now, even if the
        engine thread is idle or stuck in a step, and wake that thread to stop."""
        if self._dead is not None or self._stopped:
            return
        self._dead = error
        logger.error("The engine died: %s", error)
        self._fail_all(EngineDeadError(f"engine died: {error}"))
        self._commands.put(_DEAD)

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                commands = []
                if not engine.has_unfinished_requests():
                    commands.append(self._commands.get())  # idle: sleep until work arrives
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                stop = False
                for command in commands:
                    if command is _STOP:
                        stop = True
                    elif command is _DEAD:
                        raise EngineDeadError(f"engine died: {self._dead}")
                    elif isinstance(command, _AddBatch):
                        for add in command.adds:
                            self._handle_add(add)
                    elif isinstance(command, _Call):
                        self._handle_call(command)
                    else:
                        self._handle_abort(command)
                if stop:
                    self._abort_all("engine shut down")
                    return
                outputs = engine.step() if engine.has_unfinished_requests() else []
                # Stats first: a client that sees its final output also sees its blocks freed.
                self._stats = self._read_stats()
                self._deliver(outputs, self._pop_request_errors())
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            if self._dead is None:
                logger.exception("engine loop died")
                self._dead = exc
            dead = self._dead
            self._fail_all(EngineDeadError(f"engine loop died: {dead!r}"))
            while True:  # fail any add that raced with the crash
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                _refuse(command, EngineDeadError(f"engine loop died: {dead!r}"))

    def _pop_request_errors(self) -> dict[str, BaseException]:
        pop = getattr(self.engine, "pop_request_errors", None)
        return pop() if callable(pop) else {}

    def _handle_add(self, command: _Add) -> None:
        if command.done.done():  # cancelled, or refused by _submit (the engine died)
            return
        with self._lock:
            wanted = self._streams.get(command.request_id) is command.stream
        if not wanted:  # aborted before it reached the engine
            _set_result(command.done, None)
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.sampling_params)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            _set_exception(command.done, exc)
            return
        _set_result(command.done, None)

    def _handle_call(self, command: _Call) -> None:
        if command.done.done():
            return
        try:
            _set_result(command.done, command.fn(self.engine))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            _set_exception(command.done, exc)

    def _handle_abort(self, command: _Abort) -> None:
        aborted = []
        for rid in command.request_ids:
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - unknown or already finished id
                logger.debug("abort of %s ignored", rid, exc_info=True)
            with self._lock:
                stream = self._streams.pop(rid, None)
            if stream is not None:
                aborted.append(stream)
        self._count_aborted(aborted)
        if command.notify:
            for stream in aborted:
                stream.loop.call_soon_threadsafe(stream._put_aborted)

    def _deliver(self, outputs: list[RequestOutput],
                 errors: dict[str, BaseException] | None = None) -> None:
        """Hand outputs to their streams; a request in `errors` (failed by the engine) ends
        its stream with RequestFailedError instead of its last output."""
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        observer = self.stat_observer
        errors = dict(errors or {})
        for output in outputs:
            error = errors.pop(output.request_id, None)
            with self._lock:
                stream = self._streams.get(output.request_id)
                if stream is not None and (output.finished or error is not None):
                    del self._streams[output.request_id]
            if stream is None:
                continue  # aborted by its consumer
            if observer is not None:
                try:
                    self._observe(observer, stream, output, now)
                except Exception:  # noqa: BLE001 - metrics must never kill the loop
                    logger.debug("stat observer raised", exc_info=True)
            item: Any
            if error is not None:
                item = _request_failed(output.request_id, error)
            else:
                item = _snapshot(output) if self._copy_outputs else output
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for request_id, error in errors.items():  # failed with no output to show
            with self._lock:
                stream = self._streams.pop(request_id, None)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append(
                    (stream, _request_failed(request_id, error)))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_many, items)
            except RuntimeError:  # that loop is closed: nobody is listening
                pass

    @staticmethod
    def _observe(observer: StatObserver, stream: RequestStream, output: RequestOutput,
                 now: float) -> None:
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        new_tokens = num_tokens - stream._num_tokens_seen
        num_prompt = 0
        if num_tokens and not stream._first_token_seen:
            stream._first_token_seen = True
            num_prompt = len(output.prompt_token_ids or [])
            observer.on_first_token(now - stream.arrival_time)
            if new_tokens > 1:  # more tokens in the first output (e.g. two steps' at once)
                observer.on_inter_token(0.0, new_tokens - 1)
        elif new_tokens > 0 and stream._last_token_time is not None:
            observer.on_inter_token(now - stream._last_token_time, new_tokens)
        if new_tokens or num_prompt:
            observer.on_tokens(num_prompt, max(new_tokens, 0))
        if new_tokens > 0:
            stream._last_token_time = now
        stream._num_tokens_seen = num_tokens
        if output.finished:
            reasons = [c.finish_reason for c in output.outputs if c.finish_reason]
            observer.on_finished(reasons[0] if reasons else "stop", now - stream.arrival_time,
                                 len(output.prompt_token_ids or []), num_tokens)

    def _abort_all(self, why: str) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            try:
                self.engine.abort_request(stream.request_id)
            except Exception:  # noqa: BLE001
                pass
            try:
                stream.loop.call_soon_threadsafe(stream._put_aborted)
            except RuntimeError:
                pass
        while True:  # adds still queued: refuse them
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            _refuse(command, EngineDeadError(why))
        self._stats = self._read_stats()

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            try:
                stream.loop.call_soon_threadsafe(stream._put, exc)
            except RuntimeError:
                pass

    def _read_stats(self) -> dict[str, Any]:
        stats = getattr(self.engine, "stats", None)
        if not callable(stats):
            return {}
        try:
            return dict(stats())
        except Exception:  # noqa: BLE001 - metrics must never kill the loop
            logger.debug("engine.stats() raised", exc_info=True)
            return dict(self._stats) if hasattr(self, "_stats") else {}


def multiprocessing_requested(default: bool = True) -> bool:
    """VLLM_ENABLE_MULTIPROCESSING where the environment sets it, else `default` (the servers
    take the variable's own default: the engine-core process)."""
    import os

    from vllm import envs

    if os.environ.get("VLLM_ENABLE_MULTIPROCESSING", "").strip():
        return envs.VLLM_ENABLE_MULTIPROCESSING
    return default


def _set_exception(future: concurrent.futures.Future, exc: BaseException) -> None:
    """Fail `future` unless it is already done (another thread may race to do the same)."""
    try:
        future.set_exception(exc)
    except concurrent.futures.InvalidStateError:
        pass


def _set_result(future: concurrent.futures.Future, result: Any) -> None:
    try:
        future.set_result(result)
    except concurrent.futures.InvalidStateError:  # failed meanwhile by _submit
        pass


def _request_failed(request_id: str, error: BaseException) -> RequestFailedError:
    return RequestFailedError(f"request {request_id} failed in the engine (which goes on "
                              f"serving other requests): {error!r}")


def _put_many(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, item in items:
        stream._put(item)


# Upstream's name for the same class (its V1 engine is also AsyncLLM under this alias).
AsyncLLMEngine = AsyncLLM


def _refuse(command: Any, exc: BaseException) -> None:
    """Fail a queued command that will not run (adds and calls; aborts need no answer)."""
    if isinstance(command, _AddBatch):
        for add in command.adds:
            _set_exception(add.done, exc)
    elif isinstance(command, _Call):
        _set_exception(command.done, exc)
