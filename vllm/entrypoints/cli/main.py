"""The `vllm` console script: `vllm <command> [flags]`.

Each subcommand is a module listed in `SUBCOMMANDS` that exposes
  `add_parser(subparsers) -> argparse.ArgumentParser`  (register the command and its flags) and
  `run(args: argparse.Namespace) -> int | None`        (do the work; the return is the exit code).
Add a command by writing `vllm/entrypoints/cli/<name>.py` with those two functions and listing it
here; keep heavy imports (torch, servers) inside `run` so `vllm --help` stays fast.

Errors: bad flags, a bad `--config` file and a `ValueError` raised by `run` (config resolution:
contradictory or invalid settings) print one line `vllm <command>: error: <message>` on stderr
and exit with code 2, without a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.version import __version__

SUBCOMMANDS: list[str] = [
    "vllm.entrypoints.cli.config_cmd",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.cli.bench",
    "vllm.entrypoints.cli.chat",
    "vllm.entrypoints.cli.complete",
]


def build_parser() -> FlexibleArgumentParser:
    """The top-level parser with every subcommand in `SUBCOMMANDS` registered."""
    parser = FlexibleArgumentParser(
        prog="vllm", description="vLLM-compatible LLM inference engine built around "
        "optimization levels (-O0 .. -O3).")
    parser.add_argument("-v", "--version", action="version", version=__version__)
    subparsers = parser.add_subparsers(dest="subcommand", required=True, metavar="<command>",
                                       title="commands")
    for module_name in SUBCOMMANDS:
        module = importlib.import_module(module_name)
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run, _parser=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]), run the chosen subcommand, return its exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(None if argv is None else list(argv))
    except (ValueError, FileNotFoundError) as exc:  # --config FILE: missing, not YAML, ...
        parser.error(str(exc))
    sub_parser: argparse.ArgumentParser = args._parser
    try:
        code = args._run(args)
    except ValueError as exc:
        sub_parser.error(str(exc))
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
