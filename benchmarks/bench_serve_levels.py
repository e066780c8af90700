"""`vllm serve` at several optimization levels, side by side: start-up time and serving
performance under the same load (`vllm bench serve`).

For each level a fresh server process is started; start-up is timed from the process start
to the first healthy `/health`, and the engine's own start-up phases are read from
`/metrics`. A short warm-up load runs first (so lazily compiled shapes are not billed to the
measured run), then the measured load. Results go to `<output-dir>/<name>.md` (a table) and
`<name>.json`.

    python benchmarks/bench_serve_levels.py                      # demo model, -O0 vs -O2
    python benchmarks/bench_serve_levels.py --model ./m --levels 0,1,2 --num-prompts 128
    python benchmarks/bench_serve_levels.py --modes thread,process --rounds 3 \
        --name serve_levels_engine_core      # engine thread vs engine-core process

`--llamacpp model.gguf` adds llama.cpp's own server (llama-cpp-python's `llama_cpp.server`,
`pip install 'llama-cpp-python[server]'`) on the same weights in GGUF (benchmarks/
gguf_convert.py), same thread count, under the same load: prompts sent as text (it takes no
token ids), exact output lengths through min_tokens, repeat_penalty 1.0 (its default is 1.1),
requests queued rather than interrupted (`--interrupt_requests False`: by default a new
request ends the one streaming),
output tokens counted from its usage or, without one, as its streamed chunks (one a token).

    python benchmarks/bench_serve_levels.py --model ./qwen05b --llamacpp ./qwen05b.gguf \
        --levels 0,2 --rounds 2 --name serve_vs_llamacpp

`--modes`: where the engine runs (VLLM_ENABLE_MULTIPROCESSING): `thread` (in the API process)
and/or `process` (an engine-core process). With `--rounds N` every (mode, level) server runs
N times, the rounds interleaved (round 1 of every configuration, then round 2, ...), and the
table shows each configuration's median round; the ratio lines compare the medians.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from vllm.benchmarks.serve import add_cli_args, run_benchmark  # noqa: E402
from vllm.entrypoints.openai.metrics import parse_metrics  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODE_ENV = {"thread": "0", "process": "1"}


def start_server(model: str, level: int, port: int, extra: list[str], log_path: str,
                 timeout: float, compile_cache: bool = True,
                 mode: str | None = None) -> tuple[subprocess.Popen, float]:
    """Start `vllm serve` and wait until /health answers; returns (process, seconds)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, f"-O{level}",
           "--port", str(port), "--disable-uvicorn-access-log", *extra]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not compile_cache:
        env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    if mode is not None:
        env["VLLM_ENABLE_MULTIPROCESSING"] = MODE_ENV[mode]
    return _start_and_wait(cmd, env, f"http://127.0.0.1:{port}/health", f"-O{level} server",
                           log_path, timeout)


def _start_and_wait(cmd: list[str], env: dict | None, url: str, what: str, log_path: str,
                    timeout: float) -> tuple[subprocess.Popen, float]:
    """Start `cmd` (output to `log_path`) and wait until `url` answers 200; returns (process,
    seconds)."""
    import httpx

    log = open(log_path, "w")  # noqa: SIM115 - owned by the process
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return proc, time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{what} not ready after {timeout} s; see {log_path}")


LLAMACPP = "llama.cpp"


def start_llamacpp_server(gguf: str, port: int, threads: int, n_ctx: int, log_path: str,
                          timeout: float) -> tuple[subprocess.Popen, float]:
    """Start llama-cpp-python's OpenAI server on `gguf`; wait until /v1/models answers."""
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
           "--n_ctx", str(n_ctx), "--model_alias", os.path.basename(gguf),
           # its default stops the streaming request whenever a new one arrives (each
           # request of a concurrent load then ends after a token or two); queue them instead
           "--interrupt_requests", "False"]
    return _start_and_wait(cmd, None, f"http://127.0.0.1:{port}/v1/models",
                           "llama.cpp server", log_path, timeout)


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def bench_args(args: argparse.Namespace, port: int, num_prompts: int, label: str,
               seed: int, llamacpp: bool = False) -> argparse.Namespace:
    parser = add_cli_args(argparse.ArgumentParser())
    argv = ["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(num_prompts),
            "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--random-range-ratio", str(args.range_ratio),
            "--request-rate", str(args.request_rate), "--seed", str(seed), "--ignore-eos",
            "--label", label, "--metric-percentiles", "50,90,99"]
    if args.max_concurrency:
        argv += ["--max-concurrency", str(args.max_concurrency)]
    if llamacpp:  # same prompts as text, greedy without its default repeat penalty
        argv += ["--tokenizer", args.model, "--text-prompts",
                 "--extra-body", json.dumps({"repeat_penalty": 1.0})]
    return parser.parse_args(argv)


