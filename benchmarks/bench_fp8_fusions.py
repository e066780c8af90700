"""FP8 fusions on this machine, side by side.

Part 1 (ops): each fused op (C++ on the CPU) against the same computation unfused, as eager
plain torch, as eager with the quant custom op, and as the plain ops compiled by Inductor
(which fuses them into one generated kernel: the alternative to our pass). Microseconds per
call at 1, 16 and 128 tokens.

Part 2 (model): a random-weight FP8 Llama (static per-tensor scales, so all three fusions
apply) at -O2 with every fusion on, with each fusion off in turn, and with all off; and the
same weights as a bfloat16 checkpoint at -O2. Decode tokens/s at batch 1 and 16: every
configuration is built first, then measured in interleaved rounds (the machine is shared, so
each sees the same load), best of the rounds.

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


def bench_gemm(size: int, tokens: list[int]) -> list[dict]:
    """The FP8 GEMM on this CPU: torch._scaled_mm against what Fp8LinearMethod does here
    (the quantized activation times the weight dequantized once to bf16) and a bf16 GEMM."""
    import torch
    import torch.nn.functional as F

    w = torch.randn(size, size) * 0.05
    w_scale = w.abs().amax() / 448
    w_q = (w / w_scale).to(torch.float8_e4m3fn)
    w_deq = (w_q.float() * w_scale).to(torch.bfloat16)
    rows = []
    for n in tokens:
        x = torch.randn(n, size)
        x_scale = x.abs().amax() / 448
        q = (x / x_scale).to(torch.float8_e4m3fn)
        calls = 5
        x_bf16, s_bf16 = x.to(torch.bfloat16), x_scale.to(torch.bfloat16)
        row = {"tokens": n, "size": size,
               "dequant_bf16_us": _best_us(functools.partial(_dequant_mm, q, w_deq, s_bf16),
                                           calls),
               "bf16_us": _best_us(functools.partial(F.linear, x_bf16, w_deq), calls)}
        try:
            row["scaled_mm_us"] = _best_us(functools.partial(
                torch._scaled_mm, q, w_q.t(), scale_a=x_scale, scale_b=w_scale,
                out_dtype=torch.bfloat16), calls, repeats=2)
        except (RuntimeError, NotImplementedError):
            row["scaled_mm_us"] = None
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _dequant_mm(q, w_deq, scale):
    import torch
    import torch.nn.functional as F

    return F.linear(q.to(torch.bfloat16), w_deq) * scale


# ---- part 2: model -----------------------------------------------------------------------------
def _ensure_compiled_llama() -> None:
    from vllm.compilation.decorators import support_torch_compile
    from vllm.model_executor.models.llama import LlamaModel

    if not getattr(LlamaModel, "_vllm_compile_decorated", False):
        support_torch_compile(LlamaModel)


def bench_model(args: argparse.Namespace) -> list[dict]:
    """Every configuration is built (and compiled) in this process first; then the
    measurements are interleaved, round after round (config A, B, ..., then A, B, ...
    again), so every configuration sees the same machine load. Best per configuration."""
    import torch

    from tests.quantization.fp8_checkpoints import make_fp8_llama

    torch._dynamo.config.recompile_limit = 64  # one compiled forward per configuration
    _ensure_compiled_llama()
    from vllm import LLM
    from vllm.compilation.passes.fusion.matcher_utils import fusion_match_counter

    root = args.checkpoint_dir or tempfile.mkdtemp(prefix="fp8_bench_")
    path = os.path.join(root, "fp8-static")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        make_fp8_llama(path, layout="fp8", weights="tensor", activations="static",
                       dtype="bfloat16", **SHAPE)
    backend = {"backend": "inductor"}
    configs = [("FP8, all fusions (default -O2)", path, backend)]
    for flag in FUSION_FLAGS:
        configs.append((f"FP8, without {flag}", path, {**backend, "pass_config": {flag: False}}))
    configs.append(("FP8, no fusions", path,
                    {**backend, "pass_config": dict.fromkeys(FUSION_FLAGS, False)}))
    configs.append(("bfloat16 (same weights, dequantized)", path + "-dequant", backend))

    engines, results = [], []
    for label, model_path, cc in configs:
        before = dict(fusion_match_counter)
        start = time.perf_counter()
        llm = LLM(model=model_path, dtype=args.dtype, optimization_level=2, max_model_len=512,
                  max_num_seqs=max(args.batches), compilation_config=cc)
        vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
        _generate(llm, vocab, max(args.batches), 4)  # compile and warm up
        for batch in args.batches:
            _generate(llm, vocab, batch, 2)
        matches = {k: v - before.get(k, 0) for k, v in fusion_match_counter.items()
                   if v - before.get(k, 0)}
        engines.append((llm, vocab))
        results.append({"label": label, "startup_s": time.perf_counter() - start,
                        "fusion_matches": matches, "full_s": {}, "prefill_s": {}})
        print(f"built {label}: {matches}", flush=True)
    n = args.decode_tokens
    for round_index in range(args.rounds):
        for (llm, vocab), result in zip(engines, results):
            for batch in args.batches:
                key = str(batch)
                full = min(_generate(llm, vocab, batch, n + 1) for _ in range(args.repeats))
                prefill = min(_generate(llm, vocab, batch, 1) for _ in range(args.repeats))
                result["full_s"][key] = min(result["full_s"].get(key, full), full)
                result["prefill_s"][key] = min(result["prefill_s"].get(key, prefill), prefill)
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    for result in results:
        result["decode_tok_s"] = {
            key: int(key) * n / max(result["full_s"][key] - result["prefill_s"][key], 1e-9)
            for key in result["full_s"]}
        print(json.dumps(result), flush=True)
    return results


def _generate(llm, vocab: int, batch: int, max_tokens: int) -> float:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(16)]}
               for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


# ---- report --------------------------------------------------------------------------------------
def write_report(ops: list[dict], gemm: list[dict], model: list[dict],
                 args: argparse.Namespace) -> None:
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
    if gemm:
        lines += ["## FP8 GEMM on this CPU (microseconds, lower is better)", "",
                  f"{gemm[0]['size']}x{gemm[0]['size']} weight. Fp8LinearMethod uses the "
                  "dequantized path on the CPU.", "",
                  "| tokens | torch._scaled_mm | FP8 activations x dequantized bf16 weight | "
                  "bf16 GEMM |", "|---:|---:|---:|---:|"]
        for r in gemm:
            mm = f"{r['scaled_mm_us']:.0f}" if r["scaled_mm_us"] is not None else "fails"
            lines.append(f"| {r['tokens']} | {mm} | {r['dequant_bf16_us']:.0f} | "
                         f"{r['bf16_us']:.0f} |")
        lines.append("")
    if model:
        batches = [str(b) for b in args.batches]
        base = model[0]["decode_tok_s"]
        lines += ["## FP8 Llama at -O2 (Inductor), decode tokens/s (higher is better)", "",
                  f"Shape: {SHAPE}; {args.dtype}; static per-tensor FP8 scales; "
                  f"{args.threads or 'default'} torch thread(s); every configuration built "
                  f"first, then measured in {args.rounds} interleaved rounds x {args.repeats} "
                  "repetitions, best kept.", "",
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
        json.dump({"meta": meta, "ops": ops, "gemm": gemm, "model": model}, f, indent=2)
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
                        help="torch threads (0: torch's default); 1 is steadier on a shared "
                             "machine")
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    ops = [] if args.skip_ops else [row for dtype in args.op_dtypes
                                    for row in bench_ops(args.op_hidden, args.op_tokens, dtype)]
    gemm = [] if args.skip_ops else bench_gemm(2048, [1, 16])
    model = [] if args.skip_model else bench_model(args)
    write_report(ops, gemm, model, args)


if __name__ == "__main__":
    main()
