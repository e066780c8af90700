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
