"""Request models and error shapes of the OpenAI-compatible API.

Requests are pydantic models with strict scalar types (a string is not a number), unknown
fields are ignored as upstream does. Responses are plain dicts built by the serving modules.
Every error reaches the client as `{"error": {"message", "type", "param", "code"}}` with the
HTTP status in `code`; `OpenAIError` carries one through the server.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)
from pydantic import ValidationError as PydanticValidationError

from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = [
    "ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "MAX_JSON_DEPTH",
    "OpenAIError", "ResponsesRequest", "StreamOptions", "TokenizeRequest", "decode_json_body",
    "error_body",
    "from_validation_error", "parse_request",
]

MAX_JSON_DEPTH = 64
"""Nesting allowed in a request body (objects and arrays); real requests use under 10."""

_ERROR_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
    405: "MethodNotAllowedError", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError", 422: "UnprocessableEntityError",
    500: "InternalServerError", 503: "ServiceUnavailableError",
}

# What a field accepts, for errors on union-typed fields (pydantic reports every branch).
_FIELD_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "messages": "a non-empty list of {\"role\": ..., \"content\": ...} objects",
}


class OpenAIError(Exception):
    """An error the server answers with an OpenAI-style JSON body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or _ERROR_TYPES.get(status, "BadRequestError")

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param, self.err_type)


def error_body(message: str, status: int = 400, param: str | None = None,
               err_type: str | None = None) -> dict:
    return {"error": {"message": message,
                      "type": err_type or _ERROR_TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}


def _loc_to_param(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; union branch names dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool",
                                                                  "list", "dict", "none")):
            continue  # a union branch label such as 'list[int]'
        else:
            out += ("." if out else "") + str(part)
    return out


def from_validation_error(exc: PydanticValidationError) -> OpenAIError:
    """The first problem of a pydantic error, naming the field."""
    errors = exc.errors()
    first = errors[0]
    field = str(first["loc"][0]) if first["loc"] else None
    if field in _FIELD_HINTS and len(errors) > 1 and all(
            e["loc"] and e["loc"][0] == field for e in errors):
        param = _loc_to_param(first["loc"][:1])
        return OpenAIError(f"{param} must be {_FIELD_HINTS[field]}", 400, param)
    param = _loc_to_param(first["loc"]) or None
    msg = re.sub(r" or instance of \w+", "", first["msg"])  # (no internal class names)
    if first["type"] == "missing":
        msg = "Field required"
    got = first.get("input")
    detail = f"{param}: {msg}" if param else msg
    if first["type"] != "missing" and not isinstance(got, (dict, list)):
        detail += f" (got {got!r})"
    return OpenAIError(detail, 400, param)


def _refuse_constant(name: str) -> Any:
    raise OpenAIError(f"Invalid JSON in the request body: {name} is not a JSON number", 400)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise OpenAIError(f"Invalid JSON in the request body: the number {text[:40]} is out of "
                          f"the range of a double", 400)
    return value


def decode_json_body(body: bytes) -> Any:
    """A request body as strict JSON (no NaN/Infinity, no number that overflows a double,
    integers of at most 4300 digits), nested at most MAX_JSON_DEPTH deep, every string valid
    Unicode (no lone surrogates such as "\\ud800"). OpenAIError (400) naming the problem."""
    try:
        data = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(f"Invalid JSON in the request body: {exc}", 400) from None
    except RecursionError:
        raise OpenAIError(f"Invalid JSON in the request body: nested more than "
                          f"{MAX_JSON_DEPTH} levels deep", 400) from None
    except ValueError as exc:  # e.g. "Exceeds the limit (4300 digits) for integer string"
        raise OpenAIError(f"Invalid JSON in the request body: {exc}", 400) from None
    _check_json_values(data)
    return data


