"""`vllm bench <benchmark> [flags]`: measured performance.

Each benchmark is a module listed in `BENCHMARKS` (name -> module) that exposes
  `add_cli_args(parser)`  (its flags) and
  `main(args) -> int | None`  (run it; the return is the exit code),
and whose docstring's first line is its help text. Add one (startup, latency, throughput ...)
by writing `vllm/benchmarks/<name>.py` and listing it here; keep heavy imports inside `main`
so `vllm --help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
from typing import Any

BENCHMARKS: dict[str, str] = {
    "serve": "vllm.benchmarks.serve",
    "startup": "vllm.benchmarks.startup",
    "latency": "vllm.benchmarks.latency",
    "throughput": "vllm.benchmarks.throughput",
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `vllm bench` and one sub-command per entry of `BENCHMARKS`."""
    parser = subparsers.add_parser("bench", help="run a benchmark",
                                   description="Benchmarks: " + ", ".join(BENCHMARKS) + ".")
    kinds = parser.add_subparsers(dest="bench_type", required=True, metavar="<benchmark>",
                                  title="benchmarks")
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        doc = (module.__doc__ or name).strip()
        # (raw: the docstrings' example commands keep their own lines)
        sub = kinds.add_parser(name, help=doc.splitlines()[0], description=doc,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_cli_args(sub)
        sub.set_defaults(_bench_main=module.main)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark."""
    return int(args._bench_main(args) or 0)
