"""Where an engine step's time goes: prefill time, median decode step, and the decode step
split into linear layers, attention, sampling, other torch ops and Python/host time.

    python benchmarks/step_breakdown.py --shape llama-50m --dtype bfloat16 --batch 16

Runs our engine (at -O0 unless --level says otherwise) on a random-weight checkpoint of
benchmarks/checkpoints.py (same prompts as compare_hf.py; prefix cache reset before each run).
The split comes from one torch.profiler pass over the decode steps (self CPU time of each op,
grouped by name); the profiler's own overhead lands in the Python/host share, so read the
shares as relative.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CATEGORIES = {
    "linear": ("aten::mm", "aten::addmm", "vllm_cpu_linear", "_linear_pointwise", "aten::bmm"),
    "attention": ("attention", "write_and_attend", "index_select", "index_copy",
                  "scaled_dot_product"),
    "sampling": ("argmax", "topk", "sort", "exponential"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-50m",
                        help="a shape of benchmarks/checkpoints.py, or demo (the built-in model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ckpt-root", default=os.path.join(HERE, "results", "tmp"))
    parser.add_argument("--level", type=int, default=0, choices=range(4),
                        help="optimization level of the engine (default 0)")
    parser.add_argument("--top", type=int, default=0,
                        help="also list the N ops with the most self CPU time")
    args = parser.parse_args()

    import torch
    from checkpoints import write_checkpoint
    from compare_hf import prompts
    from torch.profiler import ProfilerActivity, profile

    from vllm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    # "demo": the built-in demo model
    path = "demo" if args.shape == "demo" else write_checkpoint(args.shape, args.ckpt_root)
    llm = LLM(model=path, dtype=args.dtype, optimization_level=args.level, max_model_len=512,
              kv_cache_memory="2GiB", max_num_seqs=max(args.batch, 1))
    engine = llm.llm_engine
    batch_prompts = prompts(args.batch, engine.vllm_config.model_config.get_vocab_size())
    counter = [0]

    def prefill() -> float:
        engine.reset_prefix_cache()
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        for i, p in enumerate(batch_prompts):
            engine.add_request(f"r{counter[0]}_{i}", {"prompt_token_ids": p}, params)
        counter[0] += 1
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    def decode() -> list[float]:
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return times

    prefill()
    decode()
    best_prefill = best_step = float("inf")
    for _ in range(args.repeats):
        best_prefill = min(best_prefill, prefill())
        steps = sorted(decode())
        best_step = min(best_step, steps[len(steps) // 2])
    prefill()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        num_steps = len(decode())
        wall = time.perf_counter() - start
    shares = dict.fromkeys([*CATEGORIES, "other torch ops"], 0.0)
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        category = next((c for c, keys in CATEGORIES.items()
                         if any(k in event.key for k in keys)), "other torch ops")
        shares[category] += seconds
    shares["python/host"] = wall - sum(shares.values())
    print(f"{args.shape} {args.dtype} -O{args.level} batch {args.batch}, {args.threads} thread(s): "
          f"prefill "
          f"{best_prefill * 1000:.0f} ms, decode step {best_step * 1000:.2f} ms (median, best of "
          f"{args.repeats}); profiled decode step {wall / num_steps * 1000:.2f} ms:")
    for category, seconds in shares.items():
        per_step = seconds / num_steps * 1000
        print(f"  {category:16s} {per_step:8.2f} ms  {seconds / wall * 100:5.1f}%")
    if args.top:
        print(f"top {args.top} ops by self CPU time per decode step:")
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        for event in events[:args.top]:
            print(f"  {event.self_cpu_time_total / num_steps / 1000:8.3f} ms  "
                  f"{event.count / num_steps:6.1f} calls  {event.key}")


if __name__ == "__main__":
    main()
