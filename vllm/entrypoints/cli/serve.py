"""`vllm serve [MODEL] [engine flags] [server flags]`: the OpenAI-compatible server.

MODEL is a local Hugging Face folder, a Hugging Face Hub repo id (ORG/NAME) or `demo` (the
built-in demo model); `--model` works too. Engine flags are those of EngineArgs (-O0..-O3,
-cc ..., --max-model-len, --served-model-name, --kv-cache-memory ...); server flags are --host
(127.0.0.1), --port (8000), --api-key, --shutdown-timeout (10 s), the uvicorn log switches and
those of `FrontendOptions` (--chat-template, --response-role, --enable-log-requests,
--root-path, CORS): all defined in vllm/entrypoints/openai/cli_args.py.
"""
from __future__ import annotations

import argparse
from typing import Any

from vllm.entrypoints.openai.cli_args import make_arg_parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `vllm serve` and its flags on `subparsers`."""
    parser = subparsers.add_parser(
        "serve", help="start the OpenAI-compatible API server",
        description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics). Example: "
        "vllm serve ./my-model -O2 --port 8000")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="Model folder, Hub repo id (ORG/NAME) or 'demo' (same as --model; "
                        "wins over it).")
    return make_arg_parser(parser)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean shutdown."""
    if args.model_tag is not None:
        args.model = args.model_tag
    from vllm.entrypoints.openai.api_server import run_server

    return run_server(args)