def startup_phases(port: int) -> dict[str, float]:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    phases = {}
    for key, value in parse_metrics(text).items():
        if key.startswith("vllm:startup_phase_seconds{"):
            phase = key.split('phase="', 1)[1].split('"', 1)[0]
            phases[phase] = value
    return phases


def run_level(args: argparse.Namespace, level: int | str, log_dir: str,
              mode: str | None = None, round_index: int = 0) -> dict:
    """One server (a level of ours, or LLAMACPP: llama.cpp's server), warm-up, measured load."""
    port = free_port()
    llamacpp = level == LLAMACPP
    name = LLAMACPP if llamacpp else f"O{level}"
    tag = f"{mode}-" if mode and not llamacpp else ""
    log_path = os.path.join(log_dir, f"serve_{tag}{name}_r{round_index}.log")
    print(f"{'llama.cpp server' if llamacpp else (mode or 'default') + ' engine, ' + name} "
          f"(round {round_index + 1}): starting the server (log: {log_path})", flush=True)
    if llamacpp:
        proc, startup_s = start_llamacpp_server(args.llamacpp, port, args.llamacpp_threads,
                                                args.llamacpp_ctx, log_path,
                                                args.startup_timeout)
    else:
        proc, startup_s = start_server(args.model, level, port, args.serve_arg, log_path,
                                       args.startup_timeout, args.compile_cache == "on", mode)
    try:
        print(f"{name}: ready after {startup_s:.1f} s; warming up", flush=True)
        warmup_s = 0.0
        if args.warmup_prompts:  # its duration: the load only, not the tokenizer loading
            warm = asyncio.run(run_benchmark(bench_args(args, port, args.warmup_prompts,
                                                        f"{name}-warmup", seed=args.seed + 1,
                                                        llamacpp=llamacpp)))
            warmup_s = warm["duration_s"]
        print(f"{name}: measuring {args.num_prompts} requests", flush=True)
        result = asyncio.run(run_benchmark(bench_args(args, port, args.num_prompts, name,
                                                      seed=args.seed, llamacpp=llamacpp)))
        phases = {} if llamacpp else startup_phases(port)
    finally:
        code = stop_server(proc)
    result.update(level=level, name=name, mode=None if llamacpp else mode, round=round_index,
                  startup_to_healthy_s=startup_s, warmup_s=warmup_s, startup_phases=phases,
                  exit_code=code)
    return result


def _name(r: dict) -> str:
    return r.get("name") or f"O{r['level']}"


