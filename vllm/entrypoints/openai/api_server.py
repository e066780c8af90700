"""The OpenAI-compatible HTTP server behind `vllm serve`.

Routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/v1/responses` (JSON or
server-sent events), `/tokenize`, `/detokenize` (vLLM's), `/health`, `/version`, `/metrics`
(Prometheus text). With an API key (`--api-key` or VLLM_API_KEY) every route but /health,
/ping and /metrics needs `Authorization: Bearer <key>`; body size, content type and the URL
prefix are checked before any route runs (request_guard.py).

Life cycle: the engine is built (model loaded, compiled) before the socket is bound, so
`/health` answers 200 only once the server can generate. SIGTERM (or Ctrl+C) starts a
graceful shutdown: new requests get 503, running ones may finish for `--shutdown-timeout`
seconds, the rest are aborted (their streams end with finish_reason "abort"), then the process
exits 0. A second signal exits at once.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request

from vllm.engine.async_llm import AsyncLLM, multiprocessing_requested
from vllm.entrypoints.openai.frontend_options import FrontendOptions
from vllm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    ResponsesRequest,
    TokenizeRequest,
    decode_json_body,
    error_body,
    parse_request,
)
from vllm.entrypoints.openai.request_guard import RequestGuard, RootPathMiddleware
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import ClientDisconnected
from vllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from vllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from vllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
from vllm.logger import init_logger
from vllm.version import __version__

logger = init_logger(__name__)

__all__ = ["build_app", "run_server", "ServerState"]


class ServerState:
    """What the routes share."""

    def __init__(self, engine: AsyncLLM, served_model_names: Sequence[str],
                 api_key: str | None, metrics: ServerMetrics | None,
                 options: FrontendOptions | None = None) -> None:
        options = options or FrontendOptions()
        self.options = options
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.api_key = api_key
        self.metrics = metrics or ServerMetrics(self.served_model_names[0])
        if engine.stat_observer is None:
            engine.stat_observer = self.metrics
        self.draining = False
        self.created = int(time.time())
        mc = engine.model_config
        self.max_model_len = int(mc.max_model_len)
        # The engine thread detokenizes with engine.tokenizer while requests are tokenized
        # here; a Rust-backed tokenizer must not be used from two threads at once.
        tokenizer = _own_copy(engine.tokenizer)
        # ... and only this one thread uses the copy (off the event loop, time-limited).
        self.tokenizer_worker = TokenizerWorker()
        self.completion = OpenAIServingCompletion(engine, self.served_model_names,
                                                  self.max_model_len, tokenizer, options,
                                                  self.tokenizer_worker)
        self.chat = OpenAIServingChat(engine, self.served_model_names, self.max_model_len,
                                      tokenizer, options, self.tokenizer_worker)
        self.tokenization = OpenAIServingTokenization(self.chat)


def _own_copy(tokenizer: Any) -> Any:
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - fall back to sharing it
        logger.warning("could not copy the tokenizer; the server shares the engine's")
        return tokenizer


def build_app(engine: AsyncLLM, served_model_names: Sequence[str], api_key: str | None = None,
              metrics: ServerMetrics | None = None,
              options: FrontendOptions | None = None) -> Any:
    """The FastAPI app over a running `AsyncLLM` (its state is `app.state.server`)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    state = ServerState(engine, served_model_names, api_key, metrics, options)
    options = state.options
    app = FastAPI(title="vLLM-compatible OpenAI API", version=__version__,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(RequestGuard, state=state,
                       max_request_body_mb=options.max_request_body_mb,
                       require_api_key_for_metrics=options.require_api_key_for_metrics)
    # (added last, so it runs first: a browser's preflight OPTIONS needs no API key)
    app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins,
                       allow_methods=options.allowed_methods,
                       allow_headers=options.allowed_headers,
                       allow_credentials=options.allow_credentials)
    if options.root_path:  # (outermost: the guard and the routes see the path without it)
        app.add_middleware(RootPathMiddleware, root_path=options.root_path)

    class SSEResponse(StreamingResponse):
        """Closes the body iterator however the response ends (a dropped client included),
        so the generator's cleanup aborts the engine requests."""

        def __init__(self, content: AsyncIterator[str]) -> None:
            super().__init__(content, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code),
                            status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 400), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return JSONResponse(error_body(f"internal error: {exc!r}", 500), status_code=500)

    async def read_request(raw: Request, model_cls: type) -> Any:
        # Parsing and validating up to --max-request-body-mb runs off the event loop.
        body = await raw.body()
        return await asyncio.to_thread(lambda: parse_request(model_cls,
                                                             decode_json_body(body)))

    def respond(result: dict | AsyncIterator[str]) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        return SSEResponse(result)

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return JSONResponse(error_body("the engine has stopped", 500), status_code=500)
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics_page() -> Response:
        text = state.metrics.render(engine.get_stats(), engine.startup_phases)
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        # `root` is the served name: the model's local path is no client's business.
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": state.created, "owned_by": "vllm",
             "root": name, "parent": None, "max_model_len": state.max_model_len,
             "permission": []} for name in state.served_model_names]})

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        request = await read_request(raw, CompletionRequest)
        try:
            return respond(await state.completion.create_completion(request, raw))
        except ClientDisconnected:
            return Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        request = await read_request(raw, ChatCompletionRequest)
        try:
            return respond(await state.chat.create_chat_completion(request, raw))
        except ClientDisconnected:
            return Response(status_code=499)

    responses = OpenAIServingResponses.sharing(state.chat)

    @app.post("/v1/responses")
    async def create_response(raw: Request) -> Response:
        request = await read_request(raw, ResponsesRequest)
        try:
            return respond(await responses.create_response(request, raw))
        except ClientDisconnected:
            return Response(status_code=499)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> JSONResponse:
        request = await read_request(raw, TokenizeRequest)
        return JSONResponse(await state.tokenization.tokenize(request))

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> JSONResponse:
        request = await read_request(raw, DetokenizeRequest)
        return JSONResponse(await state.tokenization.detokenize(request))

    return app


