"""Start-up time per optimization level: cold (empty compile caches) and warm starts.

Every run is a fresh process that builds the engine (`LLMEngine.from_engine_args`) and exits.
A cold run gets empty compile caches (ours, `compilation_config.cache_dir`, and Inductor's,
`TORCHINDUCTOR_CACHE_DIR`); the warm runs then reuse the directories the first cold run
filled. Kernels built once per machine under `VLLM_CACHE_ROOT` (not compile caches) are built
by one untimed -O0 start first. For each level (`-O`, repeated `-O0 -O2`, or
`--levels 0,1,2,3`) it reports the median and the spread (max - min) over `--num-runs` runs
(or upstream's `--num-iters-cold` / `--num-iters-warm`, after `--num-iters-warmup` untimed
warm starts) of the engine's start-up wall time (from the start of config resolution to
ready, as the engine's phase table reports it) and of the process time (spawn to ready,
Python imports included), plus the median seconds of each start-up phase. `--output-json`
writes everything.

    vllm bench startup --model demo -O2 --num-runs 3
    vllm bench startup --model demo -O0 -O2
    vllm bench startup --model demo --levels 0,1,2,3 --output-json startup.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_RESULT = "STARTUP_RESULT "


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import non_negative_int, positive_int

    EngineArgs.add_cli_args(parser, repeatable_level=True)
    group = parser.add_argument_group("start-up benchmark")
    group.add_argument("--levels", default=None,
                       help="Comma-separated levels to measure, e.g. 0,1,2,3 (default: the "
                       "-O flags, which may be repeated: -O0 -O2; else 2).")
    group.add_argument("--num-runs", type=positive_int, default=3,
                       help="Cold runs and warm runs per level (each a fresh process).")
    group.add_argument("--num-iters-cold", type=positive_int, default=None,
                       help="Cold runs per level (upstream's name; default: --num-runs).")
    group.add_argument("--num-iters-warm", type=positive_int, default=None,
                       help="Timed warm runs per level (upstream's name; default: --num-runs).")
    group.add_argument("--num-iters-warmup", type=non_negative_int, default=0,
                       help="Untimed warm starts before the timed ones (default: 0; the cold "
                       "runs already filled the caches).")
    group.add_argument("--timeout", type=float, default=1800.0,
                       help="Seconds one start may take before it counts as failed.")
    group.add_argument("--keep-cache-dirs", action="store_true",
                       help="Do not delete the temporary cache directories.")
    group.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    return parser


def _iterations(args: argparse.Namespace) -> tuple[int, int, int]:
    """(cold runs, untimed warm-ups, timed warm runs) per level."""
    cold = args.num_iters_cold if args.num_iters_cold is not None else args.num_runs
    warm = args.num_iters_warm if args.num_iters_warm is not None else args.num_runs
    return cold, args.num_iters_warmup, warm


def _levels(args: argparse.Namespace) -> list[int]:
    from vllm.config.vllm import OptimizationLevel

    if args.levels:
        return [int(OptimizationLevel.parse(x)) for x in args.levels.split(",") if x.strip()]
    levels = args.optimization_level  # every -O given, in order (a repeatable option here)
    if not levels:
        return [2]
    return list(dict.fromkeys(int(OptimizationLevel.parse(x)) for x in levels))


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings but the level (each start sets its own)."""
    from vllm.engine.arg_utils import EngineArgs

    engine_args = EngineArgs.from_cli_args(argparse.Namespace(
        **{**vars(args), "optimization_level": None}))
    engine_args.disable_log_stats = True
    kwargs = dataclasses.asdict(engine_args)
    cc = engine_args.compilation_config
    if cc is not None and not isinstance(cc, (dict, str, int)):  # a parsed -cc
        kwargs["compilation_config"] = cc.non_default_dict()
    return kwargs


