"""Decode speed with one core taken by another process, before and after issue 21's thread
handling (vllm/utils/cpu_threads.py, vllm/utils/omp_env.py).

Every measurement is a fresh engine process (`LLM`, batch-1 by default, a 32-token prompt)
that times requests of 1 and of N new tokens; per-token decode = (t_N - t_1) / (N - 1),
median over the repetitions. "busy" runs a `python -c 'while True: pass'` pinned with taskset
to the last CPU of this process's affinity for the whole child (start-up included, as a user
would meet it); "idle" runs without it. Variants, interleaved round by round:

  before   the old behaviour: torch's default threads, no contention governor, libgomp's own
           wait policy (VLLM_CPU_ADAPTIVE_THREADS=0 VLLM_CPU_OMP_WAIT_POLICY=default)
  after    the defaults now (the governor, OMP_WAIT_POLICY=PASSIVE set on import vllm)
  after_gomp_default  `after` with libgomp's own wait policy (VLLM_CPU_OMP_WAIT_POLICY=default)
  spin10k, spin1k  `after` with GOMP_SPINCOUNT=10000 / 1000 instead of PASSIVE (spin a
           little at each barrier before sleeping: cheaper wake-ups idle)
  before_passive / before_spin10k  `before` with OMP_WAIT_POLICY=PASSIVE / GOMP_SPINCOUNT=10000
           (the wait policy alone, without the governor)
  omp1     OMP_NUM_THREADS=1 (the user's own fix; a reference)

Goal (issue 21 section 3): busy / idle per token <= 2 for `after`.

    python benchmarks/bench_busy_core.py                       # demo + llama-50m, -O2
    python benchmarks/bench_busy_core.py --models demo --rounds 1 --tokens 8 --reps 1 -O 0 \
        --variants before,after --out busy_core_smoke             # a smoke run

Results: benchmarks/results/<out>.md and .json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

VARIANTS = {
    "before": {"VLLM_CPU_ADAPTIVE_THREADS": "0", "VLLM_CPU_OMP_WAIT_POLICY": "default"},
    "after": {},
    "after_gomp_default": {"VLLM_CPU_OMP_WAIT_POLICY": "default"},
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "spin1k": {"GOMP_SPINCOUNT": "1000"},
    "before_passive": {"VLLM_CPU_ADAPTIVE_THREADS": "0", "OMP_WAIT_POLICY": "PASSIVE"},
    "before_spin10k": {"VLLM_CPU_ADAPTIVE_THREADS": "0", "GOMP_SPINCOUNT": "10000"},
    "omp1": {"OMP_NUM_THREADS": "1"},
}
# Variables the parent's environment must not leak into a variant.
CLEARED = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS",
           "VLLM_CPU_ADAPTIVE_THREADS", "VLLM_CPU_OMP_WAIT_POLICY", "VLLM_CPU_OMP_THREADS_BIND")


def child(args: argparse.Namespace) -> None:
    """One engine process: print one JSON line with the timings."""
    t_start = time.perf_counter()
    # vllm first: its import sets the OpenMP wait policy, which libgomp reads when torch loads.
    from vllm import LLM, SamplingParams  # noqa: I001
    import torch

    llm = LLM(model=args.model_path, optimization_level=args.O, max_model_len=512, seed=0)
    load_s = time.perf_counter() - t_start
    prompt = {"prompt_token_ids": [(i * 7 + 3) % 200 + 10 for i in range(args.prompt_len)]}
    prompts = [prompt] * args.batch
    many = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, many, use_tqdm=False)  # the first request: contention detected here
    first_s = time.perf_counter() - t
    per_token = []
    for _ in range(args.reps):
        t = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate(prompts, many, use_tqdm=False)
        tn = time.perf_counter() - t
        per_token.append((tn - t1) / max(1, args.tokens - 1))
    print("RESULT " + json.dumps({
        "per_token_ms": statistics.median(per_token) * 1e3,
        "per_token_all_ms": [x * 1e3 for x in per_token],
        "first_request_s": first_s, "load_s": load_s,
        "threads_end": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "cpu_s": time.process_time(), "wall_s": time.perf_counter() - t_start,
    }), flush=True)


def start_hog(cpu: int) -> subprocess.Popen:
    return subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c",
                             "while True: pass"])


def measure(args, model_path: str, variant: str, busy: bool, hog_cpu: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(VARIANTS[variant])
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model-path", model_path,
           "-O", str(args.O), "--tokens", str(args.tokens), "--reps", str(args.reps),
           "--batch", str(args.batch), "--prompt-len", str(args.prompt_len)]
    hog = start_hog(hog_cpu) if busy else None
    try:
        if hog is not None:
            time.sleep(0.3)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-800:]}"}
    out = json.loads(line[len("RESULT "):])
    out["warned"] = "CPU contention" in proc.stderr
    return out


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def report(args, runs: list[dict], path_md: str, path_json: str) -> None:
    with open(path_json, "w") as f:
        json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    load = os.getloadavg()
    lines = [
        "# Decode with one busy core: before / after issue 21's thread handling",
        "",
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}; {platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} CPUs in the affinity set, Python "
        f"{platform.python_version()}; load average at the end {load[0]:.1f}, {load[1]:.1f}, "
        f"{load[2]:.1f}. `-O{args.O}`, batch {args.batch}, {args.prompt_len}-token prompt, "
        f"{args.tokens} new tokens, {args.reps} repetition(s) per process, {args.rounds} "
        "interleaved round(s), a fresh process per cell; busy = a `while True: pass` pinned "
        f"to CPU {args.hog_cpu} for the whole process.",
        "",
        "Per-token decode, median over rounds (ms); busy/idle is the goal's ratio (<= 2). "
        "First request: the first N-token request of a process (contention detection "
        "happens inside it).",
        "",
    ]
    for model in args.models:
        lines += [f"## {model}", "",
                  "| variant | idle ms/token | busy ms/token | busy / idle | first request "
                  "idle / busy (s) | threads at the end, busy | warned, busy |",
                  "|---|---|---|---|---|---|---|"]
        cell = {}
        for variant in args.variants:
            rows = {b: [r for r in runs if r["model"] == model and r["variant"] == variant
                        and r["busy"] == b and "error" not in r] for b in (False, True)}
            idle = med([r["per_token_ms"] for r in rows[False]])
            busy = med([r["per_token_ms"] for r in rows[True]])
            cell[variant] = (idle, busy)
            ratio = busy / idle if idle and busy else None
            threads = sorted({r["threads_end"] for r in rows[True]})
            warned = sorted({r["warned"] for r in rows[True]})
            lines.append(
                f"| {variant} | {fmt(idle)} | {fmt(busy)} | {fmt(ratio)}x | "
                f"{fmt(med([r['first_request_s'] for r in rows[False]]))} / "
                f"{fmt(med([r['first_request_s'] for r in rows[True]]))} | "
                f"{','.join(map(str, threads)) or '-'} | "
                f"{','.join(map(str, warned)) or '-'} |")
        if "before" in cell and "after" in cell:
            (bi, bb), (ai, ab) = cell["before"], cell["after"]
            lines += ["", f"after / before: idle {fmt(ai / bi if ai and bi else None)}x, "
                          f"busy {fmt(ab / bb if ab and bb else None)}x (below 1 = faster)."]
        errors = [r for r in runs if r["model"] == model and "error" in r]
        for r in errors:
            lines.append(f"\nerror ({r['variant']}, {'busy' if r['busy'] else 'idle'}): "
                         f"`{r['error'][-300:]}`")
        lines.append("")
    with open(path_md, "w") as f:
        f.write("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-path", help=argparse.SUPPRESS)
    p.add_argument("--models", default="demo,llama-50m",
                   help="comma list: demo and/or shapes of benchmarks/checkpoints.py")
    p.add_argument("--variants", default="before,after,after_gomp_default,spin1k,omp1",
                   help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("-O", type=int, default=2, help="optimization level")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--hog-cpu", type=int, default=None,
                   help="the CPU the busy process takes (default: the last one we may use)")
    p.add_argument("--ckpt-root", default=os.path.join(HERE, "results", "tmp"),
                   help="where random-weight checkpoints are written (git-ignored)")
    p.add_argument("--out", default="busy_core")
    args = p.parse_args()
    if args.child:
        child(args)
        return
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    if args.hog_cpu is None:
        args.hog_cpu = max(os.sched_getaffinity(0))
    paths = {}
    for m in args.models:
        if m == "demo":
            paths[m] = "demo"
        else:
            sys.path.insert(0, HERE)
            from checkpoints import write_checkpoint

            paths[m] = write_checkpoint(m, args.ckpt_root)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    md = os.path.join(HERE, "results", f"{args.out}.md")
    js = os.path.join(HERE, "results", f"{args.out}.json")
    runs = []
    for rnd in range(args.rounds):
        for model in args.models:
            # Alternate the load order and rotate the variants so no cell always runs first.
            loads = (False, True) if rnd % 2 == 0 else (True, False)
            k = rnd % len(args.variants)
            order = args.variants[k:] + args.variants[:k]
            for busy in loads:
                for variant in order:
                    r = measure(args, paths[model], variant, busy, args.hog_cpu)
                    r.update(model=model, variant=variant, busy=busy, round=rnd)
                    runs.append(r)
                    print(f"round {rnd} {model} {variant:14s} {'busy' if busy else 'idle'}: "
                          + (f"{r['per_token_ms']:.2f} ms/token, first request "
                             f"{r['first_request_s']:.2f} s, threads {r['threads_end']}"
                             if "error" not in r else r["error"][-200:]), flush=True)
            report(args, runs, md, js)
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
