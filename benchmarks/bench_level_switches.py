"""Decode speed of the compiled model per level and per switch, side by side in one process.

Builds one engine per configuration (a level plus optional `-cc` overrides), then times
decode-shaped forwards of the model alone (every request one new token; attention metadata
built once) at each batch size, the configurations interleaved round by round so that the
load of a shared machine hits them alike. A round runs `--block` calls of each configuration
and keeps the fastest; the result is, per pair (A, B), the median over rounds of time(B) /
time(A), i.e. how much faster A is, with the quartiles.

    python benchmarks/bench_level_switches.py                     # demo model: O0, O1, O2
    python benchmarks/bench_level_switches.py --config O2=2 \\
        --config 'O2+sizes=2:{"compile_sizes":[1,2,4,8,16]}' --pair O2+sizes,O2
The figures behind the CPU choices in vllm/config/levels.py and vllm/platforms/cpu.py come
from this script (benchmarks/results/cpu_levels.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def parse_config(text: str) -> tuple[str, int, dict]:
    """NAME=LEVEL[:JSON] -> (name, level, compilation_config overrides)."""
    name, _, rest = text.partition("=")
    level, _, overrides = rest.partition(":")
    return name, int(level), json.loads(overrides) if overrides else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--config", action="append", default=None,
                        help="NAME=LEVEL[:JSON overrides]; repeatable (default O0, O1, O2).")
    parser.add_argument("--pair", action="append", default=None,
                        help="A,B: report how much faster A is than B (default: O1,O0 O2,O1 "
                        "O2,O0).")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    configs = [parse_config(c) for c in args.config or ["O0=0", "O1=1", "O2=2"]]
    pairs = [tuple(p.split(",")) for p in args.pair or ["O1,O0", "O2,O1", "O2,O0"]]
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")

    import torch

    from vllm import LLM
    from vllm.forward_context import set_forward_context

    def decode_forward(runner, batch: int):
        bs = runner.block_size
        metadata = runner.attn_metadata_builder.build(
            [1] * batch, [8] * batch, [[0]] * batch, [i % bs for i in range(batch)],
            num_padded_tokens=None, device=runner.device)
        ids, pos = runner.input_buffers.commit_tokens(0, batch)

        def run():
            with set_forward_context(metadata, runner.vllm_config,
                                     attn_layers=runner.attention_layers):
                return runner.model(ids, pos)
        return run

    fns, startup = {}, {}
    for name, level, overrides in configs:
        start = time.perf_counter()
        llm = LLM(model=args.model, optimization_level=level, compilation_config=overrides,
                  max_model_len=512, kv_cache_memory="64MiB")
        startup[name] = time.perf_counter() - start
        runner = llm.llm_engine.executor.worker.model_runner
        with torch.inference_mode():
            for batch in sizes:
                fns[name, batch] = decode_forward(runner, batch)
                for _ in range(5):
                    fns[name, batch]()
        print(f"built {name} (-O{level} {overrides}) in {startup[name]:.1f} s", flush=True)
    times: dict = {key: [] for key in fns}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for batch in sizes:
                for name, _, _ in configs:
                    fn, best = fns[name, batch], float("inf")
                    for _ in range(args.block):
                        start = time.perf_counter()
                        fn()
                        best = min(best, time.perf_counter() - start)
                    times[name, batch].append(best)
    result = {"model": args.model, "threads": torch.get_num_threads(), "startup_s": startup,
              "median_ms": {f"{n} b{b}": 1e3 * statistics.median(v)
                            for (n, b), v in times.items()},
              "speedups": {}}
    for a, b in pairs:
        for batch in sizes:
            ratios = sorted(tb / ta for ta, tb in zip(times[a, batch], times[b, batch]))
            q = len(ratios) // 4
            result["speedups"][f"{a} vs {b} b{batch}"] = {
                "median": statistics.median(ratios), "q25": ratios[q], "q75": ratios[-q - 1]}
    for key, value in result["median_ms"].items():
        print(f"{key:<28} {value:8.3f} ms")
    for key, s in result["speedups"].items():
        print(f"{key:<28} x{s['median']:.2f} (quartiles {s['q25']:.2f}-{s['q75']:.2f})")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
