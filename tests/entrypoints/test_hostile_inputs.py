"""Hostile requests against a real `vllm serve demo` process (issue 18).

Each test replays requests an attacker sent (oversized, malformed, unauthenticated, path
tricks, expensive templates) and then checks the server still answers a normal request with
the same text as before: no request may kill the engine, bypass the key or wedge the server.

One server for the module: -O0, the API key from VLLM_API_KEY (not on the command line),
--root-path /proxy, a 1 MiB body limit, request chat templates trusted, and a 2 s tokenizer
time limit.
"""
from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from server_utils import RemoteServer

pytestmark = pytest.mark.slow

KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}
PROMPT = "def __init__(self"
REFERENCE = {"model": "demo", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RemoteServer("vllm.entrypoints.cli.main", [
        "serve", "demo", "-O0", "--max-model-len", "256", "--root-path", "/proxy",
        "--max-request-body-mb", "1", "--trust-request-chat-template",
        "--disable-uvicorn-access-log"],
        env={"VLLM_API_KEY": KEY, "VLLM_TOKENIZE_TIMEOUT_S": "2"},
        log_dir=str(tmp_path_factory.mktemp("logs")))
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def reference_text(server) -> str:
    r = httpx.post(server.url + "/v1/completions", json=REFERENCE, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def post(server, path: str, body, headers=None, timeout: float = 60) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, timeout=timeout,
                      headers={**JSON, **AUTH, **(headers or {})})


def assert_openai_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == status
    if param != "any":
        assert error["param"] == param, error
    return error


def assert_still_serves(server, reference_text: str) -> None:
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    r = httpx.post(server.url + "/v1/completions", json=REFERENCE, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference_text


# ---- 1. numbers that used to kill the engine ------------------------------------------------
@pytest.mark.parametrize("path,field,value", [
    ("/v1/chat/completions", "top_k", 9223372036854775808),
    ("/v1/completions", "top_k", 2**70),
    ("/v1/completions", "seed", -(2**64)),
    ("/v1/completions", "min_tokens", 2**63),
    ("/v1/completions", "stop_token_ids", [2**64]),
    ("/v1/completions", "temperature", 1e300),
    ("/v1/completions", "top_p", -0.0001),
])
def test_out_of_range_numbers_are_400s_naming_the_field(server, reference_text, path, field,
                                                        value):
    body = {"model": "demo", "max_tokens": 4, "temperature": 0.7, field: value}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = PROMPT
    error = assert_openai_error(post(server, path, body), 400)
    assert field in error["message"] or error["param"] == field, error
    assert_still_serves(server, reference_text)


@pytest.mark.parametrize("raw", [
    b'{"model": "demo", "prompt": "x", "temperature": Infinity}',
    b'{"model": "demo", "prompt": "x", "temperature": 1e999}',
    b'{"model": "demo", "prompt": "x", "logit_bias": {"5": NaN}}',
    b'{"model": "demo", "prompt": "x", "logit_bias": {"5": -Infinity}}',
])
def test_non_finite_numbers_are_refused(server, reference_text, raw):
    assert_openai_error(post(server, "/v1/completions", raw), 400)
    assert_still_serves(server, reference_text)


# ---- 2. authentication is decided on the path the router serves ---------------------------
@pytest.mark.parametrize("path", [
    "/proxy/proxy/v1/completions", "/proxy/v1/completions", "/v1/completions",
    "/proxy//v1/completions", "/proxy/proxy/proxy/v1/completions", "/v1/../v1/completions",
    "/proxy/tokenize", "/tokenize", "/detokenize", "/proxy/proxy/tokenize",
])
def test_no_prefix_spelling_skips_the_api_key(server, path):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 2, "tokens": [1, 2]}
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 401, (path, r.status_code, r.text[:200])
    assert r.headers.get("www-authenticate") == "Bearer"


@pytest.mark.parametrize("path", ["/v1/models", "/proxy/v1/models", "/version",
                                  "/proxy/version", "/docs", "/openapi.json", "/nope"])
def test_every_route_but_health_needs_the_key(server, path):
    assert httpx.get(server.url + path, timeout=30).status_code == 401


@pytest.mark.parametrize("path", ["/health", "/ping", "/proxy/health", "/metrics"])
def test_health_ping_and_metrics_are_open(server, path):
    assert httpx.get(server.url + path, timeout=30).status_code == 200


def test_with_the_key_both_spellings_serve(server):
    for path in ("/v1/models", "/proxy/v1/models"):
        r = httpx.get(server.url + path, headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "demo"
    assert httpx.get(server.url + "/proxy/proxy/v1/models", headers=AUTH,
                     timeout=30).status_code == 404


def test_models_do_not_reveal_the_local_path(server):
    entry = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]
    assert entry["root"] == "demo" and "/" not in json.dumps(entry["root"])


# ---- 3. bodies, lengths, templates: cheap refusals, and /health keeps answering -------------
def test_a_body_over_the_limit_is_413_before_parsing(server, reference_text):
    big = json.dumps({"prompt": "a" * (2 * 1024 * 1024)})
    for path in ("/tokenize", "/v1/completions"):
        assert_openai_error(post(server, path, big), 413)
    # with no Content-Length (chunked): counted as it arrives
    r = httpx.post(server.url + "/tokenize", headers={**JSON, **AUTH}, timeout=60,
                   content=iter([b'{"prompt": "', b"a" * (1024 * 1024), b"a" * 1024, b'"}']))
    assert_openai_error(r, 413)
    assert_still_serves(server, reference_text)


def test_a_prompt_too_long_for_the_model_is_refused_without_tokenizing(server):
    huge = "word " * 180_000  # 900 kB: under the body limit, far over 256 tokens
    error = assert_openai_error(post(server, "/v1/completions",
                                     {"model": "demo", "prompt": huge, "max_tokens": 1}),
                                400, "prompt")
    assert "characters" in error["message"]
    assert_openai_error(post(server, "/tokenize", {"model": "demo", "prompt": huge}), 400,
                        "prompt")
    assert_openai_error(post(server, "/v1/chat/completions", {
        "model": "demo", "messages": [{"role": "user", "content": huge}]}), 400, "messages")


def test_truncate_prompt_tokens_still_takes_a_long_prompt(server):
    long = "x = 1\n" * 20_000
    r = post(server, "/v1/completions", {"model": "demo", "prompt": long, "max_tokens": 2,
                                         "truncate_prompt_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 16


def test_a_template_that_renders_megabytes_is_refused(server, reference_text):
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
            "chat_template": '{{ "ab" * 2000000 }}', "max_tokens": 2}
    error = assert_openai_error(post(server, "/v1/chat/completions", body), 400, "messages")
    assert "rendered" in error["message"]
    assert_still_serves(server, reference_text)


def test_a_template_that_never_ends_is_stopped_and_health_answers_meanwhile(server,
                                                                             reference_text):
    spin = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
            "{% endfor %}")
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
            "chat_template": spin, "max_tokens": 2}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(post, server, "/v1/chat/completions", body)
        health = []
        while not slow.done():  # /health answers while the template runs
            health.append(httpx.get(server.url + "/health", timeout=30).status_code)
        error = assert_openai_error(slow.result(), 400)
    assert health and set(health) == {200}
    assert "VLLM_TOKENIZE_TIMEOUT_S" in error["message"]
    assert_still_serves(server, reference_text)


