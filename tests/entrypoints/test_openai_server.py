"""`vllm serve` as a real process on a tiny checkpoint, driven by the official openai client.

One server for the whole module (started once): -O0, a 1 MiB KV cache (about 127 blocks of 16
tokens, so the load test overfills it and requests must wait or be preempted), an API key,
--max-logprobs 30.
"""
from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import openai
import pytest
from server_utils import RemoteServer

from vllm.entrypoints.openai.metrics import metric_value

pytestmark = pytest.mark.slow

MODEL = "tiny"
ALIAS = "tiny-alias"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def server(llama_path, tmp_path_factory):
    srv = RemoteServer("vllm.entrypoints.cli.main", [
        "serve", llama_path, "-O0", "--kv-cache-memory", "1MiB", "--max-model-len", "512",
        "--served-model-name", MODEL, ALIAS, "--api-key", KEY, "--disable-uvicorn-access-log",
        "--max-logprobs", "30", "--trust-request-chat-template"],
        log_dir=str(tmp_path_factory.mktemp("logs")))
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(llama_path):
    from vllm import LLM

    return LLM(model=llama_path, optimization_level=0, max_model_len=512)


def metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def wait_pool_free(server, timeout: float = 20.0) -> str:
    """Wait until nothing runs and every KV block is free again; return the metrics text."""
    deadline = time.monotonic() + timeout
    while True:
        text = metrics(server)
        free = metric_value(text, "vllm:kv_cache_free_blocks")
        total = metric_value(text, "vllm:kv_cache_total_blocks")
        idle = (metric_value(text, "vllm:num_requests_running") == 0
                and metric_value(text, "vllm:num_requests_waiting") == 0
                and metric_value(text, "vllm:num_requests_in_flight") == 0)
        if (idle and free == total) or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def test_startup_log_shows_level_and_phases(server):
    log = server.log()
    ready = log.index("Application startup complete")
    assert -1 < log.index("Optimization level O0") < ready
    assert -1 < log.index("Start-up phases (ready in") < ready
    assert log.count("Start-up phases") == 1  # the engine's table, not a second one


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, ALIAS]
    assert models[0].model_extra["max_model_len"] == 512
    out = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=2)
    assert out.model == ALIAS