# ---- running it --------------------------------------------------------------------------
def _uvicorn_server_class() -> type:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn with our signal handling: drain, then exit 0 (uvicorn alone would re-raise
        the signal after its own shutdown, and would stop answering at once). A second
        SIGTERM/SIGINT aborts the running requests and exits 0 without the drain's wait; a
        third exits at once.

        When the engine dies (`state.engine.errored`) the server stops by itself:
        `engine_failed` turns True (the caller then exits 1, so a supervisor restarts it);
        the engine has already failed the running requests, which get their error
        response while uvicorn closes (its graceful-shutdown timeout)."""

        def __init__(self, config: Any, state: ServerState, shutdown_timeout: float) -> None:
            super().__init__(config)
            self.state = state
            self.shutdown_timeout = shutdown_timeout
            self.engine_failed = False
            self._loop: asyncio.AbstractEventLoop | None = None
            self._drain_task: asyncio.Task | None = None
            self._signals = 0

        async def on_tick(self, counter: int) -> bool:
            # (uvicorn calls this every 0.1 s while serving)
            engine = self.state.engine
            if not self.engine_failed and engine.errored:
                self.engine_failed = True
                logger.error("The engine died (%s): stopping the server, exit code 1",
                             getattr(engine, "dead_error", None) or "engine errored")
                self.should_exit = True
            return await super().on_tick(counter)

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            self._loop = asyncio.get_running_loop()
            signals = (signal.SIGINT, signal.SIGTERM)
            originals = {sig: signal.signal(sig, self._on_signal) for sig in signals}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

        def _on_signal(self, sig: int, frame: Any) -> None:
            name = signal.Signals(sig).name
            assert self._loop is not None
            self._signals += 1
            if self._signals == 1:
                self.state.draining = True
                self._loop.call_soon_threadsafe(self._start_drain, name)
            elif self._signals == 2:  # stop waiting: abort what runs, then exit
                with contextlib.suppress(RuntimeError):  # (the loop already closed)
                    self._loop.call_soon_threadsafe(self._start_abort, name)
            else:  # (the abort itself hangs) exit now; tasks still running are cut
                logger.warning("%s again: exiting at once", name)
                self.force_exit = True
                self.should_exit = True

        def _start_drain(self, name: str) -> None:
            self._drain_task = asyncio.ensure_future(self._drain(name))

        def _start_abort(self, name: str) -> None:
            # (uvicorn's force_exit would leave the request and lifespan tasks to be
            # cancelled with the loop, each logging a traceback; aborted, the streams end
            # and uvicorn closes as after a drain)
            if self._drain_task is not None:
                self._drain_task.cancel()
            self._drain_task = asyncio.ensure_future(self._abort_all(name))

        async def _abort_all(self, name: str) -> None:
            try:
                ids = self.state.engine.in_flight_ids()
                logger.warning("second %s: aborting %d running request(s) and exiting", name,
                               len(ids))
                await self.state.engine.abort(ids)
                await asyncio.sleep(0.2)  # let the aborted streams send their last chunk
            except Exception as exc:  # (a dead engine) exit all the same
                logger.warning("aborting the running requests failed: %s", exc)
            finally:
                self.should_exit = True

        async def _drain(self, name: str) -> None:
            engine = self.state.engine
            n = engine.num_in_flight
            logger.info("%s received: refusing new requests; waiting up to %.1f s for %d "
                        "running request(s)", name, self.shutdown_timeout, n)
            if not await engine.wait_for_idle(self.shutdown_timeout):
                ids = engine.in_flight_ids()
                logger.warning("shutdown timeout: aborting %d request(s)", len(ids))
                await engine.abort(ids)
                await asyncio.sleep(0.2)  # let the aborted streams send their last chunk
            self.should_exit = True

    return GracefulServer


def bind_socket(host: str, port: int) -> socket.socket:
    """Reserve host:port before the (slow) engine start, so a taken port fails at once.
    It listens only once uvicorn serves, so /health is refused until the model is ready.
    Raises ValueError naming the address."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise ValueError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def run_server(args: argparse.Namespace) -> int:
    """Build the engine from the parsed flags (EngineArgs' plus those of
    `vllm.entrypoints.openai.cli_args.make_arg_parser`), serve until SIGTERM/SIGINT, return 0;
    return 1 when the engine dies (the server stops at once: a supervisor should restart
    it) or uvicorn could not start. Raises ValueError for flags that cannot be resolved (the
    CLI prints them)."""

    from vllm import envs
    from vllm.engine.arg_utils import EngineArgs

    names = list(args.served_model_name or [args.model])  # (nargs="+": a list)
    served = names[0]
    api_key = args.api_key or envs.VLLM_API_KEY
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    options = FrontendOptions.from_cli_args(args)
    if args.disable_log_requests:
        logger.warning("--disable-log-requests is deprecated: requests are logged only with "
                       "--enable-log-requests")
    logger.info("vLLM-compatible API server %s; model %s", __version__, args.model)
    sock = bind_socket(args.host, args.port)
    metrics = ServerMetrics(served)
    try:
        engine = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args),
                                           multiprocessing=multiprocessing_requested(),
                                           stat_observer=metrics)
    except BaseException:
        sock.close()
        raise
    try:
        # (the engine logged its start-up phase table when it became ready)
        app = build_app(engine, names, api_key=api_key, metrics=metrics, options=options)
        config = uvicorn_config(app, args)
        server = _uvicorn_server_class()(config, app.state.server, args.shutdown_timeout)
        logger.info("Serving %r on http://%s:%d (API key %s)", served, args.host, args.port,
                    "required" if api_key else "not required")
        logger.info("Try it:\n%s", example_curl(served, args.host, args.port, api_key))
        asyncio.run(server.serve(sockets=[sock]))
        if not server.started:
            return 1
    finally:
        sock.close()
        engine.shutdown()
    if server.engine_failed:
        logger.error("server stopped because the engine died: exit code 1")
        return 1
    logger.info("server stopped")
    return 0


def uvicorn_config(app: Any, args: argparse.Namespace) -> Any:
    """uvicorn's settings from `vllm serve`'s flags."""
    import uvicorn

    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                          access_log=not args.disable_uvicorn_access_log, timeout_keep_alive=5,
                          timeout_graceful_shutdown=5)


def example_curl(served: str, host: str, port: int, api_key: str | None) -> str:
    """A ready-to-paste curl line for the completions endpoint."""
    auth = " -H 'Authorization: Bearer $VLLM_API_KEY'" if api_key else ""
    body = json.dumps({"model": served, "prompt": "def __init__(self", "max_tokens": 32,
                       "temperature": 0})
    return (f"curl -s http://{host}:{port}/v1/completions -H 'Content-Type: application/json'"
            f"{auth} -d '{body}'")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m vllm.entrypoints.openai.api_server --model M [flags]`: upstream's module
    entry point, the same server and flags as `vllm serve M`."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog="python -m vllm.entrypoints.openai.api_server",
        description="The OpenAI-compatible server (the same as `vllm serve`).")
    make_arg_parser(parser)
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        return run_server(args)
    except ValueError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    import sys

    sys.exit(main())
