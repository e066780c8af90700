"""The engine core: the scheduler and the model in a process of their own.

`vllm serve` runs it (unless VLLM_ENABLE_MULTIPROCESSING=0) so that the per-request Python work
of the API process (HTTP, SSE, tokenizing, detokenizing, stop strings) and the engine loop do
not share one interpreter lock. The API side is `vllm.engine.core_client.EngineCoreClient`.

Wire: two ZMQ PUSH/PULL pipes over ipc:// sockets, every message one msgspec (MessagePack)
frame. The API process sends a list of commands per flush (`AddRequest`, `Abort`,
`FinishSequences`, `UtilityCall`, `Shutdown`); the core answers with `Ready` (or `StartFailed`)
once the model is loaded, then one `StepOutputs` per engine step (every request that
progressed: new token ids, logprobs, finish reasons, plus the engine's stats), `UtilityResult`
for calls, and `Dead` when its loop dies. Python objects without a msgspec form
(SamplingParams, the VllmConfig, exceptions) travel pickled inside a MessagePack extension.

The core never detokenizes: its output processor (`CoreOutputProcessor`) only collects each
step's `EngineCoreOutput`s. A stop string is found in the API process, which then finishes the
sequence here (`FinishSequences`), as an abort would.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any

import msgspec

from vllm.engine.output_processor import OutputProcessor
from vllm.engine.sched_output import EngineCoreOutput
from vllm.logger import init_logger

logger = init_logger(__name__)

_PICKLE_EXT = 1


# ---- messages: API process -> core ------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """A request `InputProcessor.prepare_request` validated and split into its sequences."""
    request_id: str
    prompt_token_ids: list[int]
    params: Any  # SamplingParams (pickled)
    internal_ids: list[str]
    child_params: list[Any]
    """SamplingParams (pickled), one per sequence; empty for n=1 (then `params` is the
    sequence's)."""
    max_tokens: int
    arrival_time: float | None = None


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]
    """User request ids (all their sequences stop)."""


class FinishSequences(msgspec.Struct, tag=True, array_like=True):
    internal_ids: list[str]
    """Sequences a stop string finished in the API process."""


class UtilityCall(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    method: str
    """A method of the engine without arguments (e.g. "reset_prefix_cache")."""


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


Command = AddRequest | Abort | FinishSequences | UtilityCall | Shutdown


# ---- messages: core -> API process -------------------------------------------------------
class Ready(msgspec.Struct, tag=True, array_like=True):
    vllm_config: Any  # pickled
    startup_seconds: float
    startup_phases: dict[str, float]
    startup_report: Any  # pickled
    stats: dict[str, Any]
    pid: int


class StartFailed(msgspec.Struct, tag=True, array_like=True):
    error: Any  # the exception (pickled), or its text when it cannot be pickled
    traceback: str


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[EngineCoreOutput]
    failed: dict[str, Any]
    """user request id -> the exception (pickled, or its repr) a failed step failed it with."""
    stats: dict[str, Any]


class UtilityResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: Any = None
    error: Any = None


class Dead(msgspec.Struct, tag=True, array_like=True):
    error: str


Reply = Ready | StartFailed | StepOutputs | UtilityResult | Dead


def pickled(obj: Any) -> msgspec.msgpack.Ext:
    """`obj` as a pickle inside a MessagePack extension (decoded back to `obj` on the other
    side). Needed for dataclasses (SamplingParams, VllmConfig), which msgspec would otherwise
    send as plain maps."""
    return msgspec.msgpack.Ext(_PICKLE_EXT, pickle.dumps(obj, protocol=5))


def _enc_hook(obj: Any) -> Any:
    try:
        return msgspec.msgpack.Ext(_PICKLE_EXT, pickle.dumps(obj, protocol=5))
    except Exception as exc:  # noqa: BLE001
        if isinstance(obj, BaseException):  # an exception that cannot be pickled: its text
            return repr(obj)
        raise TypeError(f"cannot send {type(obj).__name__} to/from the engine core: "
                        f"{exc!r}") from exc


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _PICKLE_EXT:
        raise ValueError(f"unknown MessagePack extension {code} from the engine core")
    return pickle.loads(data)


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def command_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(list[Command], ext_hook=_ext_hook)


def reply_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Reply, ext_hook=_ext_hook)


def _as_sendable_error(exc: BaseException) -> Any:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - its text then
        return f"{type(exc).__name__}: {exc}"