def test_greedy_completion_equals_llm_generate(client, llm):
    from vllm import SamplingParams

    expected = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16),
                            use_tqdm=False)[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.prompt_tokens == len(llm.get_tokenizer().encode(PROMPT))
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_chat_and_chat_stream(client, llm):
    messages = [{"role": "user", "content": "Hello there"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                         temperature=0)
    text = out.choices[0].message.content
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_request_chat_template_is_rendered_with_jinja(client, llm):
    """The server trusts request templates here (--trust-request-chat-template): the prompt is
    the request template's rendering, tokenized as the chat path does."""
    template = ("{% for m in messages %}### {{ m['role'] | upper }}: {{ m['content'] }}\n"
                "{% endfor %}{% if add_generation_prompt %}### ASSISTANT:{% endif %}")
    messages = [{"role": "user", "content": "Hello there"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                         temperature=0,
                                         extra_body={"chat_template": template})
    tok = llm.get_tokenizer()
    expected = tok.encode("### USER: Hello there\n### ASSISTANT:", add_special_tokens=False)
    assert out.usage.prompt_tokens == len(expected)


def test_n_and_seed(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=2,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == out.choices[1].text  # greedy: both the same
    assert out.usage.completion_tokens == 16
    sampled = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                         temperature=1.0, seed=1234).choices[0].text
               for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_stop_string(client):
    full = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    match = re.search(r"[A-Za-z]{2,}", text[1:])
    if match is None:
        pytest.skip(f"no ASCII word in the greedy text {text!r}")
    stop = match.group(0)
    out = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=24,
                                    temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == text[:text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="Hello world", max_tokens=24,
                                            temperature=0, stop=stop, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == text[:text.index(stop)]


def test_64_concurrent_streams_complete_and_free_the_pool(server, client):
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                                 timeout=120)
    words = PROMPT.split()

    async def one(i: int) -> tuple[int, int, str | None]:
        n = 4 + (i * 7) % 60
        prompt = " ".join(words[: 1 + i % len(words)] * (1 + i % 4))
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, temperature=0.8, seed=i, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "min_tokens": n})
        usage, reason = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        return n, usage.completion_tokens, reason

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert all(got == want and reason == "length" for want, got, reason in results), results
    text = wait_pool_free(server)
    assert metric_value(text, "vllm:kv_cache_free_blocks") == \
        metric_value(text, "vllm:kv_cache_total_blocks")


BAD = [
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ("/v1/completions", b"{oops", 400, None),
    ("/v1/completions", {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10**7}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hello " * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": {"text": "a"}}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
]


def test_bad_requests_do_not_disturb_a_running_stream(server, client):
    result = {}

    def long_stream():
        chunks = list(client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        result["usage"] = chunks[-1].usage

    thread = threading.Thread(target=long_stream)
    thread.start()
    for path, body, status, param in BAD:
        kw = {"content": body, "headers": {**AUTH, "content-type": "application/json"}} \
            if isinstance(body, bytes) else {"json": body, "headers": AUTH}
        resp = httpx.post(server.url + path, timeout=30, **kw)
        assert resp.status_code == status, (body, resp.text)
        err = resp.json()["error"]
        assert err["code"] == status and err["param"] == param and err["message"], err
    thread.join(60)
    assert result["usage"].completion_tokens == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_api_key(server):
    assert httpx.get(server.url + "/v1/models").status_code == 401
    wrong = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == 401
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # outside /v1: open


def test_disconnect_mid_stream_frees_blocks(server):
    before = metric_value(metrics(server), 'vllm:request_success_total{model_name="tiny",'
                          'finished_reason="abort"}') or 0
    body = {"prompt": PROMPT, "max_tokens": 450, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body,
                         headers=AUTH) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for _ in range(6):
                next(lines)
    text = wait_pool_free(server)
    assert metric_value(text, "vllm:kv_cache_free_blocks") == \
        metric_value(text, "vllm:kv_cache_total_blocks")
    after = metric_value(text, 'vllm:request_success_total{model_name="tiny",'
                         'finished_reason="abort"}')
    assert after == before + 1


def test_metrics_after_traffic(server, client):
    """Counts move by exactly this test's traffic (whatever else ran on this server: under
    pytest-xdist the module's tests are spread over workers, each with its own server)."""
    before = metrics(server)
    gen0 = metric_value(before, "vllm:generation_tokens_total") or 0
    ttft0 = metric_value(before, "vllm:time_to_first_token_seconds_count") or 0
    itl0 = metric_value(before, "vllm:inter_token_latency_seconds_count") or 0
    req_gen0 = metric_value(before, "vllm:request_generation_tokens_sum") or 0
    queries0 = metric_value(before, "vllm:prefix_cache_queries_total") or 0
    hits0 = metric_value(before, "vllm:prefix_cache_hits_total") or 0
    for _ in range(4):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=300, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = wait_pool_free(server)
    assert metric_value(text, "vllm:generation_tokens_total") - gen0 == 1200
    assert metric_value(text, "vllm:time_to_first_token_seconds_count") - ttft0 == 4
    # every token after a request's first is one inter-token interval (old name too)
    assert metric_value(text, "vllm:inter_token_latency_seconds_count") - itl0 == 4 * 299
    assert metric_value(text, "vllm:time_per_output_token_seconds_count") == \
        metric_value(text, "vllm:inter_token_latency_seconds_count")
    assert metric_value(text, "vllm:request_generation_tokens_sum") - req_gen0 == 1200
    assert metric_value(text, "vllm:prefix_cache_queries_total") > queries0
    assert metric_value(text, "vllm:prefix_cache_hits_total") > hits0  # the same prompt 4x
    assert metric_value(text, "vllm:gpu_cache_usage_perc") == 0.0
    assert 'vllm:cache_config_info{model_name="tiny",block_size="16"' in text
    assert 'vllm:startup_phase_seconds{model_name="tiny",phase=' in text
    assert metric_value(text, "vllm:kv_cache_usage_perc") == 0.0


def test_echo_with_logprobs_covers_the_prompt(client, llm):
    """As vLLM: with echo, the logprobs start at the prompt's tokens (the first one None, the
    others the prompt logprobs) and run on over the generated ones; streamed the same."""
    from vllm import SamplingParams

    ids = llm.get_tokenizer().encode(PROMPT)
    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=1,
                                              prompt_logprobs=1), use_tqdm=False)[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                    echo=True, logprobs=1, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(
            ref.prompt_logprobs[pos][ids[pos]].logprob, abs=1e-4)
    generated = ref.outputs[0]
    for j, token in enumerate(generated.token_ids):
        assert lp.token_logprobs[len(ids) + j] == pytest.approx(
            generated.logprobs[j][token].logprob, abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                            temperature=0, echo=True, logprobs=1, stream=True,
                                            extra_body={"ignore_eos": True}))
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        for key in streamed:
            streamed[key] += getattr(c.choices[0].logprobs, key)
    assert streamed["tokens"] == lp.tokens
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert streamed["text_offset"] == lp.text_offset


