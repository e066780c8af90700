"""FP8 fusions on this machine, side by side.

Part 1 (ops): each fused op (C++ on the CPU) against the same computation unfused, as eager
plain torch, as eager with the quant custom op, and as the plain ops compiled by Inductor
(which fuses them into one generated kernel: the alternative to our pass). Microseconds per
call at 1, 16 and 128 tokens.

Part 2 (model): a random-weight FP8 Llama (static per-tensor scales, so all three fusions
apply) at -O2 with every fusion on, with each fusion off in turn, and with all off; and the
same weights as a bfloat16 checkpoint at -O2. Decode tokens/s at batch 1 and 16, each
configuration in a fresh process, best of several repetitions (the machine is shared).

Writes benchmarks/results/fp8_fusions.md and .json.

    python benchmarks/bench_fp8_fusions.py                  # both parts
    python benchmarks/bench_fp8_fusions.py --skip-ops --decode-tokens 32
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

FUSION_FLAGS = ("fuse_norm_quant", "fuse_act_quant", "fuse_attn_quant")
SHAPE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4096,
         "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "initializer_range": 0.02}


# ---- part 1: ops -----------------------------------------------------------------------------
def _best_us(fn, calls: int, repeats: int = 5) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def bench_ops(hidden: int, tokens: list[int], dtype_name: str, steps: int = 8) -> list[dict]:
    """Per-op microseconds inside compiled code: a chain of `steps` (op -> quant -> back to
    the model dtype) compiled by Inductor, once with the plain ops (Inductor fuses them into
    its own kernel) and once with our fused op (an extern call), so both pay the same
    per-graph overhead; plus the plain chain run eagerly."""
    import torch

    from vllm.model_executor.kernels import fp8_ops as F8
    from vllm.model_executor.kernels.cpu_loader import load_cpu_fp8_kernels

    assert load_cpu_fp8_kernels(), "the CPU kernels did not build"
    dtype = getattr(torch, dtype_name)
    ops = torch.ops.vllm
    eps = 1e-5
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    scale = torch.tensor([0.02])

    def chain(step):
        def run(x, r):
            for _ in range(steps):
                q, r = step(x, r)
                x = q.to(dtype)
            return x, r
        return run

    def add_rms_static_plain(x, r):
        y, res = F8.ref_rms_norm(x, weight, eps, r)
        return F8.ref_static_quant(y, scale), res

    def add_rms_static_fused(x, r):
        return ops.fused_add_rms_norm_static_fp8_quant(x, r, weight, scale, eps)

    def add_rms_token_plain(x, r):
        y, res = F8.ref_rms_norm(x, weight, eps, r)
        q, s = F8.ref_dynamic_quant(y)
        return q.to(dtype) * s.to(dtype), res

    def add_rms_token_fused(x, r):
        q, s, res = ops.fused_add_rms_norm_dynamic_fp8_quant(x, r, weight, eps, -1)
        return q.to(dtype) * s.to(dtype), res

    def silu_static_plain(x, r):
        q = F8.ref_static_quant(F8.ref_silu_and_mul(torch.cat([x, r], -1)), scale)
        return q, r

    def silu_static_fused(x, r):
        return ops.silu_and_mul_static_fp8_quant(torch.cat([x, r], -1), scale), r

    cases = [("fused_add_rms_norm + static quant", add_rms_static_plain, add_rms_static_fused),
             ("fused_add_rms_norm + per-token quant", add_rms_token_plain,
              add_rms_token_fused),
             ("silu_and_mul + static quant", silu_static_plain, silu_static_fused)]
    rows = []
    for name, plain, fused in cases:
        eager = chain(plain)
        inductor_plain = torch.compile(chain(plain), dynamic=True)
        inductor_fused = torch.compile(chain(fused), dynamic=True)
        for n in tokens:
            x = torch.randn(n, hidden).to(dtype)
            r = torch.randn(n, hidden).to(dtype)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(r, 0)
            calls = max(10, 400 // n)
            timings = {key: _best_us(functools.partial(fn, x, r), calls) / steps
                       for key, fn in (("fused_us", inductor_fused),
                                       ("inductor_plain_us", inductor_plain),
                                       ("eager_plain_us", eager))}
            row = {"op": name, "dtype": dtype_name, "tokens": n, "hidden": hidden, **timings}
            row["speedup_vs_eager"] = row["eager_plain_us"] / row["fused_us"]
            row["speedup_vs_inductor"] = row["inductor_plain_us"] / row["fused_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ---- part 2: model -----------------------------------------------------------------------------
def _ensure_compiled_llama() -> None:
    from vllm.compilation.decorators import support_torch_compile
    from vllm.model_executor.models.llama import LlamaModel

    if not getattr(LlamaModel, "_vllm_compile_decorated", False):
        support_torch_compile(LlamaModel)


def worker(spec: dict) -> dict:
    """One configuration, in its own process: decode tokens/s at each batch size."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    _ensure_compiled_llama()
    from vllm import LLM, SamplingParams
    from vllm.compilation.passes.matcher_utils import fusion_match_counter

    start = time.perf_counter()
    llm = LLM(model=spec["path"], dtype=spec["dtype"], optimization_level=2,
              max_model_len=512, max_num_seqs=max(spec["batches"]),
              compilation_config=spec["compilation_config"])
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    result = {"label": spec["label"], "decode_tok_s": {}, "startup_s": 0.0}

    def run(batch: int, n: int) -> float:
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % (vocab - 10) + 5
                                         for j in range(16)]} for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    run(max(spec["batches"]), 4)  # compile and warm up
    result["startup_s"] = time.perf_counter() - start
    n = spec["decode_tokens"]
    for batch in spec["batches"]:
        run(batch, 2)  # warm this batch size
        # Best of each separately: the machine is shared, a repetition may be descheduled.
        full = min(run(batch, n + 1) for _ in range(spec["repeats"]))
        prefill = min(run(batch, 1) for _ in range(spec["repeats"]))
        result["decode_tok_s"][str(batch)] = batch * n / max(full - prefill, 1e-9)
    result["fusion_matches"] = dict(fusion_match_counter)
    return result


