"""The CPU decode linears side by side, per instruction-set level: our dispatcher
(`vllm_cpu_linear::linear`, what eager and compiled models call) built for each ISA level the
machine has (avx2, avx512, avx512_bf16: vllm/utils/cpu_info.py), against torch's `F.linear`,
on a model's whole set of linear weights (every decoder layer's fused QKV, output, fused
gate/up and down projections, then the LM head), cold (2 GB of float32 for the Qwen2.5-0.5B
shape, far beyond the caches), at a few decode batch sizes.

One process loads one ISA level of the kernels, so each level runs in a worker process of its
own (VLLM_CPU_ISA=<level>), all alive at once; the parent drives them one at a time in
interleaved rounds (the order rotates each round), so the machine's bandwidth drift hits every
level alike. In every round each worker first measures the read bandwidth (a 512 MiB float32
sum), then times our step and F.linear's (with --prepacked: float32 weights with their panel
copies, as -O2/-O3 run them, against oneDNN on its own reorder of each weight, -O2's copy
before the panel kernel). Reported per level and row count:
- ms: the fastest round; GB/s: the weights' bytes over it;
- of bandwidth: the median over rounds of (weights' bytes / our time) / that round's sum
  bandwidth (the paired read rate: 1.0 = the kernel reads as fast as a plain sum);
- vs F.linear (or oneDNN prepacked) and vs <first level>: medians over rounds of paired time
  ratios (>1 = faster);
  "per bandwidth": the same with each time scaled by its own process's sum bandwidth of that
  round (worker processes can differ in memory speed, e.g. page placement).
An A/A run (`--compare-source` given a copy of the current file: two workers, same library)
shows the noise floor: on the loaded 2-core dev machine identical workers differed by up to
1.4x at one thread, so only larger differences mean anything there.

    python benchmarks/bench_cpu_linear.py --shape qwen2.5-0.5b --rows 1 2 4 16
    python benchmarks/bench_cpu_linear.py --isa avx2 avx512_bf16 --dtype bfloat16 --rounds 3
    python benchmarks/bench_cpu_linear.py --streams 1 8 --rows 1 2 4 8   # weight streams
    python benchmarks/bench_cpu_linear.py --prepacked --dtype float32 --rows 8 16 32 64
    python benchmarks/bench_cpu_linear.py --prepacked --dtype float32 --isa avx512_bf16 \
        --panel-prefetch 8 32 --rows 5 16 32   # the panel kernel's prefetch distance
    python benchmarks/bench_cpu_linear.py --nt-loads 0 1 --dtype float32 --rows 1 2 3
        # plain against non-temporal weight loads (VLLM_CPU_LINEAR_NT_LOADS)

`--compare-source old.cpp` adds, for every level, a worker whose kernels are built from another
version of csrc/cpu_small_m_linear.cpp (e.g. `git show HEAD~1:<path> > old.cpp`), and a column
"vs source": the paired ratio of that version's time to the current one's at the same level.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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
    head_dim = cfg.get("head_dim", hidden // heads)
    layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim),
             (2 * inter, hidden), (hidden, inter)]
    return layer * cfg["num_hidden_layers"] + [(cfg["vocab_size"], hidden)]


def worker(args: argparse.Namespace) -> None:
    """One ISA level: answer each line on stdin (a row count) with one timed round as JSON."""
    import torch
    import torch.nn.functional as F

    from vllm.model_executor.layers import cpu_linear
    from vllm.model_executor.layers.cpu_linear import dispatch_linear, small_m_linear_available

    torch.set_num_threads(args.threads)
    if args.source:
        cpu_linear._SOURCE = os.path.abspath(args.source)
    if not small_m_linear_available():
        sys.exit("the C++ linear kernels could not be built on this machine")
    dtype = getattr(torch, args.dtype[0])
    torch.manual_seed(0)
    weights = [torch.randn(n, k).to(dtype) for n, k in model_weights(args.shape)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    if args.prepacked:
        # what -O2/-O3 run: each weight with its panel copy; the reference is oneDNN on its own
        # reorder of the weight (-O2's copy before the panel kernel)
        from vllm.model_executor.layers.cpu_prepacked_linear import prepack

        if dtype != torch.float32 or not all(prepack(w) for w in weights):
            sys.exit("--prepacked: float32 weights and the C++ build needed")
        reordered = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights}

        def reference(x, w):
            return torch.ops.mkldnn._linear_pointwise(x, reordered[id(w)], None, "none", [], "")
    else:
        reference = F.linear
    probe = torch.ones(128 * 1024 * 1024)
    xs_by_rows: dict[int, dict[int, torch.Tensor]] = {}

    def step(linear, xs) -> float:
        start = time.perf_counter()
        for w in weights:
            linear(xs[w.shape[1]], w)
        return time.perf_counter() - start

    print(json.dumps({"ready": True, "nbytes": nbytes,
                      "isa": torch.ops.vllm_cpu_linear.isa()}), flush=True)
    for line in sys.stdin:
        rows = int(line)
        xs = xs_by_rows.get(rows)
        if xs is None:
            xs = xs_by_rows[rows] = {k: torch.randn(rows, k).to(dtype)
                                     for k in {w.shape[1] for w in weights}}
            step(dispatch_linear, xs)  # warm-up: the kernels' first calls at this row count
            step(reference, xs)
        start = time.perf_counter()
        probe.sum()
        bandwidth = probe.numel() * 4 / (time.perf_counter() - start) / 1e9
        ours = step(dispatch_linear, xs)
        ref = step(reference, xs)
        print(json.dumps({"bandwidth": bandwidth, "ours": ours, "reference": ref}), flush=True)


class Worker:
    def __init__(self, isa: str, args: argparse.Namespace, dtype: str,
                 source: str | None = None, streams: int | None = None,
                 panel_prefetch: int | None = None, nt_loads: int | None = None) -> None:
        env = dict(os.environ, VLLM_CPU_ISA=isa)
        if streams:
            env["VLLM_CPU_LINEAR_STREAMS"] = str(streams)
        if panel_prefetch is not None:
            env["VLLM_CPU_PANEL_PREFETCH_LINES"] = str(panel_prefetch)
        if nt_loads is not None:
            env["VLLM_CPU_LINEAR_NT_LOADS"] = str(nt_loads)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--shape", args.shape,
               "--threads", str(args.threads), "--dtype", dtype]
        if args.prepacked:
            cmd.append("--prepacked")
        if source:
            cmd += ["--source", source]
        self.isa = isa
        self.label = isa + (f" s{streams}" if streams else "") + (
            f" pf{panel_prefetch}" if panel_prefetch is not None else "") + (
            f" nt{nt_loads}" if nt_loads is not None else "") + (
            f" ({os.path.basename(source)})" if source else "")
        self.twin: Worker | None = None  # the same level built from --compare-source
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        hello = self.read()
        if hello.get("isa") != isa:
            raise RuntimeError(f"worker for {isa} loaded kernels built for {hello.get('isa')}")
        self.nbytes = hello["nbytes"]

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.isa} worker exited (rc {self.proc.wait()})")
        return json.loads(line)

    def round(self, rows: int) -> dict:
        self.proc.stdin.write(f"{rows}\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def reference_name(args: argparse.Namespace) -> str:
    return "oneDNN prepacked" if args.prepacked else "F.linear"


def run_dtype(args: argparse.Namespace, dtype: str) -> tuple[list[dict], float]:
    ref_name = reference_name(args)
    workers = []
    try:
        for isa in args.isa:  # one at a time: their builds and weights do not overlap
            for streams in args.streams or [None]:
                for lines in args.panel_prefetch or [None]:
                    for nt in args.nt_loads or [None]:
                        workers.append(Worker(isa, args, dtype, streams=streams,
                                              panel_prefetch=lines, nt_loads=nt))
                        if args.compare_source:
                            workers.append(Worker(isa, args, dtype, args.compare_source,
                                                  streams, lines, nt))
                            workers[-2].twin = workers[-1]
        nbytes = workers[0].nbytes
        results = []
        for rows in args.rows:
            for w in workers:
                w.round(rows)  # warm-up round
            rounds: dict[str, list[dict]] = {w.label: [] for w in workers}
            for r in range(args.rounds):
                order = workers[r % len(workers):] + workers[:r % len(workers)]
                for w in order:
                    rounds[w.label].append(w.round(rows))
            base = rounds[workers[0].label]
            for w in workers:
                rs = rounds[w.label]
                ours = [x["ours"] for x in rs]
                twin = rounds[w.twin.label] if w.twin else None
                results.append({
                    "dtype": dtype, "isa": w.label, "rows": rows,
                    "ours_ms": min(ours) * 1e3,
                    "ours_gbs": nbytes / min(ours) / 1e9,
                    "reference_ms": min(x["reference"] for x in rs) * 1e3,
                    "of_bandwidth": statistics.median(nbytes / x["ours"] / 1e9 / x["bandwidth"]
                                                      for x in rs),
                    "sum_bandwidth_gbs": statistics.median(x["bandwidth"] for x in rs),
                    "vs_reference": statistics.median(x["reference"] / x["ours"] for x in rs),
                    "vs_first_isa": statistics.median(b["ours"] / x["ours"]
                                                      for b, x in zip(base, rs)),
                    "vs_source": (statistics.median(t["ours"] / x["ours"]
                                                    for t, x in zip(twin, rs)) if twin else None),
                    # the same ratios with each time scaled by its own process's sum bandwidth
                    # (processes can differ in memory speed: page placement)
                    "vs_first_isa_per_bw": statistics.median(
                        b["ours"] * b["bandwidth"] / (x["ours"] * x["bandwidth"])
                        for b, x in zip(base, rs)),
                    "vs_source_per_bw": (statistics.median(
                        t["ours"] * t["bandwidth"] / (x["ours"] * x["bandwidth"])
                        for t, x in zip(twin, rs)) if twin else None),
                })
                r = results[-1]
                print(f"{dtype} {w.label:12s} {rows:3d} rows: {r['ours_ms']:.1f} ms "
                      f"({r['ours_gbs']:.0f} GB/s, {r['of_bandwidth']:.0%} of the sum's "
                      f"{r['sum_bandwidth_gbs']:.0f} GB/s), x{r['vs_reference']:.2f} {ref_name}, "
                      f"x{r['vs_first_isa']:.2f} {workers[0].label} "
                      f"(x{r['vs_first_isa_per_bw']:.2f} per bandwidth)"
                      + (f", x{r['vs_source']:.2f} vs source (x{r['vs_source_per_bw']:.2f} per "
                         "bandwidth)" if twin else ""), flush=True)
        return results, nbytes
    finally:
        for w in workers:
            w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", nargs="+", default=None,
                        help="ISA levels to compare (default: every level this CPU has)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--out", default=os.path.join(HERE, "results", "cpu_linear_isa"))
    parser.add_argument("--streams", type=int, nargs="+", default=None, choices=[1, 2, 4, 8],
                        help="weight streams per thread to compare (VLLM_CPU_LINEAR_STREAMS), "
                             "one worker per level and count; default: the CPU's default only")
    parser.add_argument("--panel-prefetch", type=int, nargs="+", default=None,
                        help="with --prepacked: the panel kernel's prefetch distances to compare "
                             "(VLLM_CPU_PANEL_PREFETCH_LINES, cache lines ahead), one worker "
                             "per level and distance; default: the built-in distance only")
    parser.add_argument("--nt-loads", type=int, nargs="+", default=None, choices=[0, 1],
                        help="plain (0) and/or non-temporal (1) weight loads to compare "
                             "(VLLM_CPU_LINEAR_NT_LOADS), one worker per level and setting; "
                             "default: the CPU's default only")
    parser.add_argument("--compare-source", default=None,
                        help="another cpu_small_m_linear.cpp to build and compare at each level")
    parser.add_argument("--prepacked", action="store_true",
                        help="float32 weights with their panel copies (what -O2/-O3 run), "
                             "against oneDNN on its own reorder of each weight")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--source", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from vllm.utils.cpu_info import cpu_isa_level, supported_isa_levels

    if args.isa is None:
        args.isa = supported_isa_levels()
    for isa in args.isa:
        cpu_isa_level(forced=isa)  # a ValueError naming the allowed levels
    if not args.isa:
        sys.exit("this CPU has none of the ISA levels (avx2, avx512, avx512_bf16)")
    if args.panel_prefetch and not args.prepacked:
        sys.exit("--panel-prefetch needs --prepacked (only panel copies use that distance)")
    if args.panel_prefetch and min(args.panel_prefetch) < 0:
        sys.exit(f"--panel-prefetch: cache lines ahead must be >= 0, got {args.panel_prefetch}")
    results, sizes = [], {}
    for dtype in args.dtype:
        rs, sizes[dtype] = run_dtype(args, dtype)
        results += rs

    import torch

    from vllm.utils.cpu_info import best_isa_level

    meta = {"shape": args.shape, "weights_gb": {d: n / 1e9 for d, n in sizes.items()},
            "threads": args.threads, "rounds": args.rounds, "torch": torch.__version__,
            "cpu_best_isa": best_isa_level(), "isa": args.isa,
            "compare_source": args.compare_source, "streams": args.streams,
            "panel_prefetch": args.panel_prefetch, "nt_loads": args.nt_loads,
            "prepacked": args.prepacked, "reference": reference_name(args)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    weights = ", ".join(f"{n / 1e9:.2f} GB of {d}" for d, n in sizes.items())
    first = results[0]["isa"]  # the first worker's label: what "vs" compares with
    lines = [f"All linears of one decode step of the {args.shape} shape ({weights} weights, "
             f"cold), {args.threads} threads, {args.rounds} interleaved rounds, the kernels "
             f"built for each ISA level (and weight-stream count, `s<N>`, panel prefetch "
             f"distance, `pf<N>`) in a worker process "
             f"of its own (CPU's best level: "
             f"{meta['cpu_best_isa']}; `python benchmarks/bench_cpu_linear.py`). ours = "
             "`vllm_cpu_linear::linear` (small-M kernel for a few rows, oneDNN or aten above"
             + ("; the weights prepacked: the panel kernel for its rows" if args.prepacked
                else "") + f"), against {meta['reference']}; "
             "ms and GB/s from the fastest round; of bandwidth = median over rounds of our read "
             "rate / the same round's 512 MiB float32 sum rate; the ratios are medians over "
             f"rounds of paired times (>1: ours / this level faster).", "",
             f"| dtype | ISA | rows | ours (ms) | ours (GB/s) | of bandwidth | "
             f"sum bandwidth (GB/s) | {meta['reference']} (ms) | vs {meta['reference']} | "
             f"vs {first} | "
             f"vs {first} per bandwidth | vs source | vs source per bandwidth |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        vs_source = (f"x{r['vs_source']:.2f} | x{r['vs_source_per_bw']:.2f}"
                     if r["vs_source"] else " | ")
        lines.append(f"| {r['dtype']} | {r['isa']} | {r['rows']} | {r['ours_ms']:.1f} | "
                     f"{r['ours_gbs']:.0f} | {r['of_bandwidth']:.0%} | "
                     f"{r['sum_bandwidth_gbs']:.0f} | {r['reference_ms']:.1f} | "
                     f"x{r['vs_reference']:.2f} | x{r['vs_first_isa']:.2f} | "
                     f"x{r['vs_first_isa_per_bw']:.2f} | {vs_source} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}.md and .json")


if __name__ == "__main__":
    main()