def test_prompt_logprobs_and_token_ids_in_responses(client, llm):
    """vLLM's prompt_logprobs=N and return_token_ids: the prompt's logprobs (the first None)
    equal the offline engine's; the prompt's and the choice's token ids come back."""
    from vllm import SamplingParams

    ids = llm.get_tokenizer().encode(PROMPT)
    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                    extra_body={"prompt_logprobs": 2, "return_token_ids": True,
                                                "ignore_eos": True})
    choice = out.choices[0].model_extra
    assert choice["prompt_token_ids"] == ids
    assert choice["token_ids"] == list(ref.outputs[0].token_ids)
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for pos in range(1, len(ids)):
        entry = plp[pos]
        assert str(ids[pos]) in entry and len(entry) <= 3
        assert entry[str(ids[pos])]["logprob"] == pytest.approx(
            ref.prompt_logprobs[pos][ids[pos]].logprob, abs=1e-4)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        temperature=0, extra_body={"return_token_ids": True, "prompt_logprobs": 1})
    extra = chat.model_extra
    assert len(extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    assert len(extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                  extra_body={"prompt_logprobs": 31})


def test_tokenize_counts_what_completions_count(server, client, llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    body = httpx.post(server.url + "/tokenize", headers=AUTH, timeout=10,
                      json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    assert body["tokens"] == ids and body["max_model_len"] == 512
    assert body["token_strs"] == llm.get_tokenizer().convert_ids_to_tokens(ids)
    usage = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage
    assert body["count"] == usage.prompt_tokens
    text = httpx.post(server.url + "/detokenize", headers=AUTH, timeout=10,
                      json={"tokens": ids}).json()["prompt"]
    assert text == llm.get_tokenizer().decode(ids)
    messages = [{"role": "user", "content": "Hello"}]
    chat = httpx.post(server.url + "/tokenize", headers=AUTH, timeout=10,
                      json={"messages": messages}).json()
    used = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert chat["count"] == used.prompt_tokens


def test_max_logprobs_bounds_both_apis(client):
    """--max-logprobs (here 30, default 20) is the bound of completions' logprobs and chat's
    top_logprobs: within it answers, beyond it is a 400 naming the value and the bound."""
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                    logprobs=30)
    # (top_logprobs is keyed by token text: tokens that decode alike share an entry)
    assert len(out.choices[0].logprobs.top_logprobs[0]) > 20
    with pytest.raises(openai.BadRequestError, match=r"between 0 and 30.*got 31"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=31)
    with pytest.raises(openai.BadRequestError, match=r"between 0 and 30.*got 31"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, logprobs=True, top_logprobs=31)


def test_logit_bias_and_allowed_token_ids(client, llm):
    """OpenAI's logit_bias (string keys, clamped to [-100, 100]) and vLLM's allowed_token_ids
    steer the tokens; an id outside the vocabulary is a 400."""
    text = {t: llm.get_tokenizer().decode([t]) for t in (9, 10)}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logprobs=0, logit_bias={"9": 500},
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].logprobs.tokens == [text[9]] * 4
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0.8, seed=1, logprobs=True,
        extra_body={"allowed_token_ids": [9, 10], "ignore_eos": True})
    assert {c.token for c in chat.choices[0].logprobs.content} <= set(text.values())
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                  logit_bias={"999999": 5})


def test_bad_words_reach_the_sampler(client, llm):
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    token = next(t for t in ref if (w := tok.decode([t])).strip()
                 and tok.encode(w, add_special_tokens=False) == [t])
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"bad_words": [tok.decode([token])],
                                                "return_token_ids": True, "ignore_eos": True})
    assert token not in out.choices[0].model_extra["token_ids"]
