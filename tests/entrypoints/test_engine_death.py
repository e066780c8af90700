"""Servers over an engine that fails one request (the others and the server go on) or dies
(the in-flight requests get errors, the server stops and exits 1); the /generate server's
field checks. Fast cases over the fake engine; the real `vllm serve` / api_server processes
whose tensor-parallel worker is killed are slow."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine
from server_utils import RemoteServer, free_port, serve_in_thread, spawned_children

from vllm.engine.async_llm import AsyncLLM
from vllm.entrypoints import api_server as simple
from vllm.entrypoints.openai.api_server import _uvicorn_server_class, build_app

MODEL = "fake"


class FailingFakeEngine(FakeEngine):
    """Fails, as LLMEngine does, each request whose prompt contains "POISON" at its first step
    (final output with finish_reason "error", its exception from pop_request_errors())."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._errors: dict[str, BaseException] = {}

    def step(self) -> list:
        failed = []
        for r in [r for r in self.waiting + self.running
                  if "POISON" in self.tokenizer.decode(r.ids)]:
            self.abort_request(r.rid)
            for s in r.seqs:
                s.finish_reason = s.finish_reason or "error"
            failed.append(self._output(r))
            self._errors[r.rid] = ValueError("Overflow when unpacking long long")
        return failed + super().step()

    def pop_request_errors(self) -> dict[str, BaseException]:
        errors, self._errors = self._errors, {}
        return errors


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout} s")
        time.sleep(0.05)