def _check_json_values(data: Any) -> None:
    """Walk the decoded body once (iteratively: no recursion to exhaust)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                param = where or None
                raise OpenAIError(f"{where or 'the request body'} is not valid Unicode (it holds "
                                  f"a lone surrogate such as \\ud800)", 400, param) from None
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise OpenAIError(f"Invalid JSON in the request body: nested more than "
                              f"{MAX_JSON_DEPTH} levels deep", 400)
        if isinstance(value, dict):
            for key, item in value.items():
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    raise OpenAIError(f"{where or 'the request body'} has a key that is not "
                                      f"valid Unicode", 400, where or None) from None
                stack.append((item, f"{where}.{key}" if where else key, depth + 1))
        else:
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))


class OpenAIBaseModel(BaseModel):
    # Unknown fields are accepted and ignored (OpenAI clients send extras).
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool | None = True
    continuous_usage_stats: StrictBool | None = False


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat (OpenAI's plus vLLM's extensions)."""

    model: StrictStr | None = None
    n: StrictInt = 1
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    request_id: StrictStr | None = None
    prompt_logprobs: StrictInt | None = None
    """vLLM's: the top-N logprobs of every prompt token (the first one None)."""
    return_token_ids: StrictBool | None = None
    """vLLM's: add the prompt's and each choice's token ids to the response."""
    truncate_prompt_tokens: StrictInt | None = None
    """vLLM's: keep only the prompt's last N tokens (-1: the last max_model_len)."""
    return_tokens_as_token_ids: StrictBool | None = None
    """vLLM's: logprob tokens as "token_id:N" strings instead of their text (None: the
    server's --return-tokens-as-token-ids)."""
    bad_words: list[StrictStr] | None = None
    response_format: dict[str, Any] | None = None
    """Only {"type": "text"}: JSON output needs structured outputs, which this server lacks."""

    def check_stream_and_format(self) -> None:
        """As upstream: stream_options only go with stream=true (400 otherwise). Also refuses
        a response_format other than text (no structured outputs here)."""
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options can only be given when stream is true", 400,
                              "stream_options")
        fmt = (self.response_format or {}).get("type", "text")
        if fmt != "text":
            raise OpenAIError(f"response_format type {fmt!r} is not supported: this server "
                              f"has no structured outputs", 400, "response_format")

    def sampling_kwargs(self, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """SamplingParams keyword arguments: the fields the client set, else `defaults` (the
        model's generation_config values), else SamplingParams' own defaults."""
        kwargs: dict[str, Any] = dict(defaults or {})
        kwargs.update(n=self.n, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
                      include_stop_str_in_output=self.include_stop_str_in_output,
                      skip_special_tokens=self.skip_special_tokens)
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                     "stop_token_ids", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "truncate_prompt_tokens", "bad_words"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        if self.logit_bias:
            bad = next((k for k, v in self.logit_bias.items() if not math.isfinite(v)), None)
            if bad is not None:
                raise OpenAIError(f"logit_bias values must be finite numbers, got "
                                  f"{self.logit_bias[bad]} for token {bad}", 400, "logit_bias")
            # OpenAI's range; vLLM clamps rather than refuses.
            kwargs["logit_bias"] = {k: min(100.0, max(-100.0, v))
                                    for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            kwargs["allowed_token_ids"] = self.allowed_token_ids
        return kwargs


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError("prompt must not be empty", 400, "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class _FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # (handed to the chat template as sent)

    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class _ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: _FunctionDefinition

    def as_sent(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)


class _FunctionName(OpenAIBaseModel):
    name: StrictStr


class _NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: _FunctionName


class _ChatTemplateFields(OpenAIBaseModel):
    """How messages are rendered with the chat template (chat completions and /tokenize)."""

    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[_ToolDefinition] | None = None
    """OpenAI tool definitions ({"type": "function", "function": {"name": ...}}); the chat
    template gets them as sent (`tool_dicts`)."""

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return None if self.tools is None else [t.as_sent() for t in self.tools]


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]] = Field(...)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, choice: str | dict[str, Any] | None) -> str | dict | None:
        if isinstance(choice, dict):
            _NamedToolChoice.model_validate(choice)
        return choice
    echo: StrictBool = False
    """vLLM's: start the reply with the last message's content when that message has the
    reply's role (continuing an assistant message)."""

    def output_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class TokenizeRequest(_ChatTemplateFields):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered with the chat template."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize (vLLM's)."""

    model: StrictStr | None = None
    tokens: list[StrictInt]


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses (OpenAI's Responses API, text in and text out).

    `input` is the user's text, or a list of messages: {"role", "content"} (optionally with
    "type": "message"), the content a string or a list of input_text / output_text parts.
    `instructions` becomes a system message before them. The reply is generated as a chat
    completion (`to_chat_request`). This server keeps no responses (store is reported false)
    and has no tool calls or structured outputs: previous_response_id, background, tools and
    a non-text `text.format` are refused when set, never ignored."""

    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stream: StrictBool | None = False
    user: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    background: StrictBool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    # vLLM's extras
    request_id: StrictStr | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True

    def check_supported(self) -> None:
        """400 naming the field for what this server cannot do."""
        if self.previous_response_id is not None:
            raise OpenAIError("previous_response_id is not supported: this server does not "
                              "store responses; send the whole conversation in input", 400,
                              "previous_response_id")
        if self.background:
            raise OpenAIError("background is not supported: this server answers responses "
                              "while the request is open", 400, "background")
        if self.tools:
            raise OpenAIError("tools are not supported on /v1/responses: this server has no "
                              "tool-call parser", 400, "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise OpenAIError(f"tool_choice {self.tool_choice!r} needs tools, which this "
                              f"server does not support on /v1/responses", 400, "tool_choice")
        fmt = (self.text or {}).get("format") or {}
        kind = fmt.get("type", "text") if isinstance(fmt, dict) else fmt
        if kind != "text":
            raise OpenAIError(f"text.format type {kind!r} is not supported: this server has "
                              f"no structured outputs", 400, "text.format")

    def messages(self) -> list[dict[str, str]]:
        """The conversation as chat messages ({"role", "content": str}); 400 naming e.g.
        `input[1].content[0]` for an item or part that is not text."""
        out: list[dict[str, str]] = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        if not self.input:
            raise OpenAIError("input must be a string or a non-empty list of messages", 400,
                              "input")
        for i, item in enumerate(self.input):
            out.append(_response_input_message(item, f"input[{i}]"))
        return out

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat completion that generates this response."""
        fields: dict[str, Any] = {
            "messages": self.messages(), "model": self.model,
            "max_tokens": self.max_output_tokens, "stream": self.stream,
            "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                     "stop", "user"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        return ChatCompletionRequest.model_validate(fields)


_RESPONSE_ROLES = ("user", "assistant", "system", "developer")
_RESPONSE_TEXT_PARTS = ("input_text", "output_text", "text")


def _response_input_message(item: Any, where: str) -> dict[str, str]:
    """One Responses API input item as a chat message (see ResponsesRequest.messages)."""
    if not isinstance(item, dict):
        raise OpenAIError(f"{where} must be a message object {{\"role\": ..., \"content\": ...}}",
                          400, where)
    kind = item.get("type", "message")
    if kind != "message":
        raise OpenAIError(f"{where}.type: only message items are supported (text in, text "
                          f"out), got {kind!r}", 400, f"{where}.type")
    role = item.get("role")
    if role not in _RESPONSE_ROLES:
        raise OpenAIError(f"{where}.role must be one of {', '.join(_RESPONSE_ROLES)}, got "
                          f"{role!r}", 400, f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise OpenAIError(f"{where}.content must be a string or a list of input_text parts",
                          400, f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _RESPONSE_TEXT_PARTS or not isinstance(part.get("text"), str):
            raise OpenAIError(f"{where}.content[{j}]: only text parts are supported "
                              f"({{\"type\": \"input_text\", \"text\": ...}}), got {kind!r}",
                              400, f"{where}.content[{j}]")
        texts.append(part["text"])
    return {"role": role, "content": "\n".join(texts)}


_ROLES = ("system", "developer", "user", "assistant", "tool")


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check roles and contents; flatten text parts into one string per message.
    Raises OpenAIError naming e.g. `messages[1].content`."""
    if not messages:
        raise OpenAIError("messages must be a non-empty list", 400, "messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = msg.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise OpenAIError(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}",
                              400, f"{where}.role")
        content = msg.get("content")
        if content is None:
            if role == "assistant":
                content = ""
            else:
                raise OpenAIError(f"{where}.content is required", 400, f"{where}.content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or \
                        not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise OpenAIError(
                        f"{where}.content[{j}]: only text parts are supported "
                        f"({{\"type\": \"text\", \"text\": ...}}), got {kind!r}", 400,
                        f"{where}.content")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise OpenAIError(f"{where}.content must be a string or a list of text parts",
                              400, f"{where}.content")
        clean = {k: v for k, v in msg.items() if k not in ("role", "content")}
        clean.update(role=role, content=content)
        out.append(clean)
    return out


# vLLM request fields for features this server lacks: refused when set, never ignored (an
# unconstrained answer to a request for JSON would look like success).
_UNSUPPORTED_FIELDS = {
    "structured_outputs": "structured outputs", "guided_json": "structured outputs",
    "guided_regex": "structured outputs", "guided_choice": "structured outputs",
    "guided_grammar": "structured outputs", "guided_whitespace_pattern": "structured outputs",
    "use_beam_search": "beam search",
    "logits_processors": "logits processors",
}


def parse_request(model_cls: type[BaseModel], data: Any) -> Any:
    """Validate a decoded JSON body; OpenAIError (400) naming the field on failure. Fields
    this server does not know are logged as ignored (as upstream); those of features it lacks
    (_UNSUPPORTED_FIELDS) are a 400 when set."""
    if not isinstance(data, dict):
        raise OpenAIError("the request body must be a JSON object", 400)
    unknown = [key for key in data if key not in model_cls.model_fields]
    for key in unknown:
        if key in _UNSUPPORTED_FIELDS and data[key] not in (None, False, [], {}):
            raise OpenAIError(f"{key} is not supported: this server has no "
                              f"{_UNSUPPORTED_FIELDS[key]}", 400, key)
    if unknown:
        logger.warning("The following fields were present in the request but ignored: %s",
                       sorted(unknown))
    try:
        return model_cls.model_validate(data)
    except PydanticValidationError as exc:
        raise from_validation_error(exc) from None

