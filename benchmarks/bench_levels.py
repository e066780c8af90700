"""The trade-off the levels exist for: start-up time against decode speed, per level.

For each model (a Qwen2.5-0.5B-shaped random-weight checkpoint and the built-in demo model)
and each level -O0..-O3, in fresh processes: time to ready with an empty compile cache (cold)
and with the cache the cold run filled (warm). The last warm process of each level stays up,
and the levels then take turns measuring decode tokens/s at batch 1 and batch 16, round after
round, so that the ratios between levels are taken on the same machine state (its memory
bandwidth drifts by 2x from minute to minute). Batch-1 decode is also given as a fraction of
the memory-bandwidth roofline: bytes read per token (weights + KV) divided by the read
bandwidth measured right before and after each timed decode (see `Bandwidth`). Writes
markdown, JSON and a PNG plot to benchmarks/results/.

    python benchmarks/bench_levels.py --models demo qwen2.5-0.5b --max-tokens 32
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
_RESULT = "LEVEL_RESULT "


class Bandwidth:
    """The machine's read bandwidth (GB/s) at this moment, for the roofline: the best of three
    reads of a 512 MiB buffer (far beyond the caches) by each of two kernels, a float32 sum and
    a float32 matrix-vector product through the engine's own CPU linear (what a decode step
    runs). The machine is shared and its bandwidth moves from minute to minute (30-85 GB/s),
    so every timed batch-1 decode is paired with a reading taken right before and after it."""

    def __init__(self) -> None:
        import torch

        self.x = torch.ones(128 * 1024 * 1024)
        self.w = self.x.view(16384, 8192)
        self.v = torch.ones(1, 8192)

    def now(self) -> float:
        from vllm.model_executor.layers.cpu_linear import dispatch_linear

        best = 0.0
        for fn in (self.x.sum, lambda: dispatch_linear(self.v, self.w)):
            for _ in range(3):
                start = time.perf_counter()
                fn()
                best = max(best, self.x.numel() * 4 / (time.perf_counter() - start) / 1e9)
        return best


def bytes_per_token(model, dtype_size: int, context: int, kv_per_token: int) -> float:
    """Weights read for one decode step (the embedding table is only indexed, unless tied, when
    it is read as the LM head) plus the KV cache read for `context` tokens."""
    total = sum(p.numel() for p in model.parameters()) * dtype_size
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    lm_head = getattr(model, "lm_head", None)
    tied = lm_head is not None and embed is not None and lm_head.weight is embed.weight
    if embed is not None and not tied:
        total -= embed.weight.numel() * dtype_size
    return total + context * kv_per_token


def worker(args) -> None:
    """One engine at one level: start, report the start-up, then (with --measure) serve decode
    measurements one command at a time from stdin ("b1 N", "b16 N", "quit")."""
    start_process = float(os.environ["BENCH_SPAWN_TIME"])
    import torch

    torch.set_num_threads(args.threads)
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    t0 = time.time()
    llm = LLM(model=args.path, optimization_level=args.level, dtype=args.dtype,
              max_model_len=512, kv_cache_memory="256MiB", max_num_seqs=16)
    ready = time.time()
    result = {"engine_startup_s": ready - t0, "process_to_ready_s": ready - start_process}
    # CPU -O2/-O3 finish prepacking their weights in the background after ready: the time
    # until full speed, and the steady state the decode figures below measure.
    from vllm.model_executor.layers.cpu_prepacked_linear import wait_for_prepacking

    result["prepacked_after_ready_s"] = wait_for_prepacking()
    engine = llm.llm_engine
    cfg = engine.vllm_config.model_config
    model = engine.executor.model
    device = torch.device("cpu") if model is None else next(model.parameters()).device
    result["device"] = str(device)
    if args.measure and model is not None and device.type == "cpu":  # a CPU roofline
        size = torch.tensor([], dtype=cfg.torch_dtype).element_size()
        kv = 2 * cfg.get_num_layers() * cfg.get_num_kv_heads() * cfg.get_head_size() * size
        result["bytes_per_token"] = bytes_per_token(model, size, 32 + args.max_tokens // 2, kv)
    print(_RESULT + json.dumps(result), flush=True)
    if not args.measure:
        return
    vocab = cfg.get_vocab_size()

    def prompts_of(batch: int) -> list[dict]:
        lengths = [32] if batch == 1 else [16 + (112 * i) // (batch - 1) for i in range(batch)]
        return [{"prompt_token_ids": [(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(m)]}
                for i, m in enumerate(lengths)]

    requests = iter(range(1 << 30))

    def decode(batch: int, n: int) -> float:
        """Output tokens/s of `batch` requests after their prefill: the steps that follow the
        one that gave every request its first token, each one token per request."""
        # FINAL_ONLY, as LLM.generate asks: no per-step RequestOutputs.
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        engine.reset_prefix_cache()  # the same prefill work every time, not cache hits
        ids = [f"bench-{next(requests)}" for _ in range(batch)]
        for request_id, prompt in zip(ids, prompts_of(batch)):
            engine.add_request(request_id, prompt, params)
        scheduled = engine.scheduler.requests
        while any(scheduled[r].num_output_tokens == 0 for r in ids):
            engine.step()
        begin = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return batch * (n - 1) / (time.perf_counter() - begin)

    for line in sys.stdin:
        command, *rest = line.split()
        if command == "quit":
            break
        batch = {"b1": 1, "b16": 16}[command]
        # The process sat idle while the other levels ran: bring its weights back into the
        # caches and its threads out of sleep before the timed run.
        decode(batch, 4)
        print(_RESULT + json.dumps({"tok_s": decode(batch, int(rest[0]))}), flush=True)


class Worker:
    """A worker process; `result` is its start-up report."""

    def __init__(self, args, path: str, level: int, cache_root: str, measure: bool) -> None:
        cmd = [sys.executable, __file__, "--worker", "--path", path, "--level", str(level),
               "--dtype", args.dtype, "--threads", str(args.threads), "--max-tokens",
               str(args.max_tokens)]
        cmd += ["--measure"] if measure else []
        env = {**os.environ, "VLLM_CACHE_ROOT": cache_root,
               "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_root, "inductor"),
               "VLLM_LOGGING_LEVEL": "WARNING", "BENCH_SPAWN_TIME": repr(time.time())}
        self.name = f"level {level} on {path}"
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, env=env)
        self.result = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(_RESULT):
                return json.loads(line[len(_RESULT):])
        self.proc.wait()
        self.stderr.seek(0)
        raise RuntimeError(f"{self.name} failed:\n{self.stderr.read()[-4000:]}")

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.stderr.close()


def start_levels(args, path: str) -> tuple[dict[int, dict], dict[int, Worker], list[str]]:
    """Per level: a cold start, warm starts on its cache, the last kept running to measure."""
    starts: dict[int, dict] = {}
    workers: dict[int, Worker] = {}
    roots = []
    for level in args.levels:
        cache_root = tempfile.mkdtemp(prefix=f"bench_levels_O{level}_")
        roots.append(cache_root)
        cold = Worker(args, path, level, cache_root, measure=False)
        cold.close()
        warm = []
        for _ in range(args.warm_runs - 1):
            w = Worker(args, path, level, cache_root, measure=False)
            w.close()
            warm.append(w.result)
        workers[level] = Worker(args, path, level, cache_root, measure=True)
        warm.append(workers[level].result)
        starts[level] = {"cold": cold.result, "warm": warm}
    return starts, workers, roots


def measure_levels(args, workers: dict[int, Worker]) -> dict[int, dict]:
    """Decode at every level, interleaved: each round runs every level once, so the levels of
    a round see the same machine (its bandwidth drifts from minute to minute) and the ratios
    against the base level are taken per round. Batch 1 is paired with the bandwidth measured
    right before and after it."""
    base = min(workers)
    # The roofline (and so the bandwidth reading) is a CPU measure.
    bandwidth = Bandwidth() if workers[base].result.get("bytes_per_token") else None
    rounds: dict[int, dict[str, list[float]]] = {
        level: {"b1": [], "b16": [], "gbs": [], "roofline": []} for level in workers}
    for kind in ("b1", "b16"):
        for _ in range(args.repeats):
            for level, w in workers.items():
                time.sleep(0.05)  # the previous worker's OpenMP threads stop spinning
                before = bandwidth.now() if kind == "b1" and bandwidth else None
                rate = w.ask(f"{kind} {args.max_tokens}")["tok_s"]
                rounds[level][kind].append(rate)
                if kind == "b1" and bandwidth:
                    gbs = max(before, bandwidth.now())
                    rounds[level]["gbs"].append(gbs)
                    per_token = w.result.get("bytes_per_token")
                    if per_token:
                        rounds[level]["roofline"].append(rate * per_token / (gbs * 1e9))
    out = {}
    for level, r in rounds.items():
        out[level] = {
            "decode_b1_tok_s": statistics.median(r["b1"]),
            "total_b16_tok_s": statistics.median(r["b16"]),
            "bandwidth_gbs": statistics.median(r["gbs"]) if r["gbs"] else None,
            "b1_vs_base": statistics.median(a / b for a, b in zip(r["b1"], rounds[base]["b1"])),
            "b16_vs_base": statistics.median(a / b for a, b in
                                             zip(r["b16"], rounds[base]["b16"]))}
        if r["roofline"]:
            out[level]["roofline_fraction"] = statistics.median(r["roofline"])
    return out


def plot(rows: list[dict], out_png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in (r for r in rows if r["model"] == model):
            for kind, marker in (("cold", "o"), ("warm", "s")):
                ax.scatter(r[f"{kind}_start_s"], r["decode_b1_tok_s"], marker=marker,
                           s=60, label=f"-O{r['level']} {kind}")
                ax.annotate(f"O{r['level']}", (r[f"{kind}_start_s"], r["decode_b1_tok_s"]),
                            textcoords="offset points", xytext=(5, 5))
        ax.set_title(f"{model}: start-up vs batch-1 decode")
        ax.set_xlabel("time to ready (s, fresh process)")
        ax.set_ylabel("decode tokens/s (batch 1)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["demo", "qwen2.5-0.5b"])
    parser.add_argument("--levels", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="decode rounds")
    parser.add_argument("--warm-runs", type=int, default=3,
                        help="warm starts per level (median); the last one stays up to "
                             "measure decode")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ckpt-root", default=os.path.join(HERE, "results", "tmp"))
    parser.add_argument("--out", default=os.path.join(HERE, "results", "levels"))
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--path")
    parser.add_argument("--level", type=int)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from checkpoints import write_checkpoint

    rows = []
    for name in args.models:
        path = "demo" if name == "demo" else write_checkpoint(name, args.ckpt_root)
        workers: dict[int, Worker] = {}
        roots: list[str] = []
        try:
            starts, workers, roots = start_levels(args, path)
            decode = measure_levels(args, workers)
        finally:
            for w in workers.values():
                w.close()
            for root in roots:
                shutil.rmtree(root, ignore_errors=True)
        for level in args.levels:
            cold, warm = starts[level]["cold"], starts[level]["warm"]
            row = {"model": name, "level": level, "cold_start_s": cold["process_to_ready_s"],
                   "cold_engine_s": cold["engine_startup_s"],
                   "warm_start_s": statistics.median(r["process_to_ready_s"] for r in warm),
                   "warm_engine_s": statistics.median(r["engine_startup_s"] for r in warm),
                   "warm_runs": len(warm), "device": warm[-1].get("device", "cpu"),
                   "warm_prepacked_after_s": statistics.median(
                       r["prepacked_after_ready_s"] for r in warm),
                   **decode[level]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    devices = ", ".join(sorted({r["device"] for r in rows}))
    lines = [f"Device: {devices}. {args.dtype}, {args.max_tokens} output tokens, {args.threads} "
             "threads. Start-up: "
             "fresh process to ready (engine = config resolution to ready), cold = empty "
             f"compile caches, warm = median of {args.warm_runs} starts on the cold run's "
             "caches. +prepack: how long after ready the CPU -O2/-O3 weight prepacking "
             "(background) was done, median of the warm starts; decode is measured after it. "
             "Decode: output tokens/s of the engine steps after the prefill (prompts of 32 "
             "tokens at batch 1, 16..128 at batch 16). The last warm process of every level "
             "stays up and they take turns, "
             f"{args.repeats} rounds (each level once a round); tok/s are medians over the "
             "rounds, and the ratios against -O0 are the medians of the per-round ratios (the "
             "machine's bandwidth drifts between rounds, not within one). Roofline: per "
             "round, the batch-1 rate against bytes read per step / the read bandwidth "
             "measured right before and after it; median over the rounds, with the median "
             "bandwidth (GB/s column).", "",
             "| model | level | cold start (s) | warm start (s) | warm engine (s) | +prepack (s) | "
             "decode b1 (tok/s) | b1 % of roofline (GB/s) | b16 total (tok/s) | b1 vs O0 | "
             "b16 vs O0 | warm start vs O0 (process / engine) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["level"] == min(args.levels))
        frac = (f"{100 * r['roofline_fraction']:.0f}% ({r['bandwidth_gbs']:.0f})"
                if "roofline_fraction" in r else "-")
        lines.append(
            f"| {r['model']} | -O{r['level']} | {r['cold_start_s']:.1f} | {r['warm_start_s']:.1f} "
            f"| {r['warm_engine_s']:.1f} | {r['warm_prepacked_after_s']:.1f} | "
            f"{r['decode_b1_tok_s']:.1f} | {frac} | "
            f"{r['total_b16_tok_s']:.1f} | "
            f"{r['b1_vs_base']:.2f}x | "
            f"{r['b16_vs_base']:.2f}x | "
            f"{r['warm_start_s'] / base['warm_start_s']:.2f}x / "
            f"{r['warm_engine_s'] / base['warm_engine_s']:.2f}x |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"dtype": args.dtype, "threads": args.threads, "max_tokens": args.max_tokens,
                   "rows": rows}, f, indent=1)
    plot(rows, args.out + ".png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
