"""Upstream behaviours real clients met (issue 22, item 4), over the fake engine (fast):
echo with max_tokens=0 (lm-eval's loglikelihood path), return_tokens_as_token_ids, the
/v1/responses route with the official openai client, upstream's import paths and output
fields, `--config` in `vllm serve --help`, the README's CPU install note. One slow test runs
echo-only scoring and /v1/responses over the real engine."""
from __future__ import annotations

import dataclasses
import json
import os
import time

import httpx
import openai
import pytest
from fake_engine import FakeEngine, FakeTokenizer, greedy_continuation
from server_utils import REPO, serve_in_thread

from vllm.engine.async_llm import AsyncLLM
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.frontend_options import FrontendOptions
from vllm.outputs import CompletionOutput, Logprob, RequestOutput

MODEL = "fake"


def prompt_logprob(pos: int) -> float:
    """The fake engine's logprob of the prompt token at `pos` (>= 1)."""
    return -0.25 * pos


class ScoringEngine(FakeEngine):
    """FakeEngine that also returns prompt logprobs when asked: the actual token at rank 1
    with `prompt_logprob(pos)`, then "A", "B", ... at ranks 2, 3, ..."""

    def _output(self, r):
        out = super()._output(r)
        wanted = r.params.prompt_logprobs
        if wanted is not None:
            entries: list = [None]
            for pos in range(1, len(r.ids)):
                tid = r.ids[pos]
                entry = {tid: Logprob(prompt_logprob(pos), 1, self.tokenizer.decode([tid]))}
                for k in range(wanted):
                    alt = ord("A") + 3 + k
                    entry.setdefault(alt, Logprob(-5.0 - k, k + 2, chr(alt - 3)))
                entries.append(entry)
            out.prompt_logprobs = entries
        return out


@pytest.fixture(scope="module")
def fake():
    return ScoringEngine(max_model_len=128, num_blocks=256, step_delay=0.001)


@pytest.fixture(scope="module")
def engine(fake):
    llm = AsyncLLM(fake)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    with serve_in_thread(build_app(engine, [MODEL])) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30, **kw)


def sse_events(resp: httpx.Response) -> list[tuple[str | None, dict | str]]:
    """(event name, decoded data) of each server-sent event."""
    events, name = [], None
    for line in resp.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            events.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return events


# ---- echo with max_tokens=0 ---------------------------------------------------------------
def test_echo_with_max_tokens_0_returns_the_prompts_logprobs(url):
    """lm-eval's loglikelihood body: the prompt as text, a logprob per prompt token (the
    first null), finish_reason "length", no completion tokens."""
    body = post(url, "/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 0,
                                         "echo": True, "logprobs": 1}).json()
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4}
    (choice,) = body["choices"]
    assert choice["text"] == "abc" and choice["finish_reason"] == "length"
    assert choice["stop_reason"] is None and choice["index"] == 0
    lp = choice["logprobs"]
    assert lp["tokens"] == ["", "a", "b", "c"]  # (BOS decodes to "")
    assert lp["token_logprobs"] == [None, prompt_logprob(1), prompt_logprob(2),
                                    prompt_logprob(3)]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {"a": prompt_logprob(1), "A": -5.0}
    assert lp["text_offset"] == [0, 0, 1, 2]


def test_echo_with_max_tokens_0_without_logprobs_batches_and_n(client):
    out = client.completions.create(model=MODEL, prompt=["abc", "xy"], max_tokens=0,
                                    echo=True, n=2)
    assert [(c.index, c.text, c.finish_reason, c.logprobs) for c in out.choices] == [
        (0, "abc", "length", None), (1, "abc", "length", None), (2, "xy", "length", None),
        (3, "xy", "length", None)]
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == 4 + 3


def test_echo_with_max_tokens_0_token_id_prompt_and_token_ids(url):
    ids = [1, ord("h") + 3, ord("i") + 3]
    body = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True,
                                         "logprobs": 0, "return_token_ids": True}).json()
    (choice,) = body["choices"]
    assert choice["text"] == "hi" and choice["token_ids"] == []
    assert choice["prompt_token_ids"] == ids
    assert choice["logprobs"]["token_logprobs"] == [None, prompt_logprob(1), prompt_logprob(2)]


