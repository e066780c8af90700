"""Config resolution and `vllm config` timed in fresh processes, for one or more checkouts.

Three measurements per checkout and round, each in a new Python process:
  resolve       import EngineArgs, then `EngineArgs(model, -O<level>).create_engine_config()`
                (the time inside the process, from before the import to the resolved config);
  resolve+torch the same with torch imported first, as in an engine start (`LLM(...)` imports
                torch before it resolves): the engine's "config resolution" phase, i.e.
                `create_engine_config()` alone, is reported as `engine_phase_s`;
  vllm config   `python -m vllm.entrypoints.cli.main config --model demo -O<level>`: the
                process's wall time and CPU time (user + sys), interpreter start included;
  engine        `LLM(model, -O0)` (with --engine): its start-up phases "config resolution" and
                "tokenizer loading" and its ready time. Resolution no longer imports
                transformers; the tokenizer still does, so that cost now shows in its phase.
Checkouts are interleaved round by round so that the load of a shared machine hits them
alike; the result is the median (and min, max) per checkout and measurement, and which heavy
modules a resolution imported.

    python benchmarks/bench_config_resolution.py                       # this checkout
    git worktree add /tmp/before <commit>
    python benchmarks/bench_config_resolution.py --checkout before=/tmp/before --checkout after=.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

HEAVY = ("torch", "transformers", "torch._dynamo", "torch._inductor", "tokenizers")

RESOLVE = """
import json, sys, time
t0 = time.perf_counter()
if sys.argv[1] == "torch":
    import torch
t1 = time.perf_counter()
from vllm.engine.arg_utils import EngineArgs
t2 = time.perf_counter()
EngineArgs(model=sys.argv[2], optimization_level=int(sys.argv[3])).create_engine_config()
t3 = time.perf_counter()
import vllm
print(json.dumps({"resolve_s": t3 - t1, "engine_phase_s": t3 - t2, "pre_import_s": t1 - t0,
                  "vllm": vllm.__file__,
                  "imported": [m for m in sys.argv[4].split(",") if m in sys.modules]}))
