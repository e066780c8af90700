"""The CPU decode linears side by side: our dispatcher (`vllm_cpu_linear::linear`, what eager
and compiled models call) against torch's `F.linear`, on a model's whole set of linear weights
(every decoder layer's fused QKV, output, fused gate/up and down projections, then the LM head),
cold (2 GB for the Qwen2.5-0.5B shape, far beyond the caches), at a few decode batch sizes.

Rounds alternate the two, so the machine's bandwidth drift hits both alike; the ratio is the
median over rounds of time(F.linear) / time(ours). GB/s = the weights' bytes over the fastest
round. The read bandwidth of a 512 MiB float32 sum is measured with each round, as a yardstick.

    python benchmarks/bench_cpu_linear.py --shape qwen2.5-0.5b --rows 1 2 4 16
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
sys.path.insert(0, HERE)


def model_weights(shape: str) -> list[tuple[int, int]]:
    """[out, in] of every linear of one decode step of `shape` (benchmarks/checkpoints.py)."""
    from checkpoints import SHAPES

    cfg = SHAPES[shape]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = hidden // heads
    layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim),
             (2 * inter, hidden), (hidden, inter)]
    return layer * cfg["num_hidden_layers"] + [(cfg["vocab_size"], hidden)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "cpu_linear"))
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from vllm.model_executor.layers.cpu_linear import dispatch_linear, small_m_linear_available

    torch.set_num_threads(args.threads)
    if not small_m_linear_available():
        sys.exit("the C++ linear kernels could not be built on this machine")
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for n, k in model_weights(args.shape)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    probe = torch.ones(128 * 1024 * 1024)

    def step(linear, xs) -> float:
        start = time.perf_counter()
        for w in weights:
            linear(xs[w.shape[1]], w)
        return time.perf_counter() - start

    results = []
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        times: dict[str, list[float]] = {"ours": [], "F.linear": []}
        bandwidth = []
        step(dispatch_linear, xs)  # warm-up: the kernels' first calls, the weights' first reads
        step(F.linear, xs)
        for _ in range(args.rounds):
            start = time.perf_counter()
            probe.sum()
            bandwidth.append(probe.numel() * 4 / (time.perf_counter() - start) / 1e9)
            times["ours"].append(step(dispatch_linear, xs))
            times["F.linear"].append(step(F.linear, xs))
        ratio = statistics.median(b / a for a, b in zip(times["ours"], times["F.linear"]))
        results.append({
            "rows": rows,
            "ours_ms": min(times["ours"]) * 1e3,
            "f_linear_ms": min(times["F.linear"]) * 1e3,
            "ours_gbs": nbytes / min(times["ours"]) / 1e9,
            "f_linear_gbs": nbytes / min(times["F.linear"]) / 1e9,
            "ours_vs_f_linear": ratio,
            "sum_bandwidth_gbs": statistics.median(bandwidth),
        })
        r = results[-1]
        print(f"{rows:3d} rows: ours {r['ours_ms']:.1f} ms ({r['ours_gbs']:.0f} GB/s), F.linear "
              f"{r['f_linear_ms']:.1f} ms ({r['f_linear_gbs']:.0f} GB/s), ours x{ratio:.2f}; "
              f"sum bandwidth {r['sum_bandwidth_gbs']:.0f} GB/s", flush=True)

    meta = {"shape": args.shape, "weights_gb": nbytes / 1e9, "threads": args.threads,
            "rounds": args.rounds, "torch": torch.__version__}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    lines = [f"All linears of one decode step of the {args.shape} shape ({nbytes / 1e9:.2f} GB of "
             f"float32 weights, cold), {args.threads} threads, {args.rounds} alternating rounds "
             "(`python benchmarks/bench_cpu_linear.py`). ours = `vllm_cpu_linear::linear` "
             "(small-M kernel up to 4 rows, oneDNN above); times are the fastest round, the "
             "ratio the median over rounds; sum bandwidth = a 512 MiB float32 sum, per round.",
             "", "| rows | ours (ms) | ours (GB/s) | F.linear (ms) | F.linear (GB/s) | "
             "ours vs F.linear | sum bandwidth (GB/s) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['rows']} | {r['ours_ms']:.1f} | {r['ours_gbs']:.0f} | "
                     f"{r['f_linear_ms']:.1f} | {r['f_linear_gbs']:.0f} | "
                     f"x{r['ours_vs_f_linear']:.2f} | {r['sum_bandwidth_gbs']:.0f} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}.md and .json")


if __name__ == "__main__":
    main()