def test_echo_with_max_tokens_0_streams_one_chunk_per_choice(url):
    body = {"prompt": ["abc", "xy"], "max_tokens": 0, "echo": True, "logprobs": 1,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=30) as http, http.stream("POST", url + "/v1/completions",
                                                       json=body) as resp:
        events = [data for _, data in sse_events(resp)]
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 0
    chunks = sorted((e["choices"][0] for e in events[:-2]), key=lambda c: c["index"])
    assert [(c["index"], c["text"], c["finish_reason"]) for c in chunks] == [
        (0, "abc", "length"), (1, "xy", "length")]
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert chunks[0]["logprobs"]["token_logprobs"][1:] == [prompt_logprob(p) for p in (1, 2, 3)]
    assert chunks[1]["logprobs"]["text_offset"] == [0, 0, 1]


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "abc", "max_tokens": 0}, "max_tokens", "only with echo"),
    ({"prompt": "abc", "max_tokens": 0, "echo": True, "min_tokens": 2}, "min_tokens",
     "max_tokens (0)"),
    ({"prompt": "abc", "max_tokens": -1, "echo": True}, "max_tokens", "at least 1"),
])
def test_max_tokens_0_needs_echo(url, body, param, words):
    resp = post(url, "/v1/completions", body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"]


# ---- return_tokens_as_token_ids -----------------------------------------------------------
def test_completion_tokens_as_token_ids(client):
    kw = {"model": MODEL, "prompt": "abc", "max_tokens": 2, "temperature": 0, "logprobs": 1}
    plain = client.completions.create(**kw).choices[0].logprobs
    as_ids = client.completions.create(
        **kw, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    d, e = ord("d") + 3, ord("e") + 3
    assert plain.tokens == ["d", "e"]
    assert as_ids.tokens == [f"token_id:{d}", f"token_id:{e}"]
    assert as_ids.top_logprobs[0] == {f"token_id:{d}": -0.5, f"token_id:{ord('A') + 3}": -2.0}
    # the offsets still count the text, and the logprobs are the same
    assert as_ids.text_offset == plain.text_offset == [0, 1]
    assert as_ids.token_logprobs == plain.token_logprobs
    echoed = client.completions.create(
        model=MODEL, prompt="ab", max_tokens=1, temperature=0, logprobs=0, echo=True,
        extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert echoed.tokens == [f"token_id:{t}" for t in (1, ord("a") + 3, ord("b") + 3,
                                                        ord("c") + 3)]
    chunks = list(client.completions.create(
        **kw, stream=True, extra_body={"return_tokens_as_token_ids": True}))
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == as_ids.tokens


def test_chat_tokens_as_token_ids(client):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
          "temperature": 0, "logprobs": True, "top_logprobs": 1,
          "extra_body": {"return_tokens_as_token_ids": True}}
    content = client.chat.completions.create(**kw).choices[0].logprobs.content
    a = ord("a") + 3  # (the fake template ends with "]": the reply starts at "a")
    assert content[0].token == f"token_id:{a}"
    assert content[0].bytes == list(f"token_id:{a}".encode())
    assert content[0].top_logprobs[0].token == f"token_id:{a}"
    streamed = [lp.token for c in client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert streamed == [f"token_id:{a}", f"token_id:{a + 1}"]


def test_server_flag_sets_the_default_and_requests_override_it(engine):
    from vllm.entrypoints.cli.main import build_parser

    args = build_parser().parse_args(["serve", "demo", "--return-tokens-as-token-ids"])
    options = FrontendOptions.from_cli_args(args)
    assert options.return_tokens_as_token_ids
    assert not FrontendOptions.from_cli_args(
        build_parser().parse_args(["serve", "demo"])).return_tokens_as_token_ids
    with serve_in_thread(build_app(engine, [MODEL], options=options)) as base:
        body = {"prompt": "abc", "max_tokens": 1, "temperature": 0, "logprobs": 0}
        tokens = post(base, "/v1/completions", body).json()["choices"][0]["logprobs"]["tokens"]
        assert tokens == [f"token_id:{ord('d') + 3}"]
        body["return_tokens_as_token_ids"] = False
        tokens = post(base, "/v1/completions", body).json()["choices"][0]["logprobs"]["tokens"]
        assert tokens == ["d"]


# ---- /v1/responses ------------------------------------------------------------------------
def rendered(messages: list[dict]) -> str:
    return FakeTokenizer().apply_chat_template(messages)


def test_responses_with_the_openai_client(client):
    out = client.responses.create(model=MODEL, input="hi", max_output_tokens=40,
                                  temperature=0)
    prompt = rendered([{"role": "user", "content": "hi"}])
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.status == "completed" and out.incomplete_details is None
    assert out.model == MODEL and out.error is None
    assert out.output_text == "abcdefghijklmnopqrstuvwxyz"  # then EOS
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_")
    assert [(p.type, p.annotations) for p in item.content] == [("output_text", [])]
    assert out.usage.input_tokens == len(prompt)  # (the fake template adds no BOS)
    assert out.usage.output_tokens == 27 and out.usage.total_tokens == len(prompt) + 27


def test_responses_instructions_messages_and_budget(client, url):
    out = client.responses.create(
        model=MODEL, instructions="be brief", max_output_tokens=3, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
               {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
               {"role": "user", "content": "again"}])
    prompt = rendered([{"role": "system", "content": "be brief"},
                       {"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "ok"},
                       {"role": "user", "content": "again"}])
    assert out.usage.input_tokens == len(prompt)
    assert out.output_text == greedy_continuation("]", 3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.max_output_tokens == 3 and out.temperature == 0 and out.instructions == "be brief"
    # the body is what the SDK's own model accepts (but for the usage details the newest
    # SDK requires and upstream does not send, cache_write_tokens)
    from openai.types.responses import Response

    body = post(url, "/v1/responses", {"input": "hi", "max_output_tokens": 2}).json()
    assert body["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    Response.model_validate({**body, "usage": None})
    assert body["store"] is False and body["tools"] == [] and body["text"] == {
        "format": {"type": "text"}}


def test_responses_stream_with_the_openai_client(client):
    from openai.types.responses import (
        ResponseCompletedEvent,
        ResponseContentPartAddedEvent,
        ResponseContentPartDoneEvent,
        ResponseCreatedEvent,
        ResponseInProgressEvent,
        ResponseOutputItemAddedEvent,
        ResponseOutputItemDoneEvent,
        ResponseTextDeltaEvent,
        ResponseTextDoneEvent,
    )

    events = list(client.responses.create(model=MODEL, input="hi", max_output_tokens=5,
                                          temperature=0, stream=True))
    kinds = [type(e) for e in events]
    deltas = [e for e in events if isinstance(e, ResponseTextDeltaEvent)]
    assert kinds == [ResponseCreatedEvent, ResponseInProgressEvent,
                     ResponseOutputItemAddedEvent, ResponseContentPartAddedEvent,
                     *[ResponseTextDeltaEvent] * len(deltas), ResponseTextDoneEvent,
                     ResponseContentPartDoneEvent, ResponseOutputItemDoneEvent,
                     ResponseCompletedEvent]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(d.delta for d in deltas)
    assert text == greedy_continuation("]", 5) == events[-4].text
    item_id = events[2].item.id
    assert {d.item_id for d in deltas} == {item_id} == {events[-2].item.id}
    final = events[-1].response
    assert final.output_text == text and final.output[0].id == item_id
    assert final.status == "incomplete" and final.usage.output_tokens == 5
    assert final.id == events[0].response.id


def test_responses_stream_events_are_named(url):
    """Each event has an `event:` line naming its type (as upstream), and no [DONE]."""
    body = {"input": "hi", "max_output_tokens": 2, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", url + "/v1/responses",
                                                       json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert all(name == data["type"] for name, data in events)
    assert events[-1][0] == "response.completed"


@pytest.mark.parametrize("body, status, param", [
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}]}, 400, "tools"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "hi", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}}, 400, "text.format"),
    ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400,
     "input[0].content[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input[0].role"),
    ({"input": []}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({}, 400, "input"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 100000}, 400, "max_output_tokens"),
    ({"input": "x" * 100000}, 400, "input"),
    ({"input": "hi", "model": "nope"}, 404, "model"),
])
def test_responses_errors(url, body, status, param):
    resp = post(url, "/v1/responses", body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["code"] == status


def test_responses_shares_the_front_door(url, engine):
    """Strict JSON (read_request) and the guard (API key) apply to /v1/responses too."""
    resp = httpx.post(url + "/v1/responses", content=b'{"input": NaN}', timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "Invalid JSON" in resp.json()["error"]["message"]
    with serve_in_thread(build_app(engine, [MODEL], api_key="k")) as base:
        assert post(base, "/v1/responses", {"input": "hi"}).status_code == 401
        ok = post(base, "/v1/responses", {"input": "hi", "max_output_tokens": 1},
                  headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 1


def test_responses_disconnect_mid_stream_aborts(url, fake, engine):
    before = len(fake.aborted)
    body = {"input": "hi", "max_output_tokens": 100, "stream": True, "ignore_eos": True}
    fake.step_delay = 0.05  # (100 steps: 5 s, far longer than the client stays)
    try:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", url + "/v1/responses", json=body) as resp:
                lines = resp.iter_lines()
                while "output_text.delta" not in next(lines):
                    pass
        deadline = time.monotonic() + 10  # (the engine thread applies the abort)
        while (engine.num_in_flight or fake.has_unfinished_requests()) and \
                time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        fake.step_delay = 0.001
    assert engine.num_in_flight == 0 and not fake.has_unfinished_requests()
    assert len(fake.aborted) == before + 1  # (it was aborted, not finished)


# ---- import paths and output fields -------------------------------------------------------
def test_upstream_import_paths():
    import vllm.logprobs
    import vllm.outputs
    import vllm.sequence

    assert vllm.sequence.Logprob is vllm.logprobs.Logprob is vllm.outputs.Logprob
    for name in ("PromptLogprobs", "SampleLogprobs", "LogprobsOnePosition"):
        assert getattr(vllm.sequence, name) is getattr(vllm.logprobs, name)
    assert vllm.logprobs.create_prompt_logprobs() == [None]
    assert vllm.logprobs.create_sample_logprobs() == []
    with pytest.raises(ValueError, match="flat_logprobs"):
        vllm.logprobs.create_sample_logprobs(flat_logprobs=True)
    lp = vllm.logprobs.Logprob(-1.5)
    assert (lp.logprob, lp.rank, lp.decoded_token) == (-1.5, None, None)


def test_outputs_carry_upstreams_fields():
    c = CompletionOutput(0, "x", [5], -0.5, None, "stop", None)
    assert c.lora_request is None and c.kv_transfer_params is None and c.finished()
    # upstream's positional order: ..., finished, metrics, lora_request, encoder_prompt,
    # encoder_prompt_token_ids, num_cached_tokens
    out = RequestOutput("r", "p", [1, 2], None, [c], True, None, None, None, None, 7)
    assert out.num_cached_tokens == 7 and out.metrics is None
    assert (out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids,
            out.kv_transfer_params) == (None, None, None, None)
    assert out.multi_modal_placeholders == {}
    names = [f.name for f in dataclasses.fields(RequestOutput)]
    assert names[:11] == ["request_id", "prompt", "prompt_token_ids", "prompt_logprobs",
                          "outputs", "finished", "metrics", "lora_request", "encoder_prompt",
                          "encoder_prompt_token_ids", "num_cached_tokens"]


def test_request_output_add():
    def delta(text, ids, finish=None):
        return RequestOutput("r", None, [1], None, [CompletionOutput(
            0, text, ids, None, [{i: Logprob(-1.0)} for i in ids], finish)], finish is not None)

    out = delta("a", [4])
    out.add(delta("bc", [5, 6], "length"), aggregate=True)
    c = out.outputs[0]
    assert (c.text, c.token_ids, len(c.logprobs), c.finish_reason, out.finished) == \
        ("abc", [4, 5, 6], 3, "length", True)
    out.add(delta("z", [9], "stop"), aggregate=False)
    assert out.outputs[0].text == "z"


def test_engine_outputs_have_the_fields():
    """What the engine's output processor builds has them too."""
    from vllm.engine.output_processor import OutputProcessor
    from vllm.sampling_params import SamplingParams

    proc = OutputProcessor(FakeTokenizer())
    params = SamplingParams(max_tokens=2)
    proc.add_request("q", "ab", [1, 4, 5], params, ["q"], [params])
    state = proc.requests["q"]
    made = state.make_output()
    assert made.lora_request is None and made.multi_modal_placeholders == {}
    assert made.outputs[0].lora_request is None


# ---- CLI help and README ------------------------------------------------------------------
def test_serve_help_lists_config(capsys):
    from vllm.entrypoints.cli.main import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert "--config FILE.yaml" in help_text and "YAML" in help_text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    assert "--config" not in capsys.readouterr().out  # (the subcommands take it)


def test_serve_config_file_still_applies(tmp_path):
    from vllm.entrypoints.cli.main import build_parser

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 9001\nreturn-tokens-as-token-ids: true\n")
    args = build_parser().parse_args(["serve", "demo", "--config", str(cfg)])
    assert args.port == 9001 and args.return_tokens_as_token_ids
    assert args.config is None  # (the file's options were spliced in; nothing else to read)


def test_readme_says_how_to_get_the_cpu_build_of_torch():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    setup = readme.index("python3 -m pip install torch==2.13.0 && python3 -m pip install -e .")
    note = readme.index("--index-url https://download.pytorch.org/whl/cpu")
    assert setup < note < readme.index("bash scripts/run_tests.sh")
    assert "/v1/responses" in readme


# ---- the real engine ----------------------------------------------------------------------
@pytest.mark.slow
def test_real_engine_echo_scoring_and_responses(llama_path):
    """Echo-only scoring returns the same prompt logprobs as prompt_logprobs=1 on a normal
    request, also for a prompt that fills max_model_len; /v1/responses returns the chat
    completion's text for the same conversation."""
    from vllm.engine.arg_utils import EngineArgs

    max_len = 64
    engine = AsyncLLM.from_engine_args(EngineArgs(model=llama_path, optimization_level=0,
                                                  max_model_len=max_len))
    try:
        with serve_in_thread(build_app(engine, [MODEL])) as base:
            ids = [(7 * i) % 200 + 3 for i in range(max_len)]
            full = post(base, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True,
                                                  "logprobs": 1}).json()
            (choice,) = full["choices"]
            assert choice["finish_reason"] == "length"
            assert full["usage"]["completion_tokens"] == 0
            lp = choice["logprobs"]["token_logprobs"]
            assert len(lp) == max_len and lp[0] is None
            assert all(isinstance(x, float) for x in lp[1:])
            short = ids[:20]
            ref = post(base, "/v1/completions", {
                "prompt": short, "max_tokens": 1, "prompt_logprobs": 1}).json()
            ref_lp = [None] + [e[str(t)]["logprob"] for e, t in
                               zip(ref["choices"][0]["prompt_logprobs"][1:], short[1:])]
            echo = post(base, "/v1/completions", {"prompt": short, "max_tokens": 0,
                                                  "echo": True, "logprobs": 1}).json()
            got = echo["choices"][0]["logprobs"]["token_logprobs"]
            assert got[0] is None
            assert got[1:] == pytest.approx(ref_lp[1:], abs=1e-5)
            assert got[1:] == pytest.approx(lp[1:20], abs=1e-4)  # (same prefix)
            assert post(base, "/v1/completions", {"prompt": ids + [5], "max_tokens": 0,
                                                  "echo": True}).status_code == 400
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
            chat = client.chat.completions.create(model=MODEL, messages=messages,
                                                  max_tokens=8, temperature=0)
            resp = client.responses.create(model=MODEL, instructions="sys", input="hi",
                                           max_output_tokens=8, temperature=0)
            assert resp.output_text == chat.choices[0].message.content
            assert resp.usage.input_tokens == chat.usage.prompt_tokens
            assert resp.usage.output_tokens == chat.usage.completion_tokens
            streamed = "".join(e.delta for e in client.responses.create(
                model=MODEL, instructions="sys", input="hi", max_output_tokens=8,
                temperature=0, stream=True) if e.type == "response.output_text.delta")
            assert streamed == resp.output_text
    finally:
        engine.shutdown()