def median_rounds(rounds: list[dict]) -> dict:
    """The round with the median output throughput (its other figures with it), plus every
    round's throughput."""
    ordered = sorted(rounds, key=lambda r: r["output_throughput"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["rounds_output_throughput"] = [r["output_throughput"] for r in rounds]
    return chosen


def modes_markdown(results: list[dict], args: argparse.Namespace) -> str:
    """Thread vs process x levels: throughput, TTFT and ITL percentiles, ratios."""
    lines = [
        f"# `vllm serve`: engine thread vs engine-core process, by level ({args.model})", "",
        f"Load: {args.num_prompts} requests, input {args.input_len} / output {args.output_len} "
        f"tokens (±{args.range_ratio:.0%}), request rate {args.request_rate}, max concurrency "
        f"{args.max_concurrency or 'unlimited'}, temperature 0, ignore_eos; compile cache "
        f"{args.compile_cache}; {args.rounds} interleaved round(s), median shown. Machine: "
        f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}.", "",
        "| engine | level | start-up (s) | output tok/s (rounds) | req/s | TTFT p50 / p90 / p99 "
        "(ms) | ITL p50 / p90 / p99 (ms) | TPOT mean (ms) | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["mode"], r["level"]): r for r in results}
    for r in results:
        rounds = ", ".join(f"{x:.0f}" for x in r["rounds_output_throughput"])
        lines.append(
            f"| {r['mode'] or '-'} | {_name(r)} | {r['startup_to_healthy_s']:.1f} | "
            f"{r['output_throughput']:.1f} ({rounds}) | {r['request_throughput']:.2f} | "
            f"{r['median_ttft_ms']:.0f} / {r.get('p90_ttft_ms', 0):.0f} / "
            f"{r['p99_ttft_ms']:.0f} | {r['median_itl_ms']:.1f} / {r.get('p90_itl_ms', 0):.1f} "
            f"/ {r['p99_itl_ms']:.1f} | {r['mean_tpot_ms']:.1f} | {r['failed']} |")
    lines.append("")
    ours = [r for r in results if r["level"] != LLAMACPP]
    modes = list(dict.fromkeys(r["mode"] for r in ours))
    levels = list(dict.fromkeys(r["level"] for r in ours))
    base_level = levels[0]
    for mode in modes:
        for level in levels[1:]:
            a, b = by_key.get((mode, level)), by_key.get((mode, base_level))
            if a and b and b["output_throughput"]:
                lines.append(f"{mode}: O{level} vs O{base_level} output throughput "
                             f"x{a['output_throughput'] / b['output_throughput']:.2f}")
    if "thread" in modes and "process" in modes:
        for level in levels:
            a, b = by_key.get(("process", level)), by_key.get(("thread", level))
            if a and b and b["output_throughput"]:
                lines.append(f"O{level}: process vs thread output throughput "
                             f"x{a['output_throughput'] / b['output_throughput']:.2f}, "
                             f"ITL p50 x{a['median_itl_ms'] / max(b['median_itl_ms'], 1e-9):.2f}")
    if args.note:
        lines += ["", args.note]
    return "\n".join(lines) + "\n"


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"# `vllm serve` by optimization level ({args.model})", "",
        f"Load: {args.num_prompts} requests, input {args.input_len} / output {args.output_len} "
        f"tokens (±{args.range_ratio:.0%}), request rate {args.request_rate}, max concurrency "
        f"{args.max_concurrency or 'unlimited'}, temperature 0, ignore_eos; compile cache "
        f"{args.compile_cache} (-O1+ compile on the first requests, so in the warm-up "
        "column). Machine: "
        f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}.", "",
        "| level | start-up to healthy (s) | engine phases (s) | warm-up (s) | req/s | "
        "output tok/s | TTFT mean / median / p99 (ms) | TPOT mean (ms) | ITL p50 / p99 (ms) | "
        "failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r["startup_phases"].items()) or "-"
        lines.append(
            f"| {_name(r)} | {r['startup_to_healthy_s']:.1f} | {phases} | "
            f"{r['warmup_s']:.1f} | {r['request_throughput']:.2f} | "
            f"{r['output_throughput']:.1f} | {r['mean_ttft_ms']:.0f} / {r['median_ttft_ms']:.0f} / "
            f"{r['p99_ttft_ms']:.0f} | {r['mean_tpot_ms']:.1f} | {r['median_itl_ms']:.1f} / "
            f"{r['p99_itl_ms']:.1f} | "
            f"{r['failed']} |")
    ours = [r for r in results if r["level"] != LLAMACPP]
    if len(ours) >= 2:
        base = ours[0]
        lines.append("")
        for r in ours[1:]:
            speed = r["output_throughput"] / base["output_throughput"] \
                if base["output_throughput"] else float("nan")
            start = r["startup_to_healthy_s"] / base["startup_to_healthy_s"]
            lines.append(f"{_name(r)} vs {_name(base)}: output throughput x{speed:.2f}, "
                         f"start-up x{start:.2f}.")
    if args.note:
        lines += ["", args.note]
    return "\n".join(lines) + "\n"


def llamacpp_lines(results: list[dict]) -> str:
    """Each of our configurations against llama.cpp's server (when it ran)."""
    base = next((r for r in results if r["level"] == LLAMACPP), None)
    if base is None:
        return ""
    lines = [""]
    ours = [r for r in results if r is not base]
    if ours and base["total_output_tokens"] < 0.95 * ours[0]["total_output_tokens"]:
        lines.append(f"llama.cpp server generated {base['total_output_tokens']} of the "
                     f"{ours[0]['total_output_tokens']} output tokens asked for: its figures "
                     "below are not comparable.")
    for r in ours:
        if not base["output_throughput"]:
            continue
        where = f"{r['mode']} " if r.get("mode") else ""
        lines.append(
            f"{where}{_name(r)} vs llama.cpp server: output throughput "
            f"x{r['output_throughput'] / base['output_throughput']:.2f}, TTFT p50 "
            f"{r['median_ttft_ms']:.0f} vs {base['median_ttft_ms']:.0f} ms, ITL p50 "
            f"{r['median_itl_ms']:.1f} vs {base['median_itl_ms']:.1f} ms")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--levels", default="0,2", help="Comma-separated, e.g. 0,1,2,3.")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--warmup-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=1800.0)
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="Extra flag for `vllm serve` (repeat; e.g. "
                        "--serve-arg=--max-num-seqs=32).")
    parser.add_argument("--output-dir", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default="serve_levels")
    parser.add_argument("--compile-cache", choices=["on", "off"], default="off",
                        help="off (default): every server compiles from scratch "
                        "(VLLM_DISABLE_COMPILE_CACHE=1); on: reuse the on-disk cache.")
    parser.add_argument("--note", default=None, help="A line added under the table.")
    parser.add_argument("--modes", default=None,
                        help="Comma-separated engine placements: thread (in the API "
                        "process), process (engine-core process). Default: the server's own "
                        "default, one table row per level.")
    parser.add_argument("--rounds", type=int, default=1,
                        help="Interleaved rounds per configuration (medians reported).")
    parser.add_argument("--llamacpp", default=None, metavar="GGUF",
                        help="Also serve these weights (GGUF) with llama.cpp's own server "
                        "(llama-cpp-python) under the same load.")
    parser.add_argument("--llamacpp-threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="llama.cpp's threads (default: the CPUs this process may use, "
                        "as our server).")
    parser.add_argument("--llamacpp-ctx", type=int, default=4096,
                        help="llama.cpp's context size (n_ctx).")
    parser.add_argument("--log-dir", default=None,
                        help="Server logs (default: a new temporary folder).")
    args = parser.parse_args()
    try:  # the load generator's tokenizer: import once here, not inside the timed warm-up
        import transformers  # noqa: F401
    except ImportError:
        pass
    # Read torch & co. from disk once, so the first level's start-up is not billed for it.
    subprocess.run([sys.executable, "-c", "import torch, transformers"], check=False)
    os.makedirs(args.output_dir, exist_ok=True)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench_serve_levels_")
    os.makedirs(log_dir, exist_ok=True)
    levels = [int(level) for level in args.levels.split(",")]
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    modes = [m.strip() for m in args.modes.split(",")] if args.modes else [None]
    bad = [m for m in modes if m is not None and m not in MODE_ENV]
    if bad:
        parser.error(f"--modes: unknown {bad}; use thread and/or process")
    if args.llamacpp and not os.path.isfile(args.llamacpp):
        parser.error(f"--llamacpp: no such GGUF file {args.llamacpp!r}")
    runs: dict[tuple, list[dict]] = {}
    for round_index in range(args.rounds):
        if args.llamacpp:
            runs.setdefault((None, LLAMACPP), []).append(
                run_level(args, LLAMACPP, log_dir, None, round_index))
        for mode in modes:
            for level in levels:
                runs.setdefault((mode, level), []).append(
                    run_level(args, level, log_dir, mode, round_index))
    results = [median_rounds(rounds) for rounds in runs.values()]
    md_path = os.path.join(args.output_dir, f"{args.name}.md")
    json_path = os.path.join(args.output_dir, f"{args.name}.json")
    with open(json_path, "w") as f:
        json.dump({"args": vars(args), "results": results,
                   "all_rounds": [r for rounds in runs.values() for r in rounds]}, f, indent=2)
    table = modes_markdown(results, args) if args.modes else markdown(results, args)
    table += llamacpp_lines(results)
    with open(md_path, "w") as f:
        f.write(table)
    print(table)
    print(f"wrote {md_path} and {json_path}")
    return 0 if all(r["failed"] == 0 and r["exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
