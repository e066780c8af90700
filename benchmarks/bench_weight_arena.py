"""Batch-1 decode with the weights carved from one huge-page arena against one mapping per tensor.

The loader carves every CPU parameter from a `HugePageArena` (vllm/utils/hugepages.py): small
weights and the tails of large ones sit in 2 MiB pages too. Before, each tensor of 2 MiB or
more had a mapping of its own with only its whole huge pages advised, and smaller ones were in
torch's allocator: 4 KiB pages. This benchmark loads one engine (`LLM`, -O2 by default) on a
random-weight checkpoint of benchmarks/checkpoints.py, copies every parameter into the old
layout (`cpu_zeros` per tensor) and, round by round in random order, points the parameters at
one layout or the other (`param.data`) and times a batch-1 decode of `--tokens` tokens (the
median step). Paired in one process, so the host's memory speed moves both alike; the ratio is
the median over rounds of arena / per-tensor step time.

Batch 1 only: its products read the plain weights (the small-M kernel). Batched products read
the panel copies prepacked for the loaded weights, which a swapped parameter no longer finds.

    python benchmarks/bench_weight_arena.py --shape llama-50m --rounds 8
    python benchmarks/bench_weight_arena.py --isa avx2 ...   # as on an AVX2-only CPU
    python benchmarks/bench_weight_arena.py --shape demo --rounds 1 --tokens 8  # smoke

Results: benchmarks/results/<out>.md and .json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_vs_llamacpp import AVX2_ENV, steady_llm  # noqa: E402  (AVX2_ENV: --isa avx2)

LAYOUTS = ("arena", "per_tensor")


def in_huge_pages_share(params: list) -> float:
    """The share of the parameters' bytes in whole 2 MiB pages advised for huge pages, as
    `cpu_zeros` and the arena advise them (what the kernel then backs is the machine's)."""
    from vllm.utils.hugepages import HUGE_PAGE_BYTES

    total = advised = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        total += nbytes
        storage = p.untyped_storage()
        if storage.resizable():  # torch's allocator: not advised
            continue
        if storage.nbytes() == nbytes + HUGE_PAGE_BYTES:  # a mapping of its own (cpu_zeros)
            advised += nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        else:  # carved from an arena mapping, advised whole
            advised += nbytes
    return advised / total if total else 0.0


def child(args: argparse.Namespace) -> None:
    """The measurement: one JSON line."""
    import torch

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.utils.hugepages import cpu_zeros, huge_pages_enabled

    torch.set_num_threads(args.threads)
    llm = steady_llm(model=args.path, dtype=args.dtype, optimization_level=args.level,
                     max_model_len=512, kv_cache_memory="512MiB", max_num_seqs=4)
    engine = llm.llm_engine
    model = engine.executor.worker.model_runner.model
    params = list(model.parameters())
    layouts = {"arena": [p.data for p in params], "per_tensor": []}
    with torch.no_grad():
        for p in params:
            layouts["per_tensor"].append(cpu_zeros(p.shape, p.dtype).copy_(p.data))
    shares = {}
    for name, tensors in layouts.items():
        for p, t in zip(params, tensors):
            p.data = t
        shares[name] = in_huge_pages_share(params)
    vocab = engine.vllm_config.model_config.get_vocab_size()
    prompt = [(vocab // 3 + 7 * i) % vocab for i in range(32)]

    def decode_step_ms(tag: str) -> float:
        engine.reset_prefix_cache()
        params_ = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True,
                                 output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(tag, {"prompt_token_ids": prompt}, params_)
        engine.step()  # the prefill
        steps = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        return statistics.median(steps) * 1e3

    decode_step_ms("warm-up")
    rng = random.Random(0)
    results: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for r in range(args.rounds):
        for name in rng.sample(LAYOUTS, len(LAYOUTS)):
            for p, t in zip(params, layouts[name]):
                p.data = t
            results[name].append(decode_step_ms(f"{name}-{r}"))
    print(json.dumps({"step_ms": results, "huge_page_share": shares,
                      "huge_pages_enabled": huge_pages_enabled(),
                      "isa": torch.ops.vllm_cpu_linear.isa()
                      if hasattr(torch.ops.vllm_cpu_linear, "isa") else "n/a"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-50m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("-O", "--level", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", choices=["native", "avx2"], default="native")
    parser.add_argument("--ckpt-root", default=os.path.join(HERE, "results", "tmp"))
    parser.add_argument("--out", default=None,
                        help="results name under benchmarks/results, or a path without suffix "
                             "(default weight_arena_<shape>_<dtype>[_as_avx2])")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    from checkpoints import model_path

    path = model_path(args.shape, args.ckpt_root)
    env = dict(os.environ)
    if args.isa == "avx2":
        env.update(AVX2_ENV)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--path", path,
           "--dtype", args.dtype, "--level", str(args.level), "--tokens", str(args.tokens),
           "--rounds", str(args.rounds), "--threads", str(args.threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"the measurement failed: {out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    steps = got["step_ms"]
    ratio = statistics.median(a / b for a, b in zip(steps["arena"], steps["per_tensor"]))
    share = got["huge_page_share"]
    lines = [f"# Batch-1 decode, weights in one huge-page arena vs one mapping per tensor, "
             f"{args.shape} {args.dtype} -O{args.level}", "",
             f"{datetime.date.today()}, {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} logical CPUs, {args.threads} threads, kernels built for "
             f"{got['isa']}" + (", run as on an AVX2-only CPU" if args.isa == "avx2" else "")
             + f"; huge pages {'on' if got['huge_pages_enabled'] else 'off (both layouts plain)'}"
             f"; one engine, the parameters swapped between the layouts each round (random "
             f"order), {args.rounds} rounds of a {args.tokens}-token decode after a 32-token "
             "prompt; the median step of each.", "",
             "| layout | share of the weights' bytes in advised huge pages | decode step, median "
             "over rounds (ms) | per round (ms) |", "|---|---|---|---|"]
    for name in LAYOUTS:
        lines.append(f"| {name} | {share[name]:.0%} | {statistics.median(steps[name]):.3f} | "
                     + ", ".join(f"{x:.2f}" for x in steps[name]) + " |")
    lines += ["", f"arena / per_tensor step time, median of the rounds' ratios: **{ratio:.3f}**"]
    name = args.out or (f"weight_arena_{args.shape}_{args.dtype}"
                        + ("_as_avx2" if args.isa == "avx2" else ""))
    base = name if os.sep in name else os.path.join(HERE, "results", name)
    os.makedirs(os.path.dirname(base), exist_ok=True)
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(base + ".json", "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("child", "path")},
                   **got, "ratio": ratio}, f, indent=1)
    print("\n".join(lines))
    print(f"wrote {base}.md and {base}.json")


if __name__ == "__main__":
    main()