@contextlib.contextmanager
def graceful_in_thread(app: Any) -> Iterator[tuple[str, Any, threading.Thread]]:
    """`app` under the servers' own uvicorn class (GracefulServer) in a thread: yields the
    URL, the server and its thread (which ends when the server stops by itself)."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=5)
    server = _uvicorn_server_class()(config, app.state.server, 5.0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), 20, "started")
    try:
        yield f"http://127.0.0.1:{port}", server, thread
    finally:
        server.should_exit = True
        thread.join(10)


# ---- one request fails: the others and the server go on ------------------------------------
@pytest.fixture(scope="module")
def failing():
    fake = FailingFakeEngine(step_delay=0.002)
    engine = AsyncLLM(fake)
    yield fake, engine
    engine.shutdown()


def test_openai_server_answers_a_failed_request_with_500_and_serves_on(failing):
    _, engine = failing
    with serve_in_thread(build_app(engine, [MODEL])) as base:
        good = {"model": MODEL, "prompt": "abc", "max_tokens": 5, "ignore_eos": True,
                "temperature": 0}
        bad = dict(good, prompt="POISON abc")
        resp = httpx.post(base + "/v1/completions", json=bad, timeout=30)
        assert resp.status_code == 500
        error = resp.json()["error"]
        assert error["code"] == 500 and "Overflow" in error["message"]
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=30, json={
                "model": MODEL, "stream": True, "max_tokens": 5,
                "messages": [{"role": "user", "content": "POISON"}]}) as stream:
            assert stream.status_code == 200
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == 500
        resp = httpx.post(base + "/v1/completions", json=good, timeout=30)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "defgh"
        assert httpx.get(base + "/health", timeout=10).status_code == 200
    assert not engine.errored and engine.num_in_flight == 0


def test_generate_server_answers_a_failed_request_with_500(failing):
    _, engine = failing
    with serve_in_thread(simple.build_app(engine)) as base:
        body = {"prompt": "POISON", "max_tokens": 5}
        resp = httpx.post(base + "/generate", json=body, timeout=30)
        assert resp.status_code == 500 and "Overflow" in resp.json()["error"]["message"]
        resp = httpx.post(base + "/generate", json=dict(body, stream=True), timeout=30)
        items = [json.loads(x) for x in resp.content.decode().split("\0") if x]
        assert items[-1]["error"]["code"] == 500
        resp = httpx.post(base + "/generate", json={"prompt": "abc", "max_tokens": 3,
                                                    "temperature": 0}, timeout=30)
        assert resp.status_code == 200 and resp.json() == {"text": ["abcdef"]}
    assert not engine.errored


# ---- the engine dies: errors for the in-flight requests, the server stops, exit 1 -----------
@pytest.mark.parametrize("which", ["openai", "generate"])
def test_server_stops_by_itself_when_the_engine_dies(which):
    # (a request that would run for 20 s: it is still running when the engine dies)
    fake = FakeEngine(max_model_len=8192, num_blocks=8192, step_delay=0.005)
    engine = AsyncLLM(fake)
    app = build_app(engine, [MODEL]) if which == "openai" else simple.build_app(engine)
    body = {"prompt": "abc", "max_tokens": 4000, "ignore_eos": True}
    path, body = (("/v1/completions", dict(body, model=MODEL)) if which == "openai" else
                  ("/generate", body))
    try:
        with graceful_in_thread(app) as (base, server, thread):
            async def in_flight() -> httpx.Response:
                async with httpx.AsyncClient(timeout=30) as client:
                    return await client.post(base + path, json=body)

            async def main() -> httpx.Response:
                task = asyncio.create_task(in_flight())
                await asyncio.to_thread(wait_until, lambda: fake.num_steps > 3, 20, "running")
                fake.fail_next_step = True
                return await task

            resp = asyncio.run(asyncio.wait_for(main(), 60))
            assert resp.status_code == 500 and resp.json()["error"]["code"] == 500
            thread.join(30)  # no signal, no request: it stops by itself
            assert not thread.is_alive()
            assert server.engine_failed
    finally:
        engine.shutdown()


# ---- /generate: fields checked at the door ---------------------------------------------------
@pytest.fixture(scope="module")
def generate_url():
    engine = AsyncLLM(FakeEngine(step_delay=0.001))
    with serve_in_thread(simple.build_app(engine)) as base:
        yield base
    engine.shutdown()


@pytest.mark.parametrize(("field", "value", "says"), [
    ("n", 129, "between 1 and 128"),
    ("n", 0, "between 1 and 128"),
    ("n", "2", "must be an integer"),
    ("top_k", 9223372036854775808, "between"),
    ("seed", -(2**63) - 1, "between"),
    ("max_tokens", 2**64, "between"),
    ("temperature", "hot", "finite number"),
    ("bogus", 1, "unknown field"),
])
def test_generate_refuses_bad_fields(generate_url, field, value, says):
    resp = httpx.post(generate_url + "/generate", json={"prompt": "a", field: value},
                      timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and says in error["message"]


def test_generate_accepts_n_at_the_cap(generate_url):
    resp = httpx.post(generate_url + "/generate", timeout=30,
                      json={"prompt": "a", "n": 128, "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200 and len(resp.json()["text"]) == 128


# ---- real server processes (slow): a TP worker killed while idle -> exit 1 ------------------


def _worker_pids(pid: int) -> list[int]:
    """The server's spawned tensor-parallel workers: its spawned children, or, when the
    engine runs in an engine-core process (VLLM_ENABLE_MULTIPROCESSING=1), that process's."""
    spawned = spawned_children(pid)
    if len(spawned) == 1 and spawned_children(spawned[0]):
        return spawned_children(spawned[0])
    return spawned


@pytest.mark.slow
@pytest.mark.parametrize("module, args", [
    ("vllm.entrypoints.cli.main", ["serve", "demo"]),
    ("vllm.entrypoints.api_server", ["--model", "demo"]),
], ids=["vllm-serve", "api_server"])
def test_server_process_exits_1_when_a_tp_worker_dies(module, args, tmp_path):
    server = RemoteServer(module, [*args, "-O0", "--tensor-parallel-size", "2",
                                   "--max-model-len", "128", "--kv-cache-memory", "16MiB"],
                          log_dir=str(tmp_path))
    try:
        [worker] = _worker_pids(server.proc.pid)
        os.kill(worker, signal.SIGKILL)
        # A supervisor sees it at once: the process exits non-zero, /health need not be polled.
        returncode = server.proc.wait(timeout=60)
        log = server.log()
        assert returncode == 1, log
        assert f"pid {worker}" in log and "rank 1" in log and "exit code 1" in log
    finally:
        server.stop()