def bench_model(args: argparse.Namespace) -> list[dict]:
    from tests.quantization.fp8_checkpoints import make_fp8_llama

    root = args.checkpoint_dir or tempfile.mkdtemp(prefix="fp8_bench_")
    path = os.path.join(root, "fp8-static")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        make_fp8_llama(path, layout="fp8", weights="tensor", activations="static",
                       dtype="bfloat16", **SHAPE)
    dequant = path + "-dequant"
    backend = {"backend": "inductor"}
    off = dict.fromkeys(FUSION_FLAGS, False)
    configs = [("FP8, all fusions (default -O2)", path, backend)]
    for flag in FUSION_FLAGS:
        configs.append((f"FP8, without {flag}", path, {**backend, "pass_config": {flag: False}}))
    configs.append(("FP8, no fusions", path, {**backend, "pass_config": off}))
    configs.append(("bfloat16 (same weights, dequantized)", dequant, backend))
    best: dict[str, dict] = {}
    for _ in range(args.rounds):  # rounds interleave the configurations (load drifts)
        for label, model_path, cc in configs:
            spec = {"label": label, "path": model_path, "dtype": args.dtype,
                    "compilation_config": cc, "batches": args.batches,
                    "decode_tokens": args.decode_tokens, "repeats": args.repeats,
                    "threads": args.threads}
            env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING",
                       PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                  capture_output=True, text=True, env=env, cwd=REPO)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"{label} failed:\n{proc.stderr[-4000:]}")
            result = json.loads(lines[-1])
            print(json.dumps(result), flush=True)
            kept = best.setdefault(label, result)
            for batch, value in result["decode_tok_s"].items():
                kept["decode_tok_s"][batch] = max(kept["decode_tok_s"][batch], value)
            kept["startup_s"] = min(kept["startup_s"], result["startup_s"])
    return [best[label] for label, _, _ in configs]


# ---- report --------------------------------------------------------------------------------------
def write_report(ops: list[dict], model: list[dict], args: argparse.Namespace) -> None:
    import torch

    out_dir = os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
            "shape": SHAPE, "dtype": args.dtype, "decode_tokens": args.decode_tokens,
            "repeats": args.repeats, "rounds": args.rounds, "threads": args.threads}
    lines = ["# FP8 fusions on the CPU", "",
             f"{meta['date']}, torch {meta['torch']}, {meta['cpus']} CPUs (shared: numbers "
             "are the best of several repetitions).", ""]
    if ops:
        lines += ["## Fused ops vs the unfused pair, inside Inductor-compiled code", "",
                  f"Microseconds per op (lower is better), hidden {ops[0]['hidden']}: a chain "
                  "of 8 (op -> quant -> dequant) compiled by Inductor with the plain ops "
                  "(Inductor generates one fused kernel per op pair) or with our fused op; "
                  "the plain chain run eagerly for reference.", "",
                  "| op | dtype | tokens | our fused op | Inductor-fused plain ops | eager "
                  "plain ops | speed-up vs Inductor | vs eager |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in ops:
            lines.append(f"| {r['op']} | {r['dtype']} | {r['tokens']} | {r['fused_us']:.1f} | "
                         f"{r['inductor_plain_us']:.1f} | {r['eager_plain_us']:.1f} | "
                         f"{r['speedup_vs_inductor']:.2f}x | {r['speedup_vs_eager']:.2f}x |")
        lines.append("")
    if model:
        batches = [str(b) for b in args.batches]
        base = model[0]["decode_tok_s"]
        lines += ["## FP8 Llama at -O2 (Inductor), decode tokens/s (higher is better)", "",
                  f"Shape: {SHAPE}; {args.dtype}; static per-tensor FP8 scales; "
                  f"{args.threads or 'default'} torch thread(s); best of {args.rounds} rounds "
                  f"x {args.repeats} repetitions.", "",
                  "| configuration | " + " | ".join(f"batch {b}" for b in batches)
                  + " | " + " | ".join(f"vs default, batch {b}" for b in batches)
                  + " | start-up s | fusion matches |",
                  "|---|" + "---:|" * (2 * len(batches) + 1) + "---|"]
        for r in model:
            tok = r["decode_tok_s"]
            matches = ", ".join(f"{k.replace('FusionPass', '')}={v}"
                                for k, v in sorted(r["fusion_matches"].items())) or "-"
            lines.append(f"| {r['label']} | " + " | ".join(f"{tok[b]:.1f}" for b in batches)
                         + " | " + " | ".join(f"{tok[b] / base[b]:.2f}" for b in batches)
                         + f" | {r['startup_s']:.0f} | {matches} |")
        lines.append("")
    with open(os.path.join(out_dir, "fp8_fusions.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(out_dir, "fp8_fusions.json"), "w") as f:
        json.dump({"meta": meta, "ops": ops, "model": model}, f, indent=2)
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--skip-ops", action="store_true")
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--op-hidden", type=int, default=2048)
    parser.add_argument("--op-tokens", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--op-dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per worker (0: torch's default); 1 is steadier "
                             "on a shared machine")
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    ops = [] if args.skip_ops else [row for dtype in args.op_dtypes
                                    for row in bench_ops(args.op_hidden, args.op_tokens, dtype)]
    model = [] if args.skip_model else bench_model(args)
    write_report(ops, model, args)


if __name__ == "__main__":
    main()
