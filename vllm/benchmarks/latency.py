"""Latency of one batch: prefill time and per-token decode time at one optimization level.

Starts one engine (`--model`, `-O`, any engine flag), then runs `--num-iters-warmup` and
`--num-iters` times a batch of `--batch-size` requests of `--input-len` random prompt tokens
generating exactly `--output-len` tokens each (greedy, EOS ignored, prefix cache off so every
iteration prefills). One engine step is timed at a time: the steps that process prompt
tokens are the prefill, each later step (one new token for every request) is one decode step.
Reports the median over iterations of the prefill time and of the mean decode-step time,
with their spread, and writes them as JSON with `--output-json`, with upstream's keys too:
`avg_latency`, `latencies` (seconds per whole batch) and `percentiles` (10 ... 99).

    vllm bench latency --model demo -O2 --batch-size 16 --input-len 32 --output-len 64
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from vllm.benchmarks.offline import add_offline_args, random_prompts, start_engine


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = add_offline_args(parser, "latency benchmark")
    group.add_argument("--batch-size", type=int, default=8, help="Requests in the batch.")
    group.add_argument("--num-iters-warmup", type=int, default=1,
                       help="Untimed batches first (lazy per-size work, caches).")
    group.add_argument("--num-iters", type=int, default=3, help="Timed batches.")
    return parser


PERCENTILES = (10, 25, 50, 75, 90, 99)


def _percentile(values: list[float], p: float) -> float:
    """The p-th percentile, linearly interpolated between the sorted values (numpy's)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * p / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "spread": max(values) - min(values)}


def run_batch(engine: Any, batch: list[list[int]], output_len: int) -> tuple[float, list[float]]:
    """(prefill seconds, [seconds of each decode step]) for one batch run to completion."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    tag = f"{time.perf_counter_ns()}"
    for i, prompt in enumerate(batch):
        engine.add_request(f"lat-{tag}-{i}", {"prompt_token_ids": prompt}, params)
    prefill, decode = 0.0, []
    while engine.has_unfinished_requests():
        prompts_left = any(r.num_computed_tokens < r.num_prompt_tokens
                           for r in engine.scheduler.requests.values())
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if prompts_left:
            prefill += elapsed
        else:
            decode.append(elapsed)
    return prefill, decode


def main(args: argparse.Namespace) -> int:
    engine, startup = start_engine(args)
    rng = random.Random(args.seed)

    def batch() -> list[list[int]]:
        return random_prompts(rng, engine.vocab_size, args.batch_size, args.input_len)

    for _ in range(args.num_iters_warmup):
        run_batch(engine, batch(), args.output_len)
    prefills, decodes, latencies = [], [], []
    for _ in range(args.num_iters):
        prefill, steps = run_batch(engine, batch(), args.output_len)
        prefills.append(prefill)
        decodes.append(statistics.mean(steps) if steps else float("nan"))
        latencies.append(prefill + sum(steps))
    level = int(engine.vllm_config.optimization_level)
    result = {
        "model": args.model, "optimization_level": level, "batch_size": args.batch_size,
        "input_len": args.input_len, "output_len": args.output_len,
        "num_iters": args.num_iters, "startup_seconds": startup,
        "prefill_seconds": _summary(prefills), "decode_step_seconds": _summary(decodes),
        "decode_tokens_per_second": args.batch_size / statistics.median(decodes),
        "compilation_config": _compilation_summary(engine.vllm_config),
        # upstream `vllm bench latency`'s keys: the whole batch, prefill to last token
        "avg_latency": statistics.mean(latencies), "latencies": latencies,
        "percentiles": {str(p): _percentile(latencies, p) for p in PERCENTILES},
    }
    print(f"-O{level} batch {args.batch_size}, input {args.input_len}, output "
          f"{args.output_len}, {args.num_iters} iterations (median [min, max]):")
    for name, key in (("prefill", "prefill_seconds"), ("decode step", "decode_step_seconds")):
        s = result[key]
        print(f"  {name:<12} {1e3 * s['median']:9.2f} ms  [{1e3 * s['min']:.2f}, "
              f"{1e3 * s['max']:.2f}]")
    print(f"  decode       {result['decode_tokens_per_second']:9.1f} tokens/s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    engine.shutdown()
    return 0


def _compilation_summary(vllm_config: Any) -> dict[str, Any]:
    cc = vllm_config.compilation_config
    return {"mode": cc.mode.name, "backend": cc.backend, "freezing": cc.freezing,
            "max_autotune": cc.max_autotune,
            "coordinate_descent_tuning": cc.coordinate_descent_tuning,
            "cpp_wrapper": cc.cpp_wrapper, "compile_sizes": list(cc.compile_sizes or [])}
