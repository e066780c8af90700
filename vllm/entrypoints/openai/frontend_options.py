"""What the OpenAI server's own flags decide (the engine's come from EngineArgs): templates,
the reply role, request logging, CORS and the URL prefix. Upstream's flag names."""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any


@dataclasses.dataclass
class FrontendOptions:
    chat_template: str | None = None
    """The chat template's text (`--chat-template`, read by `load_chat_template`); None: the
    tokenizer's."""
    trust_request_chat_template: bool = False
    response_role: str = "assistant"
    """The role of chat replies after a generation prompt (`--response-role`)."""
    enable_log_requests: bool = False
    """Log each request's prompt and sampling parameters when it is added."""
    max_log_len: int | None = None
    """Characters / token ids of a prompt shown in a request's log line (None: all)."""
    root_path: str = ""
    """A URL prefix the server answers under (`/x/v1/models`), as well as without it (behind
    a proxy that strips it)."""
    allowed_origins: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    max_request_body_mb: float = 32.0
    """Request bodies larger than this are refused with 413 before they are parsed."""
    max_prompts_per_request: int = 1024
    """Prompts one /v1/completions request may carry in its `prompt` list."""
    require_api_key_for_metrics: bool = False
    """With an API key, /metrics needs it too (it is open by default, for scrapers)."""
    return_tokens_as_token_ids: bool = False
    """Logprob tokens as "token_id:N" strings by default (a request's
    return_tokens_as_token_ids overrides it)."""

    def __post_init__(self) -> None:
        if not self.max_request_body_mb > 0:
            raise ValueError(f"--max-request-body-mb must be > 0, got "
                             f"{self.max_request_body_mb}")
        if self.max_prompts_per_request < 1:
            raise ValueError(f"--max-prompts-per-request must be >= 1, got "
                             f"{self.max_prompts_per_request}")
        if self.allow_credentials and "*" in self.allowed_origins:
            # A wildcard with credentials makes the CORS layer echo any site's Origin, so
            # every web page a user opens could send credentialed requests here.
            raise ValueError("--allow-credentials cannot be combined with --allowed-origins "
                             "'[\"*\"]': list the origins that may send credentials, e.g. "
                             "--allowed-origins '[\"https://app.example.com\"]'")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> FrontendOptions:
        """From `vllm serve`'s parsed flags; raises ValueError naming a bad one."""
        from vllm.entrypoints.chat_utils import load_chat_template

        if args.max_log_len is not None and args.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
        return cls(chat_template=load_chat_template(args.chat_template),
                   trust_request_chat_template=args.trust_request_chat_template,
                   response_role=args.response_role,
                   enable_log_requests=args.enable_log_requests,
                   max_log_len=args.max_log_len, root_path=args.root_path,
                   allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                   allowed_headers=args.allowed_headers,
                   allow_credentials=args.allow_credentials,
                   max_request_body_mb=args.max_request_body_mb,
                   max_prompts_per_request=args.max_prompts_per_request,
                   require_api_key_for_metrics=args.require_api_key_for_metrics,
                   return_tokens_as_token_ids=args.return_tokens_as_token_ids)


def json_list(flag: str):
    """argparse type: a JSON list of strings (upstream's form of the CORS flags)."""

    def parse(text: str) -> list[str]:
        try:
            value: Any = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(
                f"{flag} takes a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
        return value

    return parse


def add_frontend_args(group: Any) -> None:
    """Register FrontendOptions' flags (upstream's spellings) on an argparse group."""
    d = FrontendOptions()
    group.add_argument("--chat-template", default=None,
                       help="Jinja chat template for /v1/chat/completions: a file's path or "
                       "the template itself (default: the tokenizer's).")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="Let a request's own `chat_template` field replace the server's "
                       "template (refused with a 400 otherwise).")
    group.add_argument("--response-role", default=d.response_role,
                       help="Role of chat replies after a generation prompt. Default: "
                       "%(default)s.")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="Log each request's prompt and sampling parameters.")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="Deprecated (requests are not logged unless "
                       "--enable-log-requests is given).")
    group.add_argument("--max-log-len", type=int, default=d.max_log_len,
                       help="Prompt characters / token ids shown per logged request "
                       "(default: all).")
    group.add_argument("--root-path", default=d.root_path,
                       help="URL prefix to serve under as well (e.g. behind a proxy).")
    group.add_argument("--allowed-origins", type=json_list("--allowed-origins"),
                       default=d.allowed_origins, help="CORS origins (JSON list). Default: "
                       "[\"*\"].")
    group.add_argument("--allowed-methods", type=json_list("--allowed-methods"),
                       default=d.allowed_methods, help="CORS methods (JSON list). Default: "
                       "[\"*\"].")
    group.add_argument("--allowed-headers", type=json_list("--allowed-headers"),
                       default=d.allowed_headers, help="CORS headers (JSON list). Default: "
                       "[\"*\"].")
    group.add_argument("--allow-credentials", action="store_true",
                       help="CORS: allow credentials (needs --allowed-origins naming the "
                       "origins; refused with the wildcard).")
    group.add_argument("--max-request-body-mb", type=float, default=d.max_request_body_mb,
                       help="Refuse request bodies larger than this many MiB (413). Default: "
                       "%(default)s.")
    group.add_argument("--max-prompts-per-request", type=int,
                       default=d.max_prompts_per_request,
                       help="Prompts one /v1/completions request may batch in `prompt`. "
                       "Default: %(default)s.")
    group.add_argument("--require-api-key-for-metrics", action="store_true",
                       help="With --api-key, protect /metrics too (open by default for "
                       "Prometheus scrapers; /health and /ping are always open).")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="Name logprob tokens \"token_id:N\" instead of their text (for "
                       "tokens that are not valid UTF-8 alone); a request's "
                       "return_tokens_as_token_ids overrides it.")
