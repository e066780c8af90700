"""`vllm complete [--url URL] [-q PROMPT]`: text completions from a running server.

Each line typed is a prompt; its completion streams back. `-q/--quick PROMPT` completes one
prompt and exits.
"""
from __future__ import annotations

import argparse
from typing import Any

from vllm.entrypoints.cli.openai_client import Client, add_client_args, read_inputs


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "complete", help="complete prompts with a running server (vllm serve)",
        description="Text completions from the model of a running OpenAI-compatible server.")
    add_client_args(parser)
    parser.add_argument("-q", "--quick", default=None, metavar="PROMPT",
                        help="Complete this one prompt, print it, exit.")
    return parser


def run(args: argparse.Namespace) -> int:
    client = Client(args)
    prompts = [args.quick] if args.quick is not None else read_inputs("> ")
    for prompt in prompts:
        for chunk in client.stream("completions", {"prompt": prompt}):
            for choice in chunk.get("choices") or []:
                print(choice.get("text") or "", end="", flush=True)
        print()
    return 0
