"""The OpenAI server over a fake engine (fast): response shapes, streaming, errors, auth,
metrics, disconnects. The same behaviours run against the real engine in
test_openai_server.py."""
from __future__ import annotations

import contextlib
import json
import time

import httpx
import openai
import pytest
from fake_engine import FakeEngine, greedy_continuation
from server_utils import serve_in_thread

from vllm.engine.async_llm import AsyncLLM
from vllm.entrypoints.chat_utils import load_chat_template
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.frontend_options import FrontendOptions
from vllm.entrypoints.openai.metrics import metric_value

MODEL = "fake"


@pytest.fixture(scope="module")
def fake():
    return FakeEngine(max_model_len=128, num_blocks=256, step_delay=0.001)


@pytest.fixture(scope="module")
def engine(fake):
    llm = AsyncLLM(fake)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def app(engine):
    return build_app(engine, [MODEL])


@pytest.fixture(scope="module")
def url(app):
    with serve_in_thread(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def post(url: str, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, (dict, list)):
        return httpx.post(url + path, json=body, timeout=30, **kw)
    return httpx.post(url + path, content=body, timeout=30,
                      headers={"content-type": "application/json"}, **kw)


def test_models_health_version(url, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert httpx.get(url + "/health").status_code == 200
    assert "version" in httpx.get(url + "/version").json()


def test_completion(client):
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == greedy_continuation("abc", 5)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 5
    assert out.usage.total_tokens == 9


def test_completion_without_model_uses_the_served_one(url):
    body = post(url, "/v1/completions", {"prompt": "abc", "max_tokens": 2}).json()
    assert body["model"] == MODEL and body["object"] == "text_completion"


def test_completion_stream_with_usage(client):
    stream = client.completions.create(model=MODEL, prompt="abc", max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy_continuation("abc", 6)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completion_batch_n_and_token_prompts(client):
    out = client.completions.create(model=MODEL, prompt=["abc", "xy"], n=2, max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == ["def", "def", "zab", "zab"]
    assert out.usage.completion_tokens == 12
    ids = [1, ord("a") + 3]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert out.choices[0].text == "bc" and out.usage.prompt_tokens == 2


def test_completion_echo_stop_and_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0,
                                    echo=True)
    assert out.choices[0].text == "abcdef"
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=10, temperature=0,
                                    stop=["gh"])
    assert out.choices[0].text == "def" and out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra.get("stop_reason") == "gh"
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=10,
                                            temperature=0, stop="gh", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "def"
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=2, temperature=0,
                                    logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["d", "e"] and lp.token_logprobs == [-0.5, -0.5]
    assert lp.text_offset == [0, 1] and len(lp.top_logprobs[0]) == 3


def test_seed_makes_sampling_reproducible(client):
    def sample():
        return client.completions.create(model=MODEL, prompt="abc", max_tokens=8,
                                         temperature=1.0, seed=7).choices[0].text

    assert sample() == sample()


def test_chat(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi abc"}], max_tokens=4,
        temperature=0)
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content == "abcd"  # the prompt ends in "]"
    prompt = "[user]hi abc\n[assistant]"
    assert out.usage.prompt_tokens == len(prompt)  # no BOS: the template has its tokens
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        max_tokens=4, temperature=0, stream=True, n=2,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    # One choice per chunk, as vLLM streams: `chunk.choices[0]` sees every choice.
    assert all(len(c.choices) == 1 for c in chunks[:-1]) and chunks[-1].choices == []
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert texts == {0: "abcd", 1: "abcd"}
    assert chunks[-1].usage.completion_tokens == 8


def test_completion_stream_sends_one_choice_per_chunk(client):
    chunks = list(client.completions.create(model=MODEL, prompt=["abc", "xy"], n=2,
                                            max_tokens=3, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert all(len(c.choices) == 1 for c in chunks)
    texts = dict.fromkeys(range(4), "")
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == {0: "def", 1: "def", 2: "zab", 3: "zab"}


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=2,
        temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == ["a", "b"]
    assert len(content[0].top_logprobs) == 2 and content[0].top_logprobs[0].token == "a"


@pytest.mark.parametrize("body, status, param", [
    ({"model": "other", "prompt": "a"}, 404, "model"),
    ({"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"prompt": "a" * 200}, 400, "prompt"),
    ({"prompt": "a", "temperature": -1}, 400, "temperature"),
    ({"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"prompt": "a", "n": 0}, 400, "n"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 99999]}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream"),
    ({"prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "a", "seed": 2**64}, 400, "seed"),
    ({"prompt": "a", "n": 1000}, 400, "n"),
    ({"prompt": "a", "suffix": "z"}, 400, "suffix"),
])
def test_completion_errors(url, body, status, param):
    resp = post(url, "/v1/completions", body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["code"] == status and err["message"]
    assert err["type"] in ("BadRequestError", "NotFoundError")


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
])
def test_chat_errors(url, body, param):
    resp = post(url, "/v1/chat/completions", body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_invalid_json_and_unknown_route(url):
    resp = post(url, "/v1/completions", b"{not json")
    assert resp.status_code == 400 and "Invalid JSON" in resp.json()["error"]["message"]
    resp = httpx.get(url + "/v1/nothing-here")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == 404


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="a", max_tokens=-3)
    assert "max_tokens" in str(info.value)


def test_metrics_page(url, client):
    client.completions.create(model=MODEL, prompt="abc", max_tokens=3)
    text = httpx.get(url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:kv_cache_free_blocks",
                 "vllm:kv_cache_total_blocks", "vllm:generation_tokens_total",
                 "vllm:generation_tokens_per_second", "vllm:time_to_first_token_seconds_bucket",
                 'vllm:startup_phase_seconds{model_name="fake",phase="load_weights"}'):
        assert name in text, name
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert metric_value(text, "vllm:generation_tokens_total") >= 3
    assert metric_value(text, "vllm:kv_cache_free_blocks") == \
        metric_value(text, "vllm:kv_cache_total_blocks")


def _wait_idle(fake, engine, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.num_in_flight == 0 and not fake.has_unfinished_requests():
            return True
        time.sleep(0.02)
    return False


@contextlib.contextmanager
def slow_steps(fake):
    fake.step_delay = 0.01  # 100+ steps take longer than the client stays
    try:
        yield
    finally:
        fake.step_delay = 0.001


def test_disconnect_mid_stream_aborts(url, fake, engine):
    before = len(fake.aborted)
    body = {"prompt": "abc", "max_tokens": 100, "stream": True, "ignore_eos": True}
    with slow_steps(fake), httpx.Client(timeout=30) as http:
        with http.stream("POST", url + "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert got[0].startswith("data: ")
        assert _wait_idle(fake, engine)
    assert len(fake.aborted) == before + 1
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_disconnect_while_waiting_non_streaming_aborts(url, fake, engine):
    before = len(fake.aborted)
    with slow_steps(fake):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", timeout=0.3,
                       json={"prompt": "abc", "max_tokens": 120, "ignore_eos": True})
        assert _wait_idle(fake, engine)
    assert len(fake.aborted) == before + 1


def test_many_concurrent_streams(url, fake, engine):
    import asyncio

    async def one(http, i):
        n = 5 + i % 13
        body = {"prompt": "abc", "max_tokens": n, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        text, usage = "", None
        async with http.stream("POST", url + "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        text += chunk["choices"][0]["text"]
                    usage = chunk.get("usage") or usage
        return n, text, usage

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(one(http, i) for i in range(32)))

    for n, text, usage in asyncio.run(main()):
        assert len(text) == n and usage["completion_tokens"] == n
    assert _wait_idle(fake, engine)
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_api_key(engine):
    app = build_app(engine, [MODEL], api_key="sekrit")
    with serve_in_thread(app) as base:
        assert httpx.get(base + "/v1/models").status_code == 401
        bad = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == 401
        ok = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200
        assert httpx.get(base + "/health").status_code == 200  # not under /v1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong",
                          max_retries=0).models.list()
        client = openai.OpenAI(base_url=base + "/v1", api_key="sekrit", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="a", max_tokens=2).choices


def test_draining_refuses_new_requests(url, app):
    state = app.state.server
    state.draining = True
    try:
        resp = post(url, "/v1/completions", {"prompt": "a"})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == 503
        assert httpx.get(url + "/health").status_code == 503
    finally:
        state.draining = False
    assert httpx.get(url + "/health").status_code == 200


def test_engine_death_is_reported():
    fake = FakeEngine(step_delay=0.005)
    engine = AsyncLLM(fake)
    try:
        with serve_in_thread(build_app(engine, [MODEL])) as base:
            body = {"prompt": "abc", "max_tokens": 100, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                next(lines)
                fake.fail_next_step = True
                rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]"
            assert json.loads(rest[-2][6:])["error"]["code"] == 500
            assert httpx.get(base + "/health").status_code == 500
            resp = post(base, "/v1/completions", {"prompt": "a"})
            assert resp.status_code == 500 and resp.json()["error"]["code"] == 500
    finally:
        engine.shutdown()


def test_closing_a_stream_before_it_starts_aborts_its_requests():
    import asyncio

    from vllm.entrypoints.openai.protocol import CompletionRequest
    from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

    fake = FakeEngine(step_delay=0.005)
    engine = AsyncLLM(fake)

    async def main():
        serving = OpenAIServingCompletion(engine, [MODEL], fake.max_model_len, fake.tokenizer)
        request = CompletionRequest(prompt=["abc", "xyz"], max_tokens=100, stream=True,
                                    ignore_eos=True)
        stream = await serving.create_completion(request)
        await stream.aclose()  # the client went away before the first chunk
        return await engine.wait_for_idle(5)

    try:
        assert asyncio.run(main())
        assert _wait_idle(fake, engine)
        assert len(fake.aborted) == 2
    finally:
        engine.shutdown()


def test_tokenize_and_detokenize(url, fake):
    """vLLM's /tokenize (a prompt, or chat messages through the chat template) and
    /detokenize, with the server's own tokenizer."""
    body = post(url, "/tokenize", {"model": MODEL, "prompt": "abc"}).json()
    assert body == {"count": len(body["tokens"]), "max_model_len": 128,
                    "tokens": body["tokens"]}
    assert post(url, "/detokenize", {"tokens": body["tokens"]}).json()["prompt"].endswith("abc")
    chat = post(url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert post(url, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"] == \
        "[user]hi\n[assistant]"  # the fake's chat template, generation prompt included
    strs = post(url, "/tokenize", {"prompt": "ab", "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == strs["count"]
    for bad, param in [({}, "prompt"), ({"prompt": "a", "messages": []}, "prompt"),
                       ({"prompt": 5}, "prompt")]:
        resp = post(url, "/tokenize", bad)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, bad
    resp = post(url, "/detokenize", {"tokens": [10**9]})
    assert resp.status_code == 400 and "outside the vocabulary" in resp.json()["error"]["message"]
    assert post(url, "/tokenize", {"model": "other", "prompt": "a"}).status_code == 404


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("extra, words", [
    ({"tools": TOOLS}, '"auto"'),  # upstream's default with tools, needs a tool-call parser
    ({"tools": TOOLS, "tool_choice": "auto"}, '"auto"'),
    ({"tools": TOOLS, "tool_choice": "required"}, "structured outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function",
                                      "function": {"name": "get_weather"}}},
     "structured outputs"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "'sometimes'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "'other', which is not among the tools (get_weather)"),
    ({"tool_choice": "required"}, "needs tools"),
])
def test_tool_calls_are_refused_not_ignored(url, extra, words):
    """No tool-call parser and no structured outputs: a request that expects a tool call is
    a 400 naming tool_choice, never a 200 with plain text."""
    body = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 2, **extra}
    resp = post(url, "/v1/chat/completions", body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "tool_choice" and words in err["message"]


def test_tool_choice_none_shows_tools_without_calls(url):
    resp = post(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 2,
        "tools": TOOLS, "tool_choice": "none"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "a"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
])
def test_stream_options_need_stream(url, path, body):
    resp = post(url, path, {**body, "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "stream_options"


def test_chat_echo_starts_with_the_continued_message(client):
    """vLLM's `echo`: continuing an assistant message, the reply starts with its text; the
    reply's role is the last message's when there is no generation prompt."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "ab"}]
    extra = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0,
        extra_body={**extra, "echo": False}).choices[0].message
    echoed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                            temperature=0, extra_body=extra).choices[0].message
    assert echoed.role == "assistant" and echoed.content == "ab" + plain.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                                 temperature=0, stream=True,
                                                 extra_body=extra))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == echoed.content
    # The last message is the user's: nothing to echo under a generation prompt.
    def user_only(echo):
        return client.chat.completions.create(
            model=MODEL, messages=messages[:1], max_tokens=3, temperature=0,
            extra_body={"echo": echo}).choices[0].message.content

    assert user_only(True) == user_only(False)


JINJA_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                  "{% if add_generation_prompt %}<bot>{% endif %}")


def test_server_chat_template_and_request_template(engine):
    """--chat-template replaces the tokenizer's template; a request's own chat_template is
    refused unless the server trusts request templates."""
    messages = [{"role": "user", "content": "hi"}]
    with serve_in_thread(build_app(engine, [MODEL],
                                   options=FrontendOptions(chat_template=JINJA_TEMPLATE))) as base:
        tokens = post(base, "/tokenize", {"messages": messages}).json()["tokens"]
        assert post(base, "/detokenize", {"tokens": tokens}).json()["prompt"] == \
            "<user>hi<bot>"
        resp = post(base, "/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                                   "chat_template": "{{ 'x' }}"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in resp.json()["error"]["message"]
    trusting = FrontendOptions(trust_request_chat_template=True)
    with serve_in_thread(build_app(engine, [MODEL], options=trusting)) as base:
        body = post(base, "/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                                   "chat_template": "{{ 'zz' }}"}).json()
        assert body["usage"]["prompt_tokens"] == 2  # "zz", no BOS: the template's own text


def test_several_served_names(engine):
    """Every --served-model-name is listed and accepted; a response names the one asked for."""
    with serve_in_thread(build_app(engine, ["main", "alias"])) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["main", "alias"]
        out = client.completions.create(model="alias", prompt="a", max_tokens=2)
        assert out.model == "alias"
        assert client.completions.create(prompt="a", max_tokens=2, model="main").model == "main"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="fake", prompt="a", max_tokens=2)


def test_load_chat_template(tmp_path, capsys):
    """--chat-template: a file's path or the template text; a bad path or bad Jinja is a
    one-line error at start-up naming the value."""
    path = tmp_path / "t.jinja"
    path.write_text(JINJA_TEMPLATE)
    assert load_chat_template(str(path)) == JINJA_TEMPLATE
    assert load_chat_template(JINJA_TEMPLATE) == JINJA_TEMPLATE
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="missing.jinja.*looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")
    # `vllm serve --chat-template` refuses a bad value before the engine starts.
    from vllm.entrypoints.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "demo", "--chat-template", str(tmp_path / "missing.jinja")])
    assert info.value.code == 2
    assert "--chat-template" in capsys.readouterr().err


def test_frontend_options_response_role_request_log_cors_root_path(engine, caplog):
    """upstream's server flags: --response-role, --enable-log-requests / --max-log-len, the
    CORS flags (a browser's preflight needs no API key) and --root-path."""
    import logging

    options = FrontendOptions(response_role="bot", enable_log_requests=True, max_log_len=2,
                              allowed_origins=["http://ui.example"], root_path="/llm")
    app = build_app(engine, [MODEL], api_key="k", options=options)
    with serve_in_thread(app) as base:
        auth = {"Authorization": "Bearer k"}
        with caplog.at_level(logging.INFO, logger="vllm"):
            body = post(base, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                headers=auth).json()
        assert body["choices"][0]["message"]["role"] == "bot"
        logged = [r.getMessage() for r in caplog.records if "Received request" in
                  r.getMessage()]
        assert len(logged) == 1 and "max_tokens=2" in logged[0]
        assert "prompt: '[u'" in logged[0]  # cut to --max-log-len characters
        preflight = httpx.options(base + "/v1/completions", headers={
            "Origin": "http://ui.example", "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
        other = httpx.options(base + "/v1/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in other.headers
        # --root-path: served under the prefix and (behind a stripping proxy) without it;
        # the API key is still required under the prefix
        assert httpx.get(base + "/llm/v1/models", headers=auth).json()["data"][0]["id"] == \
            MODEL
        assert httpx.get(base + "/llm/v1/models").status_code == 401
        assert httpx.get(base + "/v1/models", headers=auth).status_code == 200
        assert httpx.get(base + "/llm/health").status_code == 200



def test_serve_flags_reach_the_frontend_options(tmp_path):
    from vllm.entrypoints.cli.main import build_parser
    from vllm.entrypoints.openai.api_server import uvicorn_config

    args = build_parser().parse_args([
        "serve", "demo", "--response-role", "bot", "--enable-log-requests", "--max-log-len",
        "10", "--root-path", "/llm", "--allowed-origins", '["http://a"]', "--allow-credentials",
        "--disable-log-requests"])
    options = FrontendOptions.from_cli_args(args)
    assert (options.response_role, options.enable_log_requests, options.max_log_len) == \
        ("bot", True, 10)
    assert options.allowed_origins == ["http://a"] and options.allow_credentials
    assert options.root_path == "/llm" and uvicorn_config(object(), args).port == 8000
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "demo", "--allowed-origins", "*"])


def test_requests_are_not_logged_by_default(url, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="vllm"):
        assert post(url, "/v1/completions", {"prompt": "a", "max_tokens": 1}).status_code == 200
    assert "Received request" not in caplog.text


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "a", "guided_json": {"type": "object"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "structured_outputs": {"choice": ["x", "y"]}}),
    ("/v1/completions", {"prompt": "a", "use_beam_search": True}),
])
def test_requests_for_missing_features_are_refused_not_ignored(url, path, body):
    resp = post(url, path, {**body, "max_tokens": 2})
    assert resp.status_code == 400, resp.text
    param = resp.json()["error"]["param"]
    assert param in body and "not supported" in resp.json()["error"]["message"]


def test_unknown_request_fields_are_logged_as_ignored(url, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="vllm"):
        resp = post(url, "/v1/completions", {"prompt": "a", "max_tokens": 1,
                                             "use_beam_search": False, "frobnicate": 1})
    assert resp.status_code == 200
    assert "ignored: ['frobnicate', 'use_beam_search']" in caplog.text


def test_truncate_prompt_tokens(url):
    """vLLM's truncate_prompt_tokens: the prompt's last N tokens are used (and counted); -1
    cuts to max_model_len (128 here), which leaves no room for output (400, as upstream);
    0 is refused by name."""
    body = post(url, "/v1/completions", {"prompt": "abcdefgh", "max_tokens": 2,
                                         "truncate_prompt_tokens": 3, "echo": True}).json()
    assert body["usage"]["prompt_tokens"] == 3
    assert body["choices"][0]["text"].startswith("fgh")
    chat = post(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1,
        "truncate_prompt_tokens": 4}).json()
    assert chat["usage"]["prompt_tokens"] == 4
    full = post(url, "/v1/completions", {"prompt": "a" * 200, "max_tokens": 1,
                                         "truncate_prompt_tokens": -1})
    assert full.status_code == 400 and "has 128 tokens" in full.json()["error"]["message"]
    bad = post(url, "/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"


def test_vllm_chat_and_complete_commands(url, capsys, monkeypatch):
    """`vllm chat` / `vllm complete` (upstream's client commands) against a running server:
    -q sends one message; without it every typed line is one turn, and chat keeps the
    conversation."""
    from vllm.entrypoints.cli.main import main

    # (the fake's tokens are one character each; sampling is at the server's temperature 1)
    assert main(["complete", "--url", url + "/v1", "-q", "abc", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and 1 <= len(out) - 1 <= 3
    assert main(["chat", "--url", url + "/v1", "-q", "hi abc", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and 1 <= len(out) - 1 <= 4
    typed = iter(["x", "y"])

    def fake_input(prompt):
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    from vllm.entrypoints.cli import chat

    sent, real_reply = [], chat.reply
    monkeypatch.setattr(chat, "reply", lambda client, messages: (
        sent.append([dict(m) for m in messages]) or real_reply(client, messages)))
    monkeypatch.setattr("builtins.input", fake_input)
    assert main(["chat", "--url", url + "/v1", "--max-tokens", "2",
                 "--system-prompt", "be brief"]) == 0
    assert [[m["role"] for m in turn] for turn in sent] == [
        ["system", "user"], ["system", "user", "assistant", "user"]]
    assert capsys.readouterr().out.startswith(sent[1][2]["content"])  # the reply it showed
    with pytest.raises(SystemExit) as info:
        main(["complete", "--url", url + "/v1", "--model-name", "nope", "-q", "a"])
    assert info.value.code == 2 and "404" in capsys.readouterr().err


def test_streamed_chat_prompt_data_and_completion_response_format(url):
    """As upstream: a streamed chat sends the prompt's token ids once, with its first chunk,
    and refuses prompt_logprobs; response_format json is refused on completions too (it was
    ignored there); truncate_prompt_tokens over max_model_len is a 400."""
    messages = [{"role": "user", "content": "hi"}]
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=30, json={
            "messages": messages, "max_tokens": 2, "stream": True,
            "return_token_ids": True}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] and all("prompt_token_ids" not in c
                                                 for c in chunks[1:])
    assert sum(len(c["choices"][0].get("token_ids", [])) for c in chunks if c["choices"]) >= 1
    for path, body in [("/v1/chat/completions", {"messages": messages, "stream": True,
                                                 "prompt_logprobs": 1}),
                       ("/v1/completions", {"prompt": "a",
                                            "response_format": {"type": "json_object"}}),
                       ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 129})]:
        resp = post(url, path, {**body, "max_tokens": 1})
        assert resp.status_code == 400, (path, body, resp.text)
        assert resp.json()["error"]["param"] in body


def test_generation_config_max_new_tokens_caps_every_request():
    """As upstream: the model's generation_config max_new_tokens (here 3) caps a request's
    output: a chat without max_tokens, a completion's default 16 and a larger max_tokens."""
    from vllm.sampling_params import SamplingParams

    fake = FakeEngine(max_model_len=128, num_blocks=64, step_delay=0.0)
    fake.get_default_sampling_params = lambda: SamplingParams(max_tokens=3, temperature=0)
    engine = AsyncLLM(fake)
    try:
        with serve_in_thread(build_app(engine, [MODEL])) as base:
            chat = post(base, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}).json()
            plain = post(base, "/v1/completions", {"prompt": "a", "ignore_eos": True}).json()
            big = post(base, "/v1/completions", {"prompt": "a", "max_tokens": 50,
                                                 "ignore_eos": True}).json()
        assert [r["usage"]["completion_tokens"] for r in (chat, plain, big)] == [3, 3, 3]
    finally:
        engine.shutdown()