# ---- the core ----------------------------------------------------------------------------
class CoreOutputProcessor(OutputProcessor):
    """The core's output processor: it knows the requests (step recovery and the abort path
    use that) but turns nothing into text; each step's outputs wait in `pending` for the core
    to send them."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(None)  # no detokenizer, no stop strings, no decoded logprobs
        self.pending: list[EngineCoreOutput] = []

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list, list[str]]:
        self.pending.extend(outputs)
        for out in outputs:
            if not out.finished:
                continue
            entry = self._seq_to_request.get(out.request_id)
            if entry is None:
                continue
            state, seq = entry
            seq.finish_reason = out.finish_reason
            self._seq_to_request.pop(out.request_id, None)
            if state.finished:
                self.requests.pop(state.request_id, None)
        return [], []

    def finish_sequences(self, internal_ids: list[str]) -> list[str]:
        """Mark sequences finished (a stop string in the API process); those still known."""
        known = []
        for iid in internal_ids:
            entry = self._seq_to_request.pop(iid, None)
            if entry is None:
                continue
            state, seq = entry
            known.append(iid)
            seq.finish_reason = "stop"
            if state.finished:
                self.requests.pop(state.request_id, None)
        return known

    def take(self) -> list[EngineCoreOutput]:
        pending, self.pending = self.pending, []
        return pending


class EngineCore:
    """Runs an `LLMEngine` (built with `CoreOutputProcessor`) between two ZMQ sockets: take
    every queued command, step while any request is unfinished, send each step's outputs.
    Idle, it waits on the input socket (checking every `poll_ms` that the API process still
    lives)."""

    def __init__(self, engine: Any, commands: Any, replies: Any, parent_pid: int | None = None,
                 poll_ms: int = 200) -> None:
        import zmq

        self.engine = engine
        self.commands = commands
        self.replies = replies
        self.parent_pid = parent_pid
        self.poll_ms = poll_ms
        self.encoder = make_encoder()
        self.decoder = command_decoder()
        self.poller = zmq.Poller()
        self.poller.register(commands, zmq.POLLIN)
        self._fatal: BaseException | None = None
        self._zmq = zmq

    def on_dead(self, error: BaseException) -> None:
        """The executor's health monitor (another thread): the loop raises at its next turn."""
        self._fatal = error

    def send(self, message: Any) -> None:
        self.replies.send(self.encoder.encode(message), copy=False)

    def run(self) -> None:
        """Until `Shutdown` (returns) or the API process is gone (returns); raises what kills
        the loop (the caller reports it with `Dead`)."""
        engine = self.engine
        zmq = self._zmq
        last_parent_check = time.monotonic()
        while True:
            busy = engine.has_unfinished_requests()
            if self.poller.poll(0 if busy else self.poll_ms):
                while True:
                    try:
                        frame = self.commands.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if not self._handle(self.decoder.decode(frame.buffer)):
                        return
            if self._fatal is not None:
                raise self._fatal
            now = time.monotonic()
            if now - last_parent_check > self.poll_ms / 1000:
                last_parent_check = now
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    logger.error("The API process is gone: the engine core stops")
                    return
            if engine.has_unfinished_requests():
                engine.step()
                errors = engine.pop_request_errors()
                self.send(StepOutputs(engine.output_processor.take(),
                                      {rid: _as_sendable_error(e) for rid, e in errors.items()},
                                      engine.stats()))

    def _handle(self, commands: list[Any]) -> bool:
        """Apply a batch of commands; False on Shutdown."""
        engine = self.engine
        failed: dict[str, Any] = {}
        freed = False
        for command in commands:
            if isinstance(command, AddRequest):
                try:
                    engine.add_prepared(_prepared(command))
                except Exception as exc:  # noqa: BLE001 - that request fails, the core goes on
                    logger.exception("adding request %s failed", command.request_id)
                    engine.abort_request(command.request_id)
                    failed[command.request_id] = _as_sendable_error(exc)
            elif isinstance(command, Abort):
                engine.abort_request(command.request_ids)
                freed = True
            elif isinstance(command, FinishSequences):
                from vllm.engine.request import RequestStatus

                known = engine.output_processor.finish_sequences(command.internal_ids)
                engine.scheduler.finish_requests(known, RequestStatus.FINISHED_STOPPED)
                freed = True
            elif isinstance(command, UtilityCall):
                try:
                    result = getattr(engine, command.method)()
                    self.send(UtilityResult(command.call_id, result=result))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    self.send(UtilityResult(command.call_id, error=_as_sendable_error(exc)))
            elif isinstance(command, Shutdown):
                return False
        if failed or (freed and not engine.has_unfinished_requests()):
            # Idle now, so no step will send fresh stats: send them (freed blocks show).
            self.send(StepOutputs([], failed, engine.stats()))
        return True


def _prepared(command: AddRequest) -> Any:
    from vllm.engine.llm_engine import PreparedRequest

    return PreparedRequest(command.request_id, None, command.prompt_token_ids, command.params,
                           command.internal_ids, command.child_params or [command.params],
                           command.max_tokens, command.arrival_time)


def run_engine_core(engine_args: Any, command_addr: str, reply_addr: str,
                    parent_pid: int) -> None:
    """The engine-core process's main: build the engine, say `Ready`, run the loop. Exits 0
    after `Shutdown`, 1 when the engine died (after sending `Dead`)."""
    import zmq

    # Ctrl+C reaches the whole process group: the API process drains, then stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.current_thread().name = "vllm-engine-core"
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(command_addr)
    replies = ctx.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, 5000)
    replies.connect(reply_addr)
    encoder = make_encoder()
    engine = None
    code = 0
    try:
        try:
            from vllm.engine.llm_engine import LLMEngine

            engine = LLMEngine.from_engine_args(engine_args,
                                                output_processor_class=CoreOutputProcessor)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the API process
            replies.send(encoder.encode(StartFailed(_as_sendable_error(exc),
                                                    traceback.format_exc())))
            code = 1
            return
        core = EngineCore(engine, commands, replies, parent_pid)
        monitor = getattr(engine, "start_health_monitor", None)
        if callable(monitor):
            monitor(core.on_dead)
        core.send(Ready(pickled(engine.vllm_config), engine.startup_seconds,
                        engine.startup_phases, pickled(engine.startup_report), engine.stats(),
                        os.getpid()))
        try:
            core.run()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            logger.exception("The engine core loop died")
            core.send(Dead(f"{type(exc).__name__}: {exc}"))
            code = 1
    finally:
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                logger.exception("engine shutdown raised")
        commands.close(linger=0)
        replies.close()
        ctx.term()
        try:  # what the interpreter's exit would release (e.g. tqdm's multiprocessing lock)
            from multiprocessing import util

            util._run_finalizers()
        except Exception:  # noqa: BLE001
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # (a thread the engine left behind must not keep the process alive)
