"""`vllm bench startup` and `vllm bench latency` run end to end with minimal settings and
write their JSON (fresh processes; marked slow)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

try:
    from tests.model_executor.hf_checkpoints import make_llama
except ImportError:  # tests/ itself on sys.path
    from model_executor.hf_checkpoints import make_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return make_llama(tmp_path_factory.mktemp("bench") / "llama")


def vllm(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", *argv],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_bench_commands_are_registered():
    from vllm.entrypoints.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "latency", "--model", "m", "-O1"])
    assert args.bench_type == "latency" and int(args.optimization_level) == 1
    args = parser.parse_args(["bench", "startup", "--model", "m", "-O1"])
    assert args.bench_type == "startup" and [int(x) for x in args.optimization_level] == [1]


def test_bench_help_keeps_the_example_commands_on_their_lines(capsys):
    from vllm.entrypoints.cli.main import main

    with pytest.raises(SystemExit):
        main(["bench", "startup", "--help"])
    assert "\n    vllm bench startup --model demo -O0 -O2\n" in capsys.readouterr().out


def test_bench_startup_measures_every_level_given(caplog):
    """`-O` may be repeated (each level is measured, no "last wins" warning); `--levels` too;
    the engine settings passed to each start leave the level to the start."""
    from vllm.benchmarks.startup import _engine_kwargs, _levels
    from vllm.entrypoints.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "startup", "--model", "m", "-O0", "-O2", "-O0",
                              "--max-model-len", "64"])
    assert _levels(args) == [0, 2]
    assert "duplicate" not in caplog.text
    kwargs = _engine_kwargs(args)
    assert kwargs["optimization_level"] is None and kwargs["max_model_len"] == 64
    assert _levels(parser.parse_args(["bench", "startup", "--model", "m"])) == [2]
    assert _levels(parser.parse_args(["bench", "startup", "--model", "m",
                                      "--levels", "1,3"])) == [1, 3]
    # Elsewhere -O stays a single value, the last one winning with a warning.
    args = parser.parse_args(["bench", "latency", "--model", "m", "-O0", "-O2"])
    assert int(args.optimization_level) == 2 and "duplicate" in caplog.text.lower()


def test_bench_startup_takes_upstreams_iteration_flags(monkeypatch):
    """--num-iters-cold / --num-iters-warmup / --num-iters-warm (upstream's names) next to
    --num-runs; the warm-up starts run on the warm cache and are not reported."""
    from vllm.benchmarks import startup
    from vllm.entrypoints.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "startup", "--model", "m", "--num-iters-cold", "2",
                              "--num-iters-warmup", "1", "--num-iters-warm", "3"])
    assert startup._iterations(args) == (2, 1, 3)
    args = parser.parse_args(["bench", "startup", "--model", "m", "--num-runs", "4"])
    assert startup._iterations(args) == (4, 0, 4)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "startup", "--model", "m", "--num-iters-warm", "0"])

    starts = []

    def fake_start(kwargs, cache_dir, inductor_dir, timeout):
        starts.append(cache_dir)
        return {"engine_seconds": float(len(starts)), "process_seconds": len(starts) + 0.5,
                "phases": {"weight loading": 0.1}, "cache": {}}

    monkeypatch.setattr(startup, "start_once", fake_start)
    result = startup.measure_level({}, 2, (2, 1, 3), 10.0, keep=False)
    assert len(starts) == 6
    assert [r["engine_seconds"] for r in result["runs"]["cold"]] == [1.0, 2.0]
    # start 3 is the untimed warm-up; the warm ones reuse the first cold run's caches
    assert [r["engine_seconds"] for r in result["runs"]["warm"]] == [4.0, 5.0, 6.0]
    assert set(starts[2:]) == {starts[0]}


@pytest.mark.slow
def test_bench_startup_cold_and_warm(llama, tmp_path):
    out_json = tmp_path / "startup.json"
    stdout = vllm("bench", "startup", "--model", llama, "-O0", "--num-runs", "1",
                  "--max-model-len", "64", "--kv-cache-memory", "16MiB",
                  "--output-json", str(out_json))
    result = json.loads(out_json.read_text())
    [level] = result["levels"]
    assert level["level"] == 0
    for kind in ("cold", "warm"):
        stats = level[kind]["engine_seconds"]
        assert 0 < stats["min"] <= stats["median"] <= stats["max"]
        assert level[kind]["process_seconds"]["median"] > stats["median"]
        assert level[kind]["phases"]["weight loading"] > 0
    assert "O0     cold" in stdout and "O0     warm" in stdout


@pytest.mark.slow
def test_bench_latency(llama, tmp_path):
    out_json = tmp_path / "latency.json"
    stdout = vllm("bench", "latency", "--model", llama, "-O0", "--batch-size", "2",
                  "--input-len", "8", "--output-len", "4", "--num-iters", "2",
                  "--num-iters-warmup", "1", "--max-model-len", "64",
                  "--kv-cache-memory", "16MiB", "--output-json", str(out_json))
    result = json.loads(out_json.read_text())
    assert result["optimization_level"] == 0 and result["batch_size"] == 2
    assert result["prefill_seconds"]["median"] > 0
    assert result["decode_step_seconds"]["median"] > 0
    assert result["decode_tokens_per_second"] > 0
    assert "decode step" in stdout
    # upstream's keys: whole-batch seconds per iteration, their mean and percentiles
    assert len(result["latencies"]) == 2
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 2)
    assert result["latencies"][0] > result["prefill_seconds"]["min"]
    assert list(result["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert min(result["latencies"]) <= result["percentiles"]["50"] <= max(result["latencies"])


def test_latency_percentiles_interpolate_like_numpy():
    import numpy as np

    from vllm.benchmarks.latency import PERCENTILES, _percentile

    values = [0.3, 0.1, 0.7, 0.2, 0.9]
    for p in PERCENTILES:
        assert _percentile(values, p) == pytest.approx(float(np.percentile(values, p)))


def test_bench_throughput(llama, tmp_path):
    """`vllm bench throughput` (upstream's offline benchmark, random prompts): every request
    runs to its output length; the JSON has upstream's keys and consistent rates."""
    out_json = tmp_path / "throughput.json"
    stdout = vllm("bench", "throughput", "--model", llama, "-O0", "--num-prompts", "6",
                  "--input-len", "8", "--output-len", "4", "--max-model-len", "64",
                  "--kv-cache-memory", "16MiB", "--output-json", str(out_json))
    result = json.loads(out_json.read_text())
    assert result["num_requests"] == 6 and result["total_num_tokens"] == 6 * (8 + 4)
    assert result["requests_per_second"] == pytest.approx(6 / result["elapsed_time"])
    assert result["tokens_per_second"] == pytest.approx(72 / result["elapsed_time"])
    assert "Throughput:" in stdout and "requests/s" in stdout
