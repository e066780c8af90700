"""Prefill with glibc's malloc keeping freed memory (vllm/utils/cpu_malloc.py) against without.

Each measurement is a fresh engine process (`LLM`, -O2 by default) on a random-weight
checkpoint of benchmarks/checkpoints.py that serves `--steps` rounds of a mixed load: 1-16
requests of 16-256 random prompt tokens (the same seeded sequence in every process), 4 new
tokens each; it reports the sum of the rounds' first steps (the prefill chunk, up to
max_num_batched_tokens tokens), the median later (decode) step, and the process's anonymous
resident memory at the end and at its peak. Variants, interleaved round by round:

  pad      the default (VLLM_CPU_MALLOC_TOP_PAD_MB unset: 1 GiB)
  no_pad   VLLM_CPU_MALLOC_TOP_PAD_MB=0 (glibc's own behaviour)

    python benchmarks/bench_malloc_pad.py --shape qwen2.5-0.5b --rounds 2
    python benchmarks/bench_malloc_pad.py --isa avx2 ...   # as on an AVX2-only CPU
    python benchmarks/bench_malloc_pad.py --shape demo -O 0 --steps 2 --rounds 1  # smoke

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
from process_memory import anon_rss_mb, peak_rss_mb  # noqa: E402

VARIANTS = {"pad": {}, "no_pad": {"VLLM_CPU_MALLOC_TOP_PAD_MB": "0"}}


def child(args: argparse.Namespace) -> None:
    """One engine process: one JSON line with its timings and memory."""
    import torch

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    torch.set_num_threads(args.threads)
    llm = steady_llm(model=args.path, dtype=args.dtype, optimization_level=args.level,
                     max_model_len=512, kv_cache_memory="1GiB", max_num_seqs=16)
    engine = llm.llm_engine
    vocab = engine.vllm_config.model_config.get_vocab_size()
    rng = random.Random(0)
    prefill, decode = [], []
    for step in range(args.steps):
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        for i in range(rng.randint(1, 16)):
            prompt = [rng.randrange(vocab // 8, vocab) for _ in range(rng.randint(16, 256))]
            engine.add_request(f"m{step}-{i}", {"prompt_token_ids": prompt}, params)
        start = time.perf_counter()
        engine.step()
        prefill.append(time.perf_counter() - start)
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            decode.append(time.perf_counter() - start)
    print(json.dumps({"prefill_s": sum(prefill), "decode_step_ms": statistics.median(decode) * 1e3,
                      "rss_anon_mb": anon_rss_mb(), "peak_rss_mb": peak_rss_mb()}))


def run_variant(args: argparse.Namespace, path: str, variant: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_MALLOC_TOP_PAD_MB"}
    env.update(VARIANTS[variant])
    if args.isa == "avx2":
        env.update(AVX2_ENV)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--path", path,
           "--dtype", args.dtype, "--level", str(args.level), "--steps", str(args.steps),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{variant} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("-O", "--level", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", choices=["native", "avx2"], default="native")
    parser.add_argument("--ckpt-root", default=os.path.join(HERE, "results", "tmp"))
    parser.add_argument("--out", default="malloc_pad",
                        help="results name under benchmarks/results, or a path without suffix")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    from checkpoints import model_path

    path = model_path(args.shape, args.ckpt_root)
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            got = run_variant(args, path, variant)
            results[variant].append(got)
            print(f"round {r + 1}/{args.rounds} {variant}: {got}", flush=True)

    def med(variant: str, key: str) -> float:
        return statistics.median(x[key] for x in results[variant])

    def ratio(key: str) -> float:  # pad / no_pad, paired by round
        return statistics.median(a[key] / b[key]
                                 for a, b in zip(results["pad"], results["no_pad"]))

    keys = [("prefill_s", "prefill steps, sum (s)"), ("decode_step_ms", "decode step, median (ms)"),
            ("rss_anon_mb", "anonymous resident memory at the end (MB)"),
            ("peak_rss_mb", "peak resident memory (MB)")]
    lines = [f"# Prefill with malloc keeping freed memory, {args.shape} {args.dtype} "
             f"-O{args.level}",
             "", f"{datetime.date.today()}, {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} logical CPUs, {args.threads} threads"
             + (", run as on an AVX2-only CPU" if args.isa == "avx2" else "")
             + f"; {args.steps} rounds of 1-16 requests x 16-256 prompt tokens, 4 new tokens each;"
             f" fresh process per variant, {args.rounds} interleaved rounds, medians.", "",
             "| measure | pad (default) | no_pad (VLLM_CPU_MALLOC_TOP_PAD_MB=0) | pad / no_pad |",
             "|---|---|---|---|"]
    for key, label in keys:
        lines.append(f"| {label} | {med('pad', key):.2f} | {med('no_pad', key):.2f} | "
                     f"{ratio(key):.3f} |")
    base = args.out if os.sep in args.out else os.path.join(HERE, "results", args.out)
    os.makedirs(os.path.dirname(base), exist_ok=True)
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(base + ".json", "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("child", "path")},
                   "results": results}, f, indent=1)
    print("\n".join(lines))
    print(f"wrote {base}.md and {base}.json")


if __name__ == "__main__":
    main()
