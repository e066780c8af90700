"""The server's front door and its tokenizer thread, over a fake engine (fast). The same
requests run against a real `vllm serve` in test_hostile_inputs.py."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from fake_engine import FakeEngine
from server_utils import serve_in_thread

from vllm.engine.async_llm import AsyncLLM
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.frontend_options import FrontendOptions
from vllm.entrypoints.openai.protocol import OpenAIError, decode_json_body
from vllm.entrypoints.openai.tokenizer_worker import JobTimeout, TokenizerWorker

MODEL = "fake"
KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine():
    llm = AsyncLLM(FakeEngine(max_model_len=128, num_blocks=256, step_delay=0.001))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    options = FrontendOptions(root_path="/proxy", max_request_body_mb=0.1,
                              max_prompts_per_request=4)
    with serve_in_thread(build_app(engine, [MODEL], api_key=KEY, options=options)) as base:
        yield base


@pytest.mark.parametrize("path", [
    "/proxy/proxy/v1/completions", "/proxy/v1/completions", "/v1/completions",
    "/proxy//v1/completions", "/proxy/tokenize", "/tokenize", "/version", "/proxy/version",
    "/unknown", "/proxy",
])
def test_only_health_ping_metrics_skip_the_key(url, path):
    r = httpx.post(url + path, json={"prompt": "hi", "max_tokens": 1}, timeout=30)
    assert r.status_code == 401, (path, r.status_code, r.text)
    assert r.json()["error"]["code"] == 401
    for open_path in ("/health", "/ping", "/metrics", "/proxy/health"):
        assert httpx.get(url + open_path, timeout=30).status_code == 200


def test_the_prefix_is_stripped_once(url):
    assert httpx.get(url + "/proxy/v1/models", headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(url + "/v1/models", headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(url + "/proxy/proxy/v1/models", headers=AUTH,
                     timeout=30).status_code == 404


def test_metrics_can_require_the_key(engine):
    options = FrontendOptions(require_api_key_for_metrics=True)
    with serve_in_thread(build_app(engine, [MODEL], api_key=KEY, options=options)) as base:
        assert httpx.get(base + "/metrics", timeout=30).status_code == 401
        assert httpx.get(base + "/metrics", headers=AUTH, timeout=30).status_code == 200
        assert httpx.get(base + "/health", timeout=30).status_code == 200


def test_body_limit_and_content_type(url):
    big = json.dumps({"model": MODEL, "prompt": "a" * 200_000})
    r = httpx.post(url + "/v1/completions", content=big, timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    chunked = httpx.post(url + "/v1/completions", timeout=30,
                         headers={**AUTH, "Content-Type": "application/json"},
                         content=iter([b'{"prompt": "', b"a" * 200_000, b'"}']))
    assert chunked.status_code == 413
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
    for media in ("text/plain", "application/x-www-form-urlencoded"):
        r = httpx.post(url + "/v1/completions", content=body, timeout=30,
                       headers={**AUTH, "Content-Type": media})
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    for media in ("application/json; charset=utf-8", "application/vnd.api+json", None):
        headers = dict(AUTH) if media is None else {**AUTH, "Content-Type": media}
        r = httpx.post(url + "/v1/completions", content=body, timeout=30, headers=headers)
        assert r.status_code == 200, (media, r.text)


def test_prompt_count_cap(url):
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=30,
                   json={"model": MODEL, "prompt": ["a"] * 5, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "--max-prompts-per-request" in r.json()["error"]["message"]


def test_prompt_longer_than_any_fit_is_refused_by_length(url):
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=30,
                   json={"model": MODEL, "prompt": "word " * 8000, "max_tokens": 1})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]


def test_credentials_with_a_wildcard_origin_are_refused():
    with pytest.raises(ValueError, match="--allow-credentials"):
        FrontendOptions(allow_credentials=True)
    FrontendOptions(allow_credentials=True, allowed_origins=["https://ui.example"])


@pytest.mark.parametrize("raw,needle", [
    (b'{"a": NaN}', "NaN"), (b'{"a": -Infinity}', "Infinity"), (b'{"a": 1e400}', "1e400"),
    (b"[" * 100 + b"]" * 100, "nested"), (b"[" * 50_000 + b"]" * 50_000, "nested"),
    (b'{"a": ' + b"7" * 5000 + b"}", "digits"), (b'{"a": ["\\ud800"]}', "a[0]"),
    (b'{"\\udc00": 1}', "key"), (b"\xff", "Invalid JSON"),
])
def test_strict_json(raw, needle):
    with pytest.raises(OpenAIError) as info:
        decode_json_body(raw)
    assert info.value.status == 400 and needle in info.value.message


def test_strict_json_keeps_ordinary_bodies():
    body = {"prompt": ["é", "😀", ""], "n": 2, "x": {"y": [[1.5, -2]]}, "t": 1e308}
    assert decode_json_body(json.dumps(body).encode()) == body


def test_tokenizer_worker_interrupts_a_runaway_job_and_goes_on():
    worker = TokenizerWorker(name="test-tokenizer")
    ran_on: list[str] = []

    def spin():
        ran_on.append(threading.current_thread().name)
        while True:
            time.sleep(0)

    async def main():
        with pytest.raises(JobTimeout):
            await worker.run(spin, 0.2)
        assert await worker.run(lambda: 6 * 7, 5) == 42
        with pytest.raises(ZeroDivisionError):
            await worker.run(lambda: 1 / 0, 5)
        # many short jobs, each far under its limit, all answered in order
        results = await asyncio.gather(*(worker.run(lambda i=i: i, 5) for i in range(100)))
        assert results == list(range(100))

    try:
        asyncio.run(main())
    finally:
        worker.close()
    assert ran_on == ["test-tokenizer"]


def test_a_non_finite_logit_bias_is_refused_not_clamped():
    from vllm.entrypoints.openai.protocol import CompletionRequest

    request = CompletionRequest(prompt="x", logit_bias={"5": float("nan")})
    with pytest.raises(OpenAIError, match="logit_bias values must be finite") as info:
        request.sampling_kwargs()
    assert info.value.param == "logit_bias"
    request = CompletionRequest(prompt="x", logit_bias={"5": 1e9})
    assert request.sampling_kwargs()["logit_bias"] == {"5": 100.0}


class _RecordingEngine(FakeEngine):
    """Records the order of add_request and step calls (engine thread only)."""

    def __init__(self) -> None:
        super().__init__(max_model_len=128, num_blocks=4096, step_delay=0.005)
        self.events: list[str] = []

    def add_request(self, request_id, prompt, sampling_params) -> None:
        self.events.append("add")
        super().add_request(request_id, prompt, sampling_params)

    def step(self):
        self.events.append("step")
        return super().step()


def test_a_batch_of_prompts_is_added_between_two_steps_not_one_per_step():
    fake = _RecordingEngine()
    engine = AsyncLLM(fake)
    try:
        options = FrontendOptions(max_prompts_per_request=64)
        with serve_in_thread(build_app(engine, [MODEL], options=options)) as base:
            # a request that keeps the engine stepping meanwhile
            with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
                    "model": MODEL, "prompt": "busy", "max_tokens": 100, "ignore_eos": True,
                    "stream": True}) as busy:
                next(busy.iter_lines())
                fake.events.clear()
                r = httpx.post(base + "/v1/completions", timeout=60, json={
                    "model": MODEL, "prompt": [f"p{i}" for i in range(64)], "max_tokens": 2})
                assert r.status_code == 200 and len(r.json()["choices"]) == 64
    finally:
        engine.shutdown()
    adds = [i for i, e in enumerate(fake.events) if e == "add"]
    assert len(adds) == 64
    assert "step" not in fake.events[adds[0]:adds[-1]]  # all taken in one engine iteration