"""


def _env(checkout: str) -> dict[str, str]:
    """The checkout first on the path (the processes also start in it: `-c` and `-m` put the
    working directory before PYTHONPATH)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.abspath(checkout) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_resolve(checkout: str, pre: str, model: str, level: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", RESOLVE, pre, model, str(level), ",".join(HEAVY)],
                          capture_output=True, text=True, env=_env(checkout), cwd=checkout,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"resolution failed in {checkout}:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = os.path.join(os.path.abspath(checkout), "vllm", "__init__.py")
    if os.path.realpath(result["vllm"]) != os.path.realpath(expected):
        raise RuntimeError(f"{checkout}: imported {result['vllm']}, not {expected}")
    return result


ENGINE = """
import json, sys, time
t0 = time.perf_counter()
from vllm import LLM
llm = LLM(model=sys.argv[1], optimization_level=0, kv_cache_memory="16MiB")
phases = llm.llm_engine.startup_phases
print(json.dumps({"config_phase_s": phases["config resolution"],
                  "tokenizer_phase_s": phases["tokenizer loading"],
                  "ready_s": time.perf_counter() - t0}))
"""


def run_engine(checkout: str, model: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", ENGINE, model], capture_output=True, text=True,
                          env=_env(checkout), cwd=checkout, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"engine start failed in {checkout}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_cli(checkout: str, model: str, level: int) -> dict:
    cpu0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "config",
                           "--model", model, f"-O{level}"], capture_output=True, text=True,
                          env=_env(checkout), cwd=checkout, timeout=600)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"vllm config failed in {checkout}:\n{proc.stderr[-3000:]}")
    return {"wall_s": wall, "cpu_s": cpu, "stdout": proc.stdout}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", action="append", default=None,
                        help="NAME=PATH of a checkout to time (repeatable; default: this one).")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--engine", action="store_true",
                        help="Also start an -O0 engine per round and report its phases.")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "config_resolution"),
                        help="Path prefix of the .json and .md results.")
    args = parser.parse_args()
    checkouts = dict(c.split("=", 1) for c in args.checkout or [f"this={REPO}"])
    samples: dict[str, dict[str, list[float]]] = {
        name: {"resolve_s": [], "resolve_torch_s": [], "engine_phase_s": [], "cli_wall_s": [],
               "cli_cpu_s": [],
               **({"engine_config_phase_s": [], "engine_tokenizer_phase_s": [],
                   "engine_ready_s": []} if args.engine else {})} for name in checkouts}
    imported: dict[str, dict[str, list[str]]] = {name: {} for name in checkouts}
    tables: dict[str, str] = {}
    for round_ in range(args.rounds):
        for name, path in checkouts.items():
            cold = run_resolve(path, "none", args.model, args.level)
            warm = run_resolve(path, "torch", args.model, args.level)
            cli = run_cli(path, args.model, args.level)
            s = samples[name]
            s["resolve_s"].append(cold["resolve_s"])
            s["resolve_torch_s"].append(warm["resolve_s"])
            s["engine_phase_s"].append(warm["engine_phase_s"])
            s["cli_wall_s"].append(cli["wall_s"])
            s["cli_cpu_s"].append(cli["cpu_s"])
            imported[name] = {"resolve": cold["imported"], "resolve+torch": warm["imported"]}
            tables[name] = cli["stdout"]
            if args.engine:
                engine = run_engine(path, args.model)
                s["engine_config_phase_s"].append(engine["config_phase_s"])
                s["engine_tokenizer_phase_s"].append(engine["tokenizer_phase_s"])
                s["engine_ready_s"].append(engine["ready_s"])
            print(f"round {round_ + 1}/{args.rounds} {name}: resolve {cold['resolve_s']:.2f} s, "
                  f"engine phase {warm['engine_phase_s']:.2f} s, vllm config "
                  f"{cli['wall_s']:.2f} s wall / {cli['cpu_s']:.2f} s CPU", flush=True)
    result = {
        "model": args.model, "level": args.level, "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_at_end": os.getloadavg()},
        "checkouts": {name: {"path": os.path.abspath(path),
                             **{k: summary(v) for k, v in samples[name].items()},
                             "heavy_modules_imported": imported[name],
                             "same_table_as_first": tables[name] == next(iter(tables.values()))}
                      for name, path in checkouts.items()},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(args.output + ".md", "w") as f:
        f.write(render_markdown(result))
    print(render_markdown(result))
    return 0


def render_markdown(result: dict) -> str:
    lines = [f"# Config resolution (model {result['model']}, -O{result['level']}), "
             f"median (min-max) of {result['rounds']} fresh processes per checkout",
             "", f"{result['machine']['cpus']} CPUs, Python {result['machine']['python']}, "
             f"load average at the end {result['machine']['loadavg_at_end'][0]:.1f}", "",
             "| checkout | resolve (import + resolve) | engine phase (torch loaded) | "
             "`vllm config` wall | `vllm config` CPU | heavy modules a resolution imports |",
             "|---|---|---|---|---|---|"]
    def cell(c: dict, key: str) -> str:
        s = c[key]
        return f"{s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f})"

    for name, c in result["checkouts"].items():
        heavy = ", ".join(c["heavy_modules_imported"]["resolve"]) or "none"
        lines.append(f"| {name} | {cell(c, 'resolve_s')} | {cell(c, 'engine_phase_s')} | "
                     f"{cell(c, 'cli_wall_s')} | {cell(c, 'cli_cpu_s')} | {heavy} |")
    same = all(c["same_table_as_first"] for c in result["checkouts"].values())
    lines += ["", f"`vllm config` printed the same table in every checkout: {same}", ""]
    if all("engine_ready_s" in c for c in result["checkouts"].values()):
        lines += ["An -O0 engine start (`LLM(model, optimization_level=0)`, fresh process): "
                  "transformers is imported by the tokenizer now, not by config resolution.", "",
                  "| checkout | phase config resolution | phase tokenizer loading | "
                  "process start to ready |", "|---|---|---|---|"]
        for name, c in result["checkouts"].items():
            lines.append(f"| {name} | {cell(c, 'engine_config_phase_s')} | "
                         f"{cell(c, 'engine_tokenizer_phase_s')} | {cell(c, 'engine_ready_s')} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
