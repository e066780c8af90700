"""/v1/chat/completions: messages rendered with the tokenizer's chat template, then generated
like a completion (see `OpenAIServing` in serving_engine.py)."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from vllm.engine.async_llm import EngineError, RequestStream
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    OpenAIError,
    error_body,
    normalize_messages,
)
from vllm.entrypoints.openai.serving_engine import (
    ClosingStream,
    OpenAIServing,
    random_id,
    sse,
)
from vllm.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    """POST /v1/chat/completions. The server's --chat-template (`options.chat_template`)
    replaces the tokenizer's; a request's own `chat_template` is used only when the server
    trusts request templates."""

    def _template(self, request: Any) -> str | None:
        """The template to render `request` with (None: the tokenizer's own)."""
        if request.chat_template is not None:
            if not self.options.trust_request_chat_template:
                raise OpenAIError(
                    "the request carries a chat_template, but the server was not started "
                    "with --trust-request-chat-template; the request was refused", 400,
                    "chat_template")
            return request.chat_template
        if self.options.chat_template is not None:
            return self.options.chat_template
        if getattr(self.tokenizer, "chat_template", "unset") is None:
            raise OpenAIError("this model's tokenizer has no chat template; start the server "
                              "with --chat-template, or use /v1/completions", 400, "messages")
        return None

    def check_messages_length(self, request: Any) -> None:
        """400 before any rendering when the messages' text alone is too long for
        max_model_len (see `check_text_length`)."""
        total = 0
        for message in request.messages or ():
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p.get("text") or "") for p in content
                             if isinstance(p, dict) and isinstance(p.get("text"), str))
        self.check_text_length(total, "messages", getattr(request, "truncate_prompt_tokens",
                                                          None))

    async def render_off_loop(self, request: Any) -> list[int]:
        """`render` in the tokenizer thread, after the length check (what the routes call)."""
        self.check_messages_length(request)
        return await self.off_loop(lambda: self.render(request),
                                   "rendering the chat template and tokenizing")

    def render(self, request: ChatCompletionRequest) -> list[int]:
        """The prompt token ids for the conversation; 400 naming `messages` if the chat
        template refuses it, renders more text than max_model_len tokens can hold, or the
        model has none."""
        messages = normalize_messages(request.messages)
        if request.continue_final_message and request.add_generation_prompt:
            raise OpenAIError("continue_final_message and add_generation_prompt cannot both "
                              "be true", 400, "continue_final_message")
        template = self._template(request)
        kwargs: dict[str, Any] = dict(request.chat_template_kwargs or {})
        if request.tools:
            kwargs["tools"] = request.tool_dicts()
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, **kwargs)
        except Exception as exc:  # noqa: BLE001 - template errors are the client's input
            raise OpenAIError(f"messages could not be rendered with the chat template: {exc}",
                              400, "messages") from None
        if not isinstance(text, str):
            raise OpenAIError("the chat template did not render text", 400, "messages")
        keep = getattr(request, "truncate_prompt_tokens", None)
        self.check_text_length(len(text), "messages", keep,
                               what="conversation rendered by the chat template")
        # The template already holds the special tokens (BOS, role markers).
        return self.tokenize(self.tail_for_truncation(text, keep), add_special_tokens=False)

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     raw_request: Any = None) -> dict | AsyncIterator[str]:
        """A response dict, or (stream=true) an async iterator of SSE strings.
        Raises OpenAIError for bad requests before anything is streamed."""
        model = self.check_model(request.model)
        top = request.top_logprobs
        if top is not None and not 0 <= top <= self.max_logprobs:
            raise OpenAIError(f"top_logprobs must be between 0 and {self.max_logprobs} (the "
                              f"server's --max-logprobs), got {top}", 400, "top_logprobs")
        if top and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", 400, "top_logprobs")
        request.check_stream_and_format()
        if request.stream and request.prompt_logprobs:
            raise OpenAIError("prompt_logprobs are not available with stream=true (as "
                              "upstream)", 400, "prompt_logprobs")
        check_tool_choice(request)
        prompt = self.truncate(await self.render_off_loop(request),
                               request.truncate_prompt_tokens)
        if not prompt:
            raise OpenAIError("messages rendered to an empty prompt", 400, "messages")
        budget_param = "max_completion_tokens" if request.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = self.resolve_max_tokens(len(prompt), request.output_budget(), "messages",
                                             budget_param)
        num_logprobs = (top or 0) if request.logprobs else None
        kwargs = request.sampling_kwargs(self.default_sampling)
        if self.check_prompt_logprobs(request) is not None:
            kwargs["prompt_logprobs"] = request.prompt_logprobs
        params = self.sampling_params(kwargs, max_tokens, num_logprobs)
        base_id = random_id("chatcmpl")
        created = int(time.time())
        role, echo = reply_role_and_echo(request, self.options.response_role)
        streams = await self.start(base_id, [prompt], params)
        if request.stream:
            return ClosingStream(
                self._stream(request, streams, prompt, base_id, created, model, role, echo),
                streams, self)
        finals = await self.collect(streams, raw_request)
        return self._response(request, finals[0], prompt, base_id, created, model, role, echo)

    def _response(self, request: ChatCompletionRequest, final: RequestOutput,
                  prompt: list[int], base_id: str, created: int, model: str, role: str,
                  echo: str) -> dict:
        choices = []
        completion_tokens = 0
        prompt_tokens = len(prompt)
        top_level = self.prompt_fields(request, final, prompt)  # once, not per choice
        for c in final.outputs:
            completion_tokens += len(c.token_ids)
            logprobs = None
            if request.logprobs:
                logprobs = self.chat_logprobs(c.token_ids, c.logprobs,
                                              request.top_logprobs or 0,
                                              self.tokens_as_ids(request))
            choice = {"index": c.index, "message": {"role": role, "content": echo + c.text},
                      "logprobs": logprobs, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
            if request.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        return {"id": base_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, **top_level,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    async def _stream(self, request: ChatCompletionRequest, streams: list[RequestStream],
                      prompt: list[int], base_id: str, created: int, model: str,
                      role: str, echo: str) -> AsyncIterator[str]:
        prompt_tokens = len(prompt)
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()
        as_ids = self.tokens_as_ids(request)

        def usage() -> dict:
            done = sum(sent_tokens.values())
            return {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                    "total_tokens": prompt_tokens + done}

        def chunk(choices: list[dict], **extra: Any) -> str:
            body = {"id": base_id, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": choices, **extra}
            if include_usage:
                body["usage"] = usage() if continuous else None
            return sse(body)

        try:
            # One choice per chunk, as vLLM streams (clients read `chunk.choices[0]`).
            for i in range(request.n):
                # (return_token_ids: the prompt's ids once, with the first chunk, as upstream)
                extra = {"prompt_token_ids": prompt} if request.return_token_ids and i == 0 \
                    else {}
                yield chunk([{"index": i, "delta": {"role": role, "content": ""},
                              "logprobs": None, "finish_reason": None}], **extra)
                if echo:
                    yield chunk([{"index": i, "delta": {"content": echo}, "logprobs": None,
                                  "finish_reason": None}])
            async for _, output in self.merged(streams):
                choices = []
                for c in output.outputs:
                    if c.index in finished:
                        continue
                    start_text = sent_text.get(c.index, 0)
                    start_tok = sent_tokens.get(c.index, 0)
                    delta = c.text[start_text:]
                    new_ids = c.token_ids[start_tok:]
                    if not delta and not new_ids and c.finish_reason is None:
                        continue
                    logprobs = None
                    if request.logprobs:
                        entries = None if c.logprobs is None else c.logprobs[start_tok:]
                        logprobs = self.chat_logprobs(new_ids, entries,
                                                      request.top_logprobs or 0, as_ids)
                    sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    choice = {"index": c.index,
                              "delta": {"content": delta} if delta else {},
                              "logprobs": logprobs, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason}
                    if request.return_token_ids:
                        choice["token_ids"] = list(new_ids)
                    choices.append(choice)
                for choice in choices:
                    yield chunk([choice])
            if include_usage:
                yield sse({"id": base_id, "object": "chat.completion.chunk", "created": created,
                           "model": model, "choices": [], "usage": usage()})
        except EngineError as exc:
            yield sse(error_body(str(exc), 500))
        finally:
            self.abort_unfinished(streams)
        yield sse("[DONE]")


_TOOL_CHOICES = ("none", "auto", "required")


def check_tool_choice(request: ChatCompletionRequest) -> None:
    """This server renders `tools` into the prompt but has no tool-call parser and no
    structured outputs, so only tool_choice "none" can be honoured (it is the default without
    tools; with tools the default is "auto", as upstream). 400 naming the choice otherwise."""
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if request.tools else "none"
    if isinstance(choice, str) and choice not in _TOOL_CHOICES:
        raise OpenAIError(f"tool_choice must be one of {', '.join(_TOOL_CHOICES)} or "
                          f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                          f"got {choice!r}", 400, "tool_choice")
    if choice == "none":
        return
    if not request.tools:
        raise OpenAIError(f"tool_choice {choice!r} needs tools", 400, "tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]  # (the shape is checked by the request model)
        names = [t.function.name for t in request.tools]
        if name not in names:
            raise OpenAIError(f"tool_choice names the function {name!r}, which is not among "
                              f"the tools ({', '.join(map(str, names))})", 400, "tool_choice")
    if choice == "auto":
        raise OpenAIError(
            "tool_choice \"auto\" (the default when tools are given) needs a tool-call "
            "parser, which this server does not have; send tool_choice \"none\" to show the "
            "tools to the model without tool calls", 400, "tool_choice")
    raise OpenAIError(f"tool_choice {choice!r} forces a tool call, which needs structured "
                      f"outputs; this server does not support them", 400, "tool_choice")


def reply_role_and_echo(request: ChatCompletionRequest,
                        response_role: str = "assistant") -> tuple[str, str]:
    """The reply's role (as upstream: `response_role` after a generation prompt, else the last
    message's role) and, with echo=true, the text it starts with: the last message's content
    when that message has the reply's role."""
    last = normalize_messages(request.messages[-1:])[0]
    role = response_role if request.add_generation_prompt else last["role"]
    echo = last["content"] if request.echo and last["role"] == role else ""
    return role, echo
