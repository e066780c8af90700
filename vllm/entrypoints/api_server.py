"""The simple generate server (upstream's demo API), for quick tests and benchmarks.

    python -m vllm.entrypoints.api_server --model ./m -O0 --host 127.0.0.1 --port 8000

POST /generate with JSON {"prompt": "...", "stream": false, <SamplingParams fields>} answers
{"text": [prompt + completion, ...]} (one entry per `n`); with "stream": true it sends the
same object after every step, each followed by a null byte ("\\0"). GET /health answers 200.
Errors are {"error": {"message", "type", "param", "code"}} with status 400 (a bad field: `param`
names it; `n` is at most 128 as on the OpenAI server) or 500 (the engine failed the request;
in a stream: its last object).
SIGTERM drains as `vllm serve` does (--shutdown-timeout). If the engine dies the server stops
and exits 1, so that a supervisor restarts it.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request

from vllm.engine.async_llm import AsyncLLM, EngineError, multiprocessing_requested
from vllm.entrypoints.openai.protocol import OpenAIError
from vllm.logger import init_logger
from vllm.utils import random_uuid

logger = init_logger(__name__)

_NOT_SAMPLING = ("prompt", "stream")


class _State:
    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.draining = False
        self.api_key: str | None = None


def build_app(engine: AsyncLLM) -> Any:
    """The FastAPI app: /generate and /health over a running AsyncLLM."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    from vllm.entrypoints.openai.request_guard import RequestGuard
    from vllm.sampling_params import SamplingParams

    state = _State(engine)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(RequestGuard, state=state)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> Response:
        status = 500 if engine.errored else 200
        return Response(status_code=status)

    @app.post("/generate")
    async def generate(raw: Request) -> Response:
        try:
            body = json.loads(await raw.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise OpenAIError(f"Invalid JSON in the request body: {exc}") from None
        if not isinstance(body, dict):
            raise OpenAIError("the request body must be a JSON object")
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise OpenAIError("prompt must be a string", param="prompt")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise OpenAIError("stream must be true or false", param="stream")
        kwargs = {k: v for k, v in body.items() if k not in _NOT_SAMPLING}
        check_sampling_fields(kwargs)
        try:
            params = SamplingParams(**kwargs)
        except TypeError as exc:
            raise OpenAIError(f"invalid sampling parameters: {exc}") from None
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            raise OpenAIError(str(exc), param=field if field in kwargs else None) from None
        request_id = f"generate-{random_uuid()}"
        try:
            rstream = await engine.add_request(request_id, prompt, params)
        except (ValueError, TypeError) as exc:
            raise OpenAIError(str(exc)) from None
        except EngineError as exc:
            raise OpenAIError(str(exc), 500) from None

        def texts(output: Any) -> dict:
            return {"text": [prompt + c.text for c in output.outputs]}

        if stream:
            async def chunks() -> AsyncIterator[bytes]:
                try:
                    async for output in rstream:
                        yield (json.dumps(texts(output)) + "\0").encode("utf-8")
                except EngineError as exc:  # the status is sent: the error is the last item
                    yield (json.dumps(OpenAIError(str(exc), 500).body()) + "\0").encode()
                finally:
                    if not rstream.finished:
                        engine.abort_nowait([request_id])

            class _Closing(StreamingResponse):
                async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
                    try:
                        await super().__call__(scope, receive, send)
                    finally:
                        await self.body_iterator.aclose()  # type: ignore[attr-defined]

            return _Closing(chunks(), media_type="application/octet-stream")

        final = None
        waiter = asyncio.ensure_future(_last(rstream))
        try:
            while final is None:
                done, _ = await asyncio.wait({waiter}, timeout=0.25)
                if done:
                    final = waiter.result()
                elif await raw.is_disconnected():
                    return Response(status_code=499)
        except EngineError as exc:
            raise OpenAIError(str(exc), 500) from None
        finally:
            if not waiter.done():
                waiter.cancel()
            if not rstream.finished:
                engine.abort_nowait([request_id])
        return JSONResponse(texts(final))

    return app


# Numeric SamplingParams fields: range-checked here so that a value the engine cannot hold
# (an integer past int64, a float that is not finite) is a 400 naming the field.
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
               "truncate_prompt_tokens")
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                 "top_p", "min_p")
_INT64 = (-(2**63), 2**63 - 1)


def check_sampling_fields(kwargs: dict[str, Any]) -> None:
    """Raise a 400 OpenAIError naming the first field of a /generate body that is not a
    SamplingParams field, or whose value is out of what the engine allows: `n` in
    [1, MAX_N] (the OpenAI server's cap), integers within int64, finite numbers. The value
    rules of each field (top_p in (0, 1] ...) are SamplingParams' own."""
    from vllm.entrypoints.openai.serving_engine import MAX_N
    from vllm.sampling_params import SamplingParams

    known = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    for name in kwargs:
        if name not in known:
            raise OpenAIError(f"unknown field {name!r}: /generate takes prompt, stream and the "
                              f"SamplingParams fields ({', '.join(sorted(known))})", param=name)
    for name in _INT_FIELDS:
        if name not in kwargs or (kwargs[name] is None and name != "n"):
            continue
        value = kwargs[name]
        if not isinstance(value, int) or isinstance(value, bool):
            raise OpenAIError(f"{name} must be an integer, got {value!r}", param=name)
        if not _INT64[0] <= value <= _INT64[1]:
            raise OpenAIError(f"{name} must be between {_INT64[0]} and {_INT64[1]}, got "
                              f"{value}", param=name)
    n = kwargs.get("n", 1)
    if not 1 <= n <= MAX_N:
        raise OpenAIError(f"n must be between 1 and {MAX_N}, got {n}", param="n")
    for name in _FLOAT_FIELDS:
        if name not in kwargs:
            continue
        value = kwargs[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            raise OpenAIError(f"{name} must be a finite number, got {value!r}", param=name)


async def _last(stream: Any) -> Any:
    last = None
    async for output in stream:
        last = output
    return last


def make_parser() -> argparse.ArgumentParser:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m vllm.entrypoints.api_server",
                                    description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--shutdown-timeout", type=float, default=10.0)
    parser.add_argument("--uvicorn-log-level", default="info")
    EngineArgs.add_cli_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.openai.api_server import (
        _uvicorn_server_class,
        bind_socket,
    )

    parser = make_parser()
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        sock = bind_socket(args.host, args.port)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        engine = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args),
                                           multiprocessing=multiprocessing_requested())
    except ValueError as exc:
        sock.close()
        parser.error(str(exc))
    try:
        app = build_app(engine)  # the engine logged its start-up phase table
        config = uvicorn.Config(app, host=args.host, port=args.port,
                                log_level=args.uvicorn_log_level, timeout_keep_alive=5,
                                timeout_graceful_shutdown=5)
        server = _uvicorn_server_class()(config, app.state.server, args.shutdown_timeout)
        asyncio.run(server.serve(sockets=[sock]))
        if not server.started:
            return 1
    finally:
        sock.close()
        engine.shutdown()
    if server.engine_failed:  # (it logged why) a supervisor should restart it
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["build_app", "main", "make_parser"]