# ---- 4. the batch of prompts is capped -----------------------------------------------------
def test_a_huge_prompt_list_is_refused(server, reference_text):
    error = assert_openai_error(post(server, "/v1/completions", {
        "model": "demo", "prompt": ["a"] * 100_000, "max_tokens": 1}), 400, "prompt")
    assert "--max-prompts-per-request" in error["message"]
    assert_still_serves(server, reference_text)


# ---- 5. sizes that made one request slow everyone -----------------------------------------
@pytest.mark.parametrize("field,value", [
    ("stop", [f"s{i}" for i in range(60_000)]),  # (what fits the 1 MiB body limit)
    ("bad_words", [f"word{i}" for i in range(20_000)]),
    ("stop", ["s" * 100_000]),
])
def test_oversized_stop_and_bad_words_lists_are_refused(server, reference_text, field, value):
    error = assert_openai_error(post(server, "/v1/completions", {
        "model": "demo", "prompt": PROMPT, "max_tokens": 2, "n": 128, field: value}), 400)
    assert field in error["message"]
    assert_still_serves(server, reference_text)


# ---- 6. malformed inputs are 400s, never 500s ----------------------------------------------
MALFORMED = [
    ("/v1/completions", b"[" * 5000 + b"]" * 5000),
    ("/v1/completions", b'{"model": "demo", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("/v1/completions", b'{"model": "demo", "prompt": "x", "max_tokens": ' + b"9" * 5000
     + b"}"),
    ("/v1/completions", b'{"model": "demo", "prompt": "a\\ud800b", "max_tokens": 1}'),
    ("/v1/chat/completions", b'{"model": "demo", "messages": [{"role": "user", '
     b'"content": "\\udfff"}]}'),
    ("/tokenize", b'{"model": "demo", "prompt": "\\ud83d"}'),
    ("/v1/chat/completions", b'{"model": "demo", "messages": [{"role": "user", '
     b'"content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}], '
     b'"tool_choice": {"function": "x"}}'),
    ("/v1/chat/completions", b'{"model": "demo", "messages": [{"role": "user", '
     b'"content": "hi"}], "tools": [{"function": "x"}]}'),
    ("/v1/completions", b'{"model": "demo", "prompt": "x"'),
    ("/v1/completions", b"\xff\xfe not utf-8"),
    ("/detokenize", b'{"model": "demo", "tokens": [1, 99999999999999999999999]}'),
]


@pytest.mark.parametrize("path,raw", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_inputs_are_400s(server, reference_text, path, raw):
    assert_openai_error(post(server, path, raw), 400)
    assert_still_serves(server, reference_text)


# ---- 9. what a deployer expects ------------------------------------------------------------
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_non_json_bodies_are_refused(server, content_type):
    r = post(server, "/v1/completions", REFERENCE, headers={"Content-Type": content_type})
    assert_openai_error(r, 415)


def test_cors_does_not_grant_credentials_to_any_origin(server):
    r = httpx.options(server.url + "/v1/completions", timeout=30, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization"})
    assert r.headers.get("access-control-allow-credentials") != "true"
    r = httpx.get(server.url + "/health", timeout=30,
                  headers={"Origin": "https://evil.example", "Cookie": "session=1"})
    assert r.headers.get("access-control-allow-credentials") != "true"
