"""Offline throughput: requests and tokens per second for a batch of random prompts.

Starts one engine (`--model`, `-O`, any engine flag), adds `--num-prompts` requests of
`--input-len` random prompt tokens generating exactly `--output-len` tokens each (EOS
ignored, greedy; prefix cache off unless `--enable-prefix-caching`, so every prompt is
prefilled) all at once, and runs the engine until they are done, as upstream's
`vllm bench throughput` does with its random dataset. Prints requests/s, total tokens/s and
output tokens/s over the run (start-up excluded) and writes them with `--output-json`
(upstream's keys: elapsed_time, num_requests, total_num_tokens, requests_per_second,
tokens_per_second, plus output_tokens_per_second and the start-up time).

    vllm bench throughput --model demo -O2 --num-prompts 64 --input-len 32 --output-len 64
"""
from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from vllm.benchmarks.offline import add_offline_args, random_prompts, start_engine


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = add_offline_args(parser, "throughput benchmark")
    group.add_argument("--num-prompts", type=int, default=64, help="Requests in the run.")
    return parser


def run(engine: Any, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """(seconds from adding every request to the last one finishing, tokens generated)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    generated = 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"tput-{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                generated += sum(len(c.token_ids) for c in output.outputs)
    return time.perf_counter() - start, generated


def main(args: argparse.Namespace) -> int:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got "
                             f"{getattr(args, name)}")
    engine, startup = start_engine(args)
    prompts = random_prompts(random.Random(args.seed), engine.vocab_size, args.num_prompts,
                             args.input_len)
    try:
        elapsed, output_tokens = run(engine, prompts, args.output_len)
    finally:
        engine.shutdown()
    total_tokens = args.num_prompts * args.input_len + output_tokens
    result = {
        "model": args.model, "optimization_level": int(engine.vllm_config.optimization_level),
        "elapsed_time": elapsed, "num_requests": args.num_prompts,
        "total_num_tokens": total_tokens, "requests_per_second": args.num_prompts / elapsed,
        "tokens_per_second": total_tokens / elapsed,
        "output_tokens_per_second": output_tokens / elapsed, "startup_seconds": startup,
    }
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s "
          f"(-O{result['optimization_level']}, {args.num_prompts} prompts, "
          f"{elapsed:.2f} s; start-up {startup:.2f} s)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
