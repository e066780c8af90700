"""`vllm chat [--url URL] [--system-prompt S] [-q MESSAGE]`: chat with a running server.

Each line typed is a user message; the reply streams back and stays in the conversation.
`-q/--quick MESSAGE` sends one message, prints the reply and exits.
"""
from __future__ import annotations

import argparse
from typing import Any

from vllm.entrypoints.cli.openai_client import Client, add_client_args, read_inputs


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "chat", help="chat with a running server (vllm serve)",
        description="Chat with the model of a running OpenAI-compatible server.")
    add_client_args(parser)
    parser.add_argument("--system-prompt", default=None, help="A system message first.")
    parser.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                        help="Send this one message, print the reply, exit.")
    return parser


def reply(client: Client, messages: list[dict[str, str]]) -> str:
    """Stream the assistant's reply to stdout; return its text."""
    parts = []
    for chunk in client.stream("chat/completions", {"messages": messages}):
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") or ""
            parts.append(text)
            print(text, end="", flush=True)
    print()
    return "".join(parts)


def run(args: argparse.Namespace) -> int:
    client = Client(args)
    messages: list[dict[str, str]] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    lines = [args.quick] if args.quick is not None else read_inputs("> ")
    for line in lines:
        messages.append({"role": "user", "content": line})
        messages.append({"role": "assistant", "content": reply(client, messages)})
    return 0
