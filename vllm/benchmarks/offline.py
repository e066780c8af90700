"""What the offline benchmarks (latency, throughput) share: their common flags, one engine
started from them, and random token prompts."""
from __future__ import annotations

import argparse
import random
import time
from typing import Any


def add_offline_args(parser: argparse.ArgumentParser, title: str) -> Any:
    """EngineArgs' flags plus --input-len, --output-len and --output-json (the prefix cache
    off by default, so every prompt is prefilled); returns the benchmark's flag group."""
    from vllm.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser)
    group = parser.add_argument_group(title)
    group.add_argument("--input-len", type=int, default=32, help="Prompt tokens per request.")
    group.add_argument("--output-len", type=int, default=64,
                       help="Generated tokens per request (the first comes with the prefill).")
    group.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    parser.set_defaults(enable_prefix_caching=False)
    return group


def start_engine(args: argparse.Namespace) -> tuple[Any, float]:
    """(an LLMEngine built from the flags, without periodic stat logs; its start-up seconds)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.engine.llm_engine import LLMEngine

    engine_args = EngineArgs.from_cli_args(args)
    engine_args.disable_log_stats = True
    start = time.perf_counter()
    engine = LLMEngine.from_engine_args(engine_args)
    return engine, time.perf_counter() - start


def random_prompts(rng: random.Random, vocab_size: int, count: int,
                   length: int) -> list[list[int]]:
    """`count` prompts of `length` token ids drawn from [3, vocab_size) (past the usual
    special tokens)."""
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]
