"""`vllm serve [MODEL] [engine flags] [server flags]`: the OpenAI-compatible server.

MODEL is a local Hugging Face folder, a Hugging Face Hub repo id (ORG/NAME) or `demo` (the
built-in demo model); `--model` works too. Engine flags are those of EngineArgs (-O0..-O3, -cc ..., --max-model-len,
--served-model-name, --kv-cache-memory ...); server flags are --host (127.0.0.1), --port
(8000), --api-key, --shutdown-timeout (10 s), the uvicorn log switches and those of
`FrontendOptions` (--chat-template, --response-role, --enable-log-requests, --root-path, CORS).
"""
from __future__ import annotations

import argparse
from typing import Any

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.frontend_options import add_frontend_args

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The HTTP flags of `vllm serve` (the engine flags come from EngineArgs)."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=DEFAULT_HOST,
                       help="Address to bind. Default: %(default)s (this machine only); use "
                       "0.0.0.0 to accept connections from other machines.")
    group.add_argument("--port", type=int, default=DEFAULT_PORT,
                       help="Port to bind. Default: %(default)s.")
    group.add_argument("--api-key", default=None,
                       help="Require `Authorization: Bearer <key>` on every route but "
                       "/health and /ping (and /metrics, see --require-api-key-for-metrics). "
                       "Default: the VLLM_API_KEY environment variable (keeps the key out of "
                       "`ps`), else no key.")
    group.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="On SIGTERM or SIGINT (Ctrl-C), seconds running requests may "
                       "take to finish before they are aborted. Default: %(default)s.")
    group.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's log level. Default: %(default)s.")
    group.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="Do not log one line per HTTP request.")
    add_frontend_args(group)
    return parser


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
    add_server_args(parser)
    EngineArgs.add_cli_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean shutdown."""
    if args.model_tag is not None:
        args.model = args.model_tag
    from vllm.entrypoints.openai.api_server import run_server

    return run_server(args)
