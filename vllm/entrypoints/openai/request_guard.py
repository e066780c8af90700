"""The OpenAI server's front door: plain ASGI middlewares that run before any route.

`RootPathMiddleware` (--root-path) marks a prefixed request's prefix in scope["root_path"]
and leaves its path whole, so that Starlette's router strips the prefix exactly once and the
guard sees the same route path the router will serve (`starlette`'s `get_route_path`).

`RequestGuard`, in order: 503 while draining (except /metrics); with an API key, 401 for
every route path but the exempt ones (/health, /ping, and /metrics unless
--require-api-key-for-metrics): authentication is deny-by-default, so no spelling of a path
can skip it; for requests with a body: 415 for a declared Content-Type other than JSON (a
browser's text/plain or form post is how cross-site requests avoid CORS), 413 for a body
over --max-request-body-mb, 408 for a body that does not arrive within
REQUEST_BODY_TIMEOUT_S. The body is read here and replayed to the route, so the route and
disconnect checks see an ordinary request.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any

try:  # the router's own rule (a private module: it may move)
    from starlette._utils import get_route_path
except ImportError:  # pragma: no cover - older or newer Starlette
    def get_route_path(scope: dict) -> str:
        """The path without scope["root_path"] when it starts with it (as the router)."""
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root) and (len(path) == len(root)
                                               or path[len(root)] == "/"):
            return path[len(root):]
        return path

from vllm.entrypoints.openai.protocol import error_body

__all__ = ["REQUEST_BODY_TIMEOUT_S", "RequestGuard", "RootPathMiddleware"]

REQUEST_BODY_TIMEOUT_S = 30.0
"""Seconds a client has to send a whole request body (a slow trickle holds a connection)."""

_OPEN_PATHS = frozenset({"/health", "/ping"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class RootPathMiddleware:
    """--root-path: a request under the prefix (`/x/v1/models`) is served as `/v1/models`;
    unprefixed requests (a proxy that strips the prefix) pass as they are."""

    def __init__(self, app: Any, root_path: str) -> None:
        self.app = app
        self.root_path = root_path.rstrip("/")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and self.root_path and (
                path == self.root_path or path.startswith(self.root_path + "/")):
            scope = dict(scope, root_path=self.root_path)
        await self.app(scope, receive, send)


class RequestGuard:
    """See the module docstring. `state` has `draining` and `api_key` (read per request)."""

    def __init__(self, app: Any, state: Any, max_request_body_mb: float = 32.0,
                 require_api_key_for_metrics: bool = False) -> None:
        self.app = app
        self.state = state
        self.max_body = int(max_request_body_mb * 1024 * 1024)
        self.open_paths = _OPEN_PATHS if require_api_key_for_metrics \
            else _OPEN_PATHS | {"/metrics"}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = get_route_path(scope)
        state = self.state
        if state.draining and route != "/metrics":
            await send_json(send, 503, error_body("the server is shutting down", 503))
            return
        headers = dict(scope.get("headers") or [])
        if state.api_key and route not in self.open_paths and not self._authorized(headers):
            await send_json(send, 401, error_body(
                "invalid or missing API key: send `Authorization: Bearer <key>`", 401),
                [(b"www-authenticate", b"Bearer")])
            return
        if scope.get("method") in _BODY_METHODS:
            receive = await self._read_body(headers, receive, send)
            if receive is None:
                return
        await self.app(scope, receive, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        given = headers.get(b"authorization", b"")
        expected = f"Bearer {self.state.api_key}".encode()
        return hmac.compare_digest(given, expected)

    async def _read_body(self, headers: dict[bytes, bytes], receive: Any, send: Any) -> Any:
        """The whole body, checked; returns a `receive` that replays it, or None once an
        error response was sent (or the client left)."""
        media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if media and media != b"application/json" and not (
                media.startswith(b"application/") and media.endswith(b"+json")):
            await send_json(send, 415, error_body(
                f"Content-Type must be application/json, got {media.decode('latin-1')!r}",
                415))
            return None
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await send_json(send, 413, self._too_large(int(declared)))
            return None
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + REQUEST_BODY_TIMEOUT_S
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                await send_json(send, 408, error_body(
                    f"the request body did not arrive within {REQUEST_BODY_TIMEOUT_S:g} s",
                    408))
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await send_json(send, 413, self._too_large(size))
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # (after the body: the disconnect, when it comes)

        return replay

    def _too_large(self, size: int) -> dict:
        return error_body(f"the request body ({size} bytes or more) is larger than the "
                          f"server's limit of {self.max_body} bytes (--max-request-body-mb)",
                          413)


async def send_json(send: Any, status: int, body: dict,
                    extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A whole JSON response on a raw ASGI `send` (closing the connection after errors
    sent before the body was read, so a client still sending cannot desync it)."""
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode())]
    if status in (408, 413):
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status,
                "headers": headers + list(extra_headers or [])})
    await send({"type": "http.response.body", "body": data})
