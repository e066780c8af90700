"""The flags of the OpenAI-compatible server, shared by `vllm serve` and
`python -m vllm.entrypoints.openai.api_server`: the HTTP ones here, the request-handling
ones of `FrontendOptions`, and the engine's (EngineArgs)."""
from __future__ import annotations

import argparse

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


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every flag of the server to `parser`: the HTTP ones, then the engine's."""
    from vllm.engine.arg_utils import EngineArgs

    add_server_args(parser)
    EngineArgs.add_cli_args(parser)
    return parser