def start_once(engine_kwargs: dict[str, Any], cache_dir: str, inductor_dir: str,
               timeout: float) -> dict[str, Any]:
    """Start the engine in a fresh process with these compile-cache directories; its
    report."""
    cc = engine_kwargs.get("compilation_config") or {}
    if isinstance(cc, str):
        cc = json.loads(cc)
    engine_kwargs = dict(engine_kwargs, compilation_config={**cc, "cache_dir": cache_dir})
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir)
    env.pop("VLLM_DISABLE_COMPILE_CACHE", None)
    spawned = time.time()
    proc = subprocess.run([sys.executable, "-m", "vllm.benchmarks.startup", "--child",
                           json.dumps(engine_kwargs)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"start-up run failed (exit code {proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len(_RESULT):])
    result["process_seconds"] = result.pop("ready_time") - spawned
    return result


def _child(payload: str) -> int:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(**json.loads(payload)))
    report = {"ready_time": time.time(), "engine_seconds": engine.startup_seconds,
              "phases": engine.startup_phases, "cache": _cache_counts()}
    engine.shutdown()
    print(_RESULT + json.dumps(report), flush=True)
    return 0


def _cache_counts() -> dict[str, int]:
    from vllm.compilation.counter import compilation_counter as c

    return {"hits": c.num_cache_hits, "misses": c.num_cache_misses,
            "inductor_compiles": c.num_inductor_compiles, "dynamo_traces": c.num_graphs_seen,
            "graphs_loaded": c.num_graphs_loaded}


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "spread": max(values) - min(values)}


def measure_level(engine_kwargs: dict[str, Any], level: int, iterations: tuple[int, int, int],
                  timeout: float, keep: bool) -> dict[str, Any]:
    """`iterations`: (cold runs, untimed warm-up starts, timed warm runs)."""
    num_cold, num_warmup, num_warm = iterations
    kwargs = dict(engine_kwargs, optimization_level=level)
    dirs: list[str] = []
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    try:
        for _ in range(num_cold):
            root = tempfile.mkdtemp(prefix=f"vllm-startup-O{level}-")
            dirs.append(root)
            runs["cold"].append(start_once(kwargs, os.path.join(root, "vllm"),
                                           os.path.join(root, "inductor"), timeout))
        for i in range(num_warmup + num_warm):
            run = start_once(kwargs, os.path.join(dirs[0], "vllm"),
                             os.path.join(dirs[0], "inductor"), timeout)
            if i >= num_warmup:
                runs["warm"].append(run)
    finally:
        if not keep:
            for root in dirs:
                shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = {"level": level, "runs": runs}
    for kind, items in runs.items():
        result[kind] = {
            "engine_seconds": _stats([r["engine_seconds"] for r in items]),
            "process_seconds": _stats([r["process_seconds"] for r in items]),
            "phases": {name: statistics.median(r["phases"].get(name, 0.0) for r in items)
                       for name in items[0]["phases"]},
            "cache": items[-1]["cache"],
        }
    return result


def main(args: argparse.Namespace) -> int:
    engine_kwargs = _engine_kwargs(args)
    with tempfile.TemporaryDirectory(prefix="vllm-startup-prime-") as root:
        start_once(dict(engine_kwargs, optimization_level=0), os.path.join(root, "vllm"),
                   os.path.join(root, "inductor"), args.timeout)
    iterations = _iterations(args)
    num_cold, num_warmup, num_warm = iterations
    results = []
    for level in _levels(args):
        warmup = f" (after {num_warmup} untimed)" if num_warmup else ""
        print(f"-O{level}: {num_cold} cold + {num_warm} warm starts{warmup} ...", flush=True)
        results.append(measure_level(engine_kwargs, level, iterations, args.timeout,
                                     args.keep_cache_dirs))
    print(format_table(results))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model, "num_iters_cold": num_cold,
                       "num_iters_warmup": num_warmup, "num_iters_warm": num_warm,
                       "levels": results}, f, indent=1)
    return 0


def format_table(results: list[dict[str, Any]]) -> str:
    """Median (spread) per level; engine = config resolution to ready, process = spawn to
    ready; the warm start against the warm -O0 start when -O0 was measured."""
    base = next((r for r in results if r["level"] == 0), None)
    lines = ["level  start  engine s median (spread)  process s median (spread)  cache "
             "(hits/misses/inductor runs)  vs O0"]
    for r in results:
        for kind in ("cold", "warm"):
            e, p, c = r[kind]["engine_seconds"], r[kind]["process_seconds"], r[kind]["cache"]
            ratio = ""
            if base is not None:
                ratio = f"{e['median'] / base[kind]['engine_seconds']['median']:.2f}x"
            lines.append(f"O{r['level']:<5} {kind:<5}  {e['median']:8.2f} ({e['spread']:5.2f})"
                         f"           {p['median']:8.2f} ({p['spread']:5.2f})"
                         f"            {c['hits']}/{c['misses']}/{c['inductor_compiles']}"
                         f"{'':20}{ratio}")
        phases = r["warm"]["phases"]
        lines.append("        warm phases: " + ", ".join(
            f"{name} {secs:.2f}" for name, secs in phases.items() if secs >= 0.01))
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(_child(sys.argv[2]))
    sys.exit("usage: vllm bench startup --model M -O2 (this module's --child is internal)")
