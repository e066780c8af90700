"""benchmarks/bench_serve_levels.py's thread-vs-process table: the median round is reported and
the ratio lines compare the right configurations (no server is started)."""
from __future__ import annotations

import argparse
import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_serve_levels", os.path.join(REPO, "benchmarks", "bench_serve_levels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(mode: str, level: int, tput: float, itl: float = 5.0) -> dict:
    return {"mode": mode, "level": level, "output_throughput": tput, "request_throughput": 1.0,
            "total_output_tokens": 256,
            "startup_to_healthy_s": 3.0, "median_ttft_ms": 20, "p90_ttft_ms": 30,
            "p99_ttft_ms": 40, "median_itl_ms": itl, "p90_itl_ms": itl, "p99_itl_ms": itl,
            "mean_tpot_ms": itl, "failed": 0}


def test_median_round_is_kept_with_every_rounds_throughput(bench):
    rounds = [_result("process", 2, t) for t in (300.0, 100.0, 200.0)]
    chosen = bench.median_rounds(rounds)
    assert chosen["output_throughput"] == 200.0
    assert chosen["rounds_output_throughput"] == [300.0, 100.0, 200.0]


def test_modes_table_ratios(bench):
    args = argparse.Namespace(model="demo", num_prompts=8, input_len=8, output_len=8,
                              range_ratio=0.5, request_rate=float("inf"), max_concurrency=16,
                              compile_cache="off", rounds=1, note=None)
    results = [bench.median_rounds([r]) for r in (
        _result("thread", 0, 100.0, 10.0), _result("thread", 2, 110.0, 9.0),
        _result("process", 0, 120.0, 8.0), _result("process", 2, 240.0, 4.0))]
    table = bench.modes_markdown(results, args)
    assert "| process | O2 | 3.0 | 240.0 (240) |" in table
    assert "thread: O2 vs O0 output throughput x1.10" in table
    assert "process: O2 vs O0 output throughput x2.00" in table
    assert "O2: process vs thread output throughput x2.18, ITL p50 x0.44" in table


def test_llamacpp_server_row_and_ratios(bench):
    """With --llamacpp, llama.cpp's server is a row of its own and every configuration of ours
    is compared with it; our level ratios still use our first level as the base."""
    args = argparse.Namespace(model="m", num_prompts=8, input_len=8, output_len=8,
                              range_ratio=0.5, request_rate=float("inf"), max_concurrency=16,
                              compile_cache="off", rounds=1, note=None)
    llama = dict(_result(None, bench.LLAMACPP, 50.0, 20.0), name="llama.cpp",
                 startup_phases={}, warmup_s=1.0, mean_ttft_ms=25)
    ours = [dict(_result(None, level, tput, itl), startup_phases={}, warmup_s=1.0,
                 mean_ttft_ms=25) for level, tput, itl in ((0, 80.0, 10.0), (2, 150.0, 5.0))]
    results = [bench.median_rounds([r]) for r in [llama, *ours]]
    table = bench.markdown(results, args) + bench.llamacpp_lines(results)
    assert "| llama.cpp | 3.0 | - |" in table
    assert "O2 vs O0: output throughput x1.88" in table
    assert "O0 vs llama.cpp server: output throughput x1.60" in table
    assert "O2 vs llama.cpp server: output throughput x3.00, TTFT p50 20 vs 20 ms, ITL p50 " \
           "5.0 vs 20.0 ms" in table
    assert "vs llama.cpp: output" not in table.split("llama.cpp server")[0]
    assert "not comparable" not in table
    short = dict(llama, total_output_tokens=100)  # interrupted requests: fewer tokens
    assert "generated 100 of the 256 output tokens asked for" in bench.llamacpp_lines(
        [bench.median_rounds([short]), *results[1:]])
