"""Decode speed with TP=1, PP=2 and TP=2 (and any other layouts), side by side in one run.

One engine per layout (all alive at once: Ray actors for every layout, TP=1 included, so each
pays the same per-step dispatch; with --backend mp only one multi-rank layout fits a process,
as mp's rank 0 lives in it), then rounds: in each
round every engine, in turn, generates `--batch` greedy requests of `--tokens` tokens and of
1 token; decode tok/s = batch x (tokens - 1) / (t_tokens - t_1) (the prefill subtracted).
The layouts interleave round by round so that a shared machine's load hits them alike; the
result per layout is the median over rounds, and its ratio to the first layout.

Pipeline parallelism runs each step's whole batch stage by stage by default; with
VLLM_PP_MICRO_BATCHES=N it cuts the batch into N micro-batches that flow through the stages
within the step, so that the stages overlap: the PP2-mb2 layout (2 micro-batches in its
workers) compares the two.

    python benchmarks/bench_pp.py                                # demo model, smoke size
    python benchmarks/bench_pp.py --model /path/qwen2.5-0.5b --batch 16 --tokens 64 --rounds 10
Results: benchmarks/results/<--name>.md and .json.
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


def parse_layout(text: str) -> tuple[str, int, int, int | None]:
    """NAME=TPxPP[xMICRO] -> (name, tp, pp, micro-batches or None for the default)."""
    name, _, shape = text.partition("=")
    parts = [int(p) for p in shape.split("x")]
    return name, parts[0], parts[1], parts[2] if len(parts) > 2 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--layout", action="append", default=None,
                        help="NAME=TPxPP[xMICRO_BATCHES], repeatable (default TP1=1x1 "
                        "PP2=1x2 PP2-mb2=1x2x2 TP2=2x1).")
    parser.add_argument("--backend", default="ray", choices=["mp", "ray"])
    parser.add_argument("--level", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="pp_decode")
    args = parser.parse_args()
    layouts = [parse_layout(t) for t in args.layout or ["TP1=1x1", "PP2=1x2", "PP2-mb2=1x2x2",
                                                        "TP2=2x1"]]
    if args.backend == "mp" and sum(tp * pp > 1 for _, tp, pp, _ in layouts) > 1:
        parser.error("--backend mp: at most one multi-rank layout (rank 0 lives in this "
                     "process); use --backend ray")

    from vllm import LLM, SamplingParams

    if args.backend == "ray":
        import ray

        # Logical CPUs: every layout's ranks at once (the machine's cores are shared anyway).
        ray.init(num_cpus=sum(tp * pp for _, tp, pp, _ in layouts), logging_level="warning")
    engines, startup = {}, {}
    for name, tp, pp, micro in layouts:
        start = time.perf_counter()
        backend = "uni" if tp * pp == 1 and args.backend == "mp" else args.backend
        if micro is not None:
            os.environ["VLLM_PP_MICRO_BATCHES"] = str(micro)  # (the actors copy it)
        else:
            os.environ.pop("VLLM_PP_MICRO_BATCHES", None)
        engines[name] = LLM(model=args.model, optimization_level=args.level,
                            tensor_parallel_size=tp, pipeline_parallel_size=pp,
                            distributed_executor_backend=backend, max_model_len=512,
                            kv_cache_memory="64MiB")
        startup[name] = time.perf_counter() - start
    os.environ.pop("VLLM_PP_MICRO_BATCHES", None)
    prompts = [f"Request {i}: the pipeline stages pass hidden states" for i in range(args.batch)]
    full = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    outputs, rates = {}, {name: [] for name in engines}
    for llm in engines.values():  # warm every engine once
        llm.generate(prompts, full, use_tqdm=False)
    for _ in range(args.rounds):
        for name, llm in engines.items():
            t0 = time.perf_counter()
            llm.generate(prompts, one, use_tqdm=False)
            t1 = time.perf_counter()
            outs = llm.generate(prompts, full, use_tqdm=False)
            t2 = time.perf_counter()
            decode = (t2 - t1) - (t1 - t0)
            rates[name].append(args.batch * (args.tokens - 1) / max(decode, 1e-9))
            outputs[name] = [list(o.outputs[0].token_ids) for o in outs]
    first = layouts[0][0]
    same = {name: outputs[name] == outputs[first] for name in engines}
    result = {"model": args.model, "level": args.level, "backend": args.backend,
              "batch": args.batch, "tokens": args.tokens, "rounds": args.rounds,
              "cpus": os.cpu_count(), "layouts": {
                  name: {"tp": tp, "pp": pp, "startup_s": round(startup[name], 2),
                         "decode_tok_s_median": round(statistics.median(rates[name]), 2),
                         "decode_tok_s": [round(r, 2) for r in rates[name]],
                         "ratio_to_first": round(statistics.median(rates[name])
                                                 / statistics.median(rates[first]), 3),
                         "greedy_equal_to_first": same[name]}
                  for name, tp, pp, _ in layouts}}
    lines = [f"# Decode tok/s by layout ({args.model}, -O{args.level}, {args.backend}, batch "
             f"{args.batch}, {args.tokens} tokens, {args.rounds} interleaved rounds, "
             f"{os.cpu_count()} CPUs)", "",
             "PP runs each step's whole batch stage by stage unless the layout says "
             "(PP2-mb2: the batch cut into 2 micro-batches that overlap in the stages).", "",
             "| layout | TP | PP | start-up s | decode tok/s (median) | vs first "
             "| greedy = first |",
             "|---|---|---|---|---|---|---|"]
    for name, tp, pp, _ in layouts:
        r = result["layouts"][name]
        lines.append(f"| {name} | {tp} | {pp} | {r['startup_s']} | {r['decode_tok_s_median']} "
                     f"| {r['ratio_to_first']} | {r['greedy_equal_to_first']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = os.path.join(HERE, "results", args.name)
    with open(out + ".md", "w") as f:
        f.write(text)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    for llm in engines.values():
        llm.llm_engine.shutdown()
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
