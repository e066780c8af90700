"""What `vllm chat` and `vllm complete` share: a small streaming client of a running
OpenAI-compatible server (`vllm serve`), as upstream's commands of the same names."""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from typing import Any

DEFAULT_URL = "http://localhost:8000/v1"


def add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL,
                        help="The server's OpenAI API base URL. Default: %(default)s.")
    parser.add_argument("--model-name", default=None,
                        help="Model to ask for (default: the first one /v1/models lists).")
    parser.add_argument("--api-key", default=None,
                        help="Bearer token (default: OPENAI_API_KEY, else none).")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="Output tokens per reply (default: the server's).")


class Client:
    """Streams from `<url>/completions` or `<url>/chat/completions`; every failure is a
    ValueError naming the URL (the CLI prints it as one line)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import httpx

        self.url = args.url.rstrip("/")
        key = args.api_key or os.environ.get("OPENAI_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(timeout=httpx.Timeout(None, connect=10.0))
        self.max_tokens = args.max_tokens
        self.model = args.model_name or self._first_model()

    def _request_error(self, exc: Exception) -> ValueError:
        return ValueError(f"cannot reach the server at {self.url}: {exc}")

    def _first_model(self) -> str:
        import httpx

        try:
            resp = self.http.get(f"{self.url}/models", headers=self.headers)
        except httpx.HTTPError as exc:
            raise self._request_error(exc) from None
        _check(resp, self.url)
        models = resp.json().get("data") or []
        if not models:
            raise ValueError(f"the server at {self.url} lists no models")
        return models[0]["id"]

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The server-sent chunks of one streamed request."""
        import httpx

        body = {"model": self.model, "stream": True, **body}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        try:
            with self.http.stream("POST", f"{self.url}/{path}", json=body,
                                  headers=self.headers) as resp:
                if resp.status_code != 200:
                    resp.read()
                    _check(resp, self.url)
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        return
                    yield json.loads(data)
        except httpx.HTTPError as exc:
            raise self._request_error(exc) from None


def _check(resp: Any, url: str) -> None:
    if resp.status_code == 200:
        return
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = resp.text[:200]
    raise ValueError(f"the server at {url} answered {resp.status_code}: {message}")


def read_inputs(prompt: str) -> Iterator[str]:
    """Lines typed by the user until EOF (Ctrl-D) or Ctrl-C."""
    while True:
        try:
            yield input(prompt)
        except (EOFError, KeyboardInterrupt):
            print()
            return
