"""Our engine at -O0 against transformers' `generate` on the same random-weight checkpoint.

Each case runs in a fresh process (so peak resident memory is its own): batch-1 decode
tokens/s and batch-16 total output tokens/s (prefill included, mixed prompt lengths), float32
and bfloat16. Writes a markdown table and JSON with the ratios.

Batch-1 decode tok/s is (tokens - 1) over the time from the first output token to the last,
both taken in the same run (a streamer marks transformers' first token). Our prefix cache is
reset before every timed run: the warm-up ran the same prompts, and a cache hit would skip the
prefill this benchmark means to include. Each timing is the best of
`--repeats` runs, and each case the best of `--rounds` processes with the two engines taking
turns (the dev machines are shared; the best run is the least disturbed one).

    python benchmarks/compare_hf.py --shape qwen2.5-0.5b --max-tokens 64
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from process_memory import peak_rss_mb  # noqa: E402


def prompts(batch: int, vocab: int) -> list[list[int]]:
    """Deterministic prompts; at batch > 1 their lengths vary from 16 to 128 tokens."""
    lengths = [32] if batch == 1 else [16 + (112 * i) // (batch - 1) for i in range(batch)]
    return [[(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(n)] for i, n in enumerate(lengths)]


def best_of(repeats: int, timed) -> dict:
    """{"total", "decode"}: the fastest of `repeats` timed runs, separately for the whole run
    and for its decode part (first output token to last), each run measuring both."""
    runs = [timed() for _ in range(repeats)]
    return {"total": min(r["total"] for r in runs),
            "decode": min(r["total"] - r["first"] for r in runs)}


def run_ours(path: str, dtype: str, batch: int, max_tokens: int, level: int,
             repeats: int = 1) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype=dtype, optimization_level=level, max_model_len=512,
              kv_cache_memory="2GiB", max_num_seqs=max(batch, 1))
    engine = llm.llm_engine
    vocab = engine.vllm_config.model_config.get_vocab_size()
    batch_prompts = [{"prompt_token_ids": p} for p in prompts(batch, vocab)]
    counter = [0]

    def timed(n: int = max_tokens) -> dict:
        """One batch through the engine's step loop (what LLM.generate runs), timing the
        first output token and the end."""
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        engine.reset_prefix_cache()
        counter[0] += 1
        start = time.perf_counter()
        for i, p in enumerate(batch_prompts):
            engine.add_request(f"{counter[0]}-{i}", p, params)
        first, done = None, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
                if out.finished:
                    done.append(out)
        elapsed = time.perf_counter() - start
        assert len(done) == batch and all(len(o.outputs[0].token_ids) == n for o in done)
        return {"total": elapsed, "first": first - start}

    timed(2)  # warm-up
    return best_of(repeats, timed)


def run_hf(path: str, dtype: str, batch: int, max_tokens: int, repeats: int = 1) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval()
    batch_prompts = prompts(batch, model.config.vocab_size)
    width = max(len(p) for p in batch_prompts)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, p in enumerate(batch_prompts):  # left padding, as generate expects
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1

    class FirstToken:
        """A generate() streamer that notes when the first new tokens arrive (its first
        put() is the prompt)."""

        def __init__(self) -> None:
            self.puts, self.first = 0, None

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    def timed(n: int = max_tokens) -> dict:
        streamer = FirstToken()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0, streamer=streamer)
        elapsed = time.perf_counter() - start
        assert out.shape[1] == width + n
        return {"total": elapsed, "first": streamer.first - start}

    timed(2)
    return best_of(repeats, timed)


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.worker == "ours":
        result = run_ours(args.path, args.dtype, args.batch, args.max_tokens, args.level,
                          args.repeats)
    else:
        result = run_hf(args.path, args.dtype, args.batch, args.max_tokens, args.repeats)
    result["peak_rss_mb"] = peak_rss_mb()
    print("RESULT " + json.dumps(result))


def case(args, engine: str, dtype: str, batch: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", engine, "--path", args.path, "--dtype", dtype,
           "--batch", str(batch), "--max-tokens", str(args.max_tokens), "--threads",
           str(args.threads), "--level", str(args.level), "--repeats", str(args.repeats)]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not line:
        raise RuntimeError(f"{engine} {dtype} batch {batch} failed:\n{out.stderr[-3000:]}")
    result = json.loads(line[0][7:])
    n = args.max_tokens
    if batch == 1:
        result["tok_s"] = (n - 1) / result["decode"]
        result["metric"] = "batch-1 decode tok/s"
    else:
        result["tok_s"] = batch * n / result["total"]
        result["metric"] = f"batch-{batch} total output tok/s (prefill incl.)"
    return result


def best_case(best: dict | None, new: dict) -> dict:
    """The faster of two results of one case; peak RSS is the larger."""
    if best is None:
        return new
    fastest = dict(new if new["tok_s"] > best["tok_s"] else best)
    fastest["peak_rss_mb"] = max(best["peak_rss_mb"], new["peak_rss_mb"])
    return fastest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--ckpt-root", default=os.path.join(HERE, "results", "tmp"))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--level", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per measurement; the fastest counts")
    parser.add_argument("--rounds", type=int, default=1,
                        help="fresh processes per case, transformers and ours alternating; the "
                             "fastest counts")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "compare_hf"))
    parser.add_argument("--worker", choices=["ours", "hf"])
    parser.add_argument("--path")
    parser.add_argument("--dtype")
    parser.add_argument("--batch", type=int)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from checkpoints import write_checkpoint

    args.path = write_checkpoint(args.shape, args.ckpt_root)
    rows = []
    for dtype in args.dtypes:
        for batch in args.batches:
            hf = ours = None
            for _ in range(args.rounds):  # alternate the engines: both see the same load
                hf = best_case(hf, case(args, "hf", dtype, batch))
                ours = best_case(ours, case(args, "ours", dtype, batch))
            rows.append({"dtype": dtype, "batch": batch, "metric": ours["metric"],
                         "ours_tok_s": ours["tok_s"], "hf_tok_s": hf["tok_s"],
                         "ratio": ours["tok_s"] / hf["tok_s"],
                         "ours_peak_rss_mb": ours["peak_rss_mb"],
                         "hf_peak_rss_mb": hf["peak_rss_mb"]})
            print(json.dumps(rows[-1]), flush=True)
    lines = [f"Shape {args.shape}, {args.max_tokens} output tokens, {args.threads} threads, "
             f"ours at -O{args.level}, best of {args.repeats} runs x {args.rounds} processes, "
             "prefix cache reset before each run.", "",
             "| dtype | workload | ours tok/s | transformers tok/s | ratio | ours peak RSS MB "
             "| transformers peak RSS MB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['metric']} | {r['ours_tok_s']:.2f} | "
                     f"{r['hf_tok_s']:.2f} | {r['ratio']:.2f}x | {r['ours_peak_rss_mb']:.0f} | "
                     f"{r['hf_peak_rss_mb']:.0f} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"shape": args.shape, "max_tokens": args.max_tokens, "threads": args.threads,
                   "repeats": args.repeats, "rounds": args.rounds, "rows": rows}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
