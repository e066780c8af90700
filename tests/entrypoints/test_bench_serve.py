"""`vllm bench serve` against the OpenAI server over a fake engine (fast)."""
from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from server_utils import serve_in_thread

from vllm.benchmarks.serve import RequestResult, summarize
from vllm.engine.async_llm import AsyncLLM
from vllm.entrypoints.cli.main import main as vllm_main
from vllm.entrypoints.openai.api_server import build_app


@pytest.fixture(scope="module")
def url():
    engine = AsyncLLM(FakeEngine(max_model_len=256, num_blocks=512, step_delay=0.001))
    with serve_in_thread(build_app(engine, ["fake"])) as base:
        yield base
    engine.shutdown()


@pytest.mark.parametrize("backend", ["vllm", "openai-chat"])
def test_bench_serve_cli(url, tmp_path, capsys, backend):
    out = tmp_path / "result.json"
    code = vllm_main(["bench", "serve", "--base-url", url, "--backend", backend,
                      "--num-prompts", "12", "--random-input-len", "16",
                      "--random-output-len", "10", "--random-range-ratio", "0.5",
                      "--max-concurrency", "4", "--ignore-eos", "--output-json", str(out),
                      "--metric-percentiles", "50,90,99"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Output token throughput" in printed
    assert "P99 TTFT (ms)" in printed and "Median ITL (ms)" in printed
    result = json.loads(out.read_text())
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["model"] == "fake"
    # Output lengths are drawn from [5, 15] and counted from the server's usage.
    assert 12 * 5 <= result["total_output_tokens"] <= 12 * 15
    for key in ("mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p50_e2el_ms",
                "request_throughput", "output_throughput"):
        assert result[key] > 0, key


def test_bench_serve_request_rate(url, tmp_path):
    out = tmp_path / "r.json"
    code = vllm_main(["bench", "serve", "--base-url", url, "--num-prompts", "6",
                      "--random-input-len", "8", "--random-output-len", "4",
                      "--request-rate", "50", "--burstiness", "2", "--ignore-eos",
                      "--output-json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["total_output_tokens"] == 24


def test_bench_serve_reports_failures(url, capsys):
    # 300 output tokens do not fit max_model_len=256: every request gets a 400.
    code = vllm_main(["bench", "serve", "--base-url", url, "--num-prompts", "2",
                      "--random-input-len", "8", "--random-output-len", "300"])
    assert code == 1
    assert "HTTP 400" in capsys.readouterr().out


def test_bench_serve_without_a_server_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as info:
        vllm_main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"])
    assert info.value.code == 2
    assert "cannot query http://127.0.0.1:9/v1/models" in capsys.readouterr().err


def test_summarize_percentiles():
    results = [RequestResult(success=True, input_len=4, output_len=3, ttft=0.1 * i,
                             latency=0.1 * i + 0.2, itl=[0.1, 0.1]) for i in range(1, 5)]
    results.append(RequestResult(success=False, error="HTTP 400"))
    s = summarize(results, 2.0, ["ttft", "tpot", "itl", "e2el"], [50, 99])
    assert s["completed"] == 4 and s["failed"] == 1 and s["errors"] == ["HTTP 400"]
    assert s["total_output_tokens"] == 12 and s["output_throughput"] == 6.0
    assert s["median_ttft_ms"] == pytest.approx(250.0)
    assert s["p50_ttft_ms"] == pytest.approx(250.0)
    assert s["mean_tpot_ms"] == pytest.approx(100.0)
    assert s["p99_itl_ms"] == pytest.approx(100.0)


# ---- servers that take only text and send no usage (llama.cpp's, llama-cpp-python) ---------

@pytest.fixture(scope="module")
def text_only_server():
    """A stand-in for llama-cpp-python's server: text prompts only (token ids are a 422),
    one streamed chunk per generated token, no usage, no ignore_eos (min_tokens instead)."""
    app = FastAPI()
    bodies: list[dict] = []

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "x.gguf", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        bodies.append(body)
        if not isinstance(body["prompt"], str):
            return JSONResponse({"error": "prompt must be a string"}, status_code=422)
        count = max(int(body.get("min_tokens", 0)), 1)  # stops "early" without min_tokens

        def stream():
            for i in range(count):  # every third token decodes to nothing (random weights)
                text = "" if i % 3 == 1 else f" w{i % 7}"
                chunk = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            end = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
            yield f"data: {json.dumps(end)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    with serve_in_thread(app) as base:
        yield base, bodies


def test_bench_serve_text_prompts_min_tokens_and_extra_body(text_only_server, tmp_path):
    base, bodies = text_only_server
    bodies.clear()
    out = tmp_path / "r.json"
    code = vllm_main(["bench", "serve", "--base-url", base, "--num-prompts", "5",
                      "--random-input-len", "8", "--random-output-len", "6", "--ignore-eos",
                      "--tokenizer", "vllm/demo_model", "--text-prompts",
                      "--extra-body", '{"repeat_penalty": 1.0}', "--output-json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 5 and result["failed"] == 0
    assert all(isinstance(b["prompt"], str) for b in bodies)
    assert all(b["min_tokens"] == b["max_tokens"] == 6 and b["repeat_penalty"] == 1.0
               for b in bodies)
    # No usage: one streamed chunk per token
    assert result["total_output_tokens"] == 5 * 6


def test_bench_serve_counts_chunks_without_usage(text_only_server, tmp_path):
    base, _ = text_only_server
    out = tmp_path / "r.json"
    code = vllm_main(["bench", "serve", "--base-url", base, "--num-prompts", "3",
                      "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos",
                      "--output-json", str(out)])
    assert code == 0
    assert json.loads(out.read_text())["total_output_tokens"] == 3 * 4


def test_bench_serve_token_id_prompts_fail_on_a_text_only_server(text_only_server, tmp_path):
    base, _ = text_only_server
    out = tmp_path / "r.json"
    vllm_main(["bench", "serve", "--base-url", base, "--num-prompts", "2",
               "--random-input-len", "8", "--random-output-len", "4",
               "--tokenizer", "vllm/demo_model", "--output-json", str(out)])
    assert json.loads(out.read_text())["failed"] == 2


def test_bench_serve_extra_body_must_be_an_object(url, capsys):
    with pytest.raises(SystemExit) as exc:
        vllm_main(["bench", "serve", "--base-url", url, "--num-prompts", "1",
                   "--random-input-len", "4", "--random-output-len", "2",
                   "--extra-body", "[1, 2]"])
    assert exc.value.code == 2
    assert "--extra-body must be a JSON object" in capsys.readouterr().err
