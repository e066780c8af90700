"""/v1/chat/completions: messages rendered with the tokenizer's chat template, then generated
like a completion (see `OpenAIServing` in serving_completion.py)."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from vllm.engine.async_llm import EngineDeadError, RequestStream
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    OpenAIError,
    error_body,
    normalize_messages,
)
from vllm.entrypoints.openai.serving_completion import (
    ClosingStream,
    OpenAIServing,
    random_id,
    sse,
)
from vllm.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    """POST /v1/chat/completions."""

    def render(self, request: ChatCompletionRequest) -> list[int]:
        """The prompt token ids for the conversation; 400 naming `messages` if the chat
        template refuses it or the model has none."""
        messages = normalize_messages(request.messages)
        if request.continue_final_message and request.add_generation_prompt:
            raise OpenAIError("continue_final_message and add_generation_prompt cannot both "
                              "be true", 400, "continue_final_message")
        if getattr(self.tokenizer, "chat_template", "unset") is None:
            raise OpenAIError("this model's tokenizer has no chat template; use "
                              "/v1/completions", 400, "messages")
        kwargs: dict[str, Any] = dict(request.chat_template_kwargs or {})
        if request.tools:
            kwargs["tools"] = request.tools
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, **kwargs)
        except Exception as exc:  # noqa: BLE001 - template errors are the client's input
            raise OpenAIError(f"messages could not be rendered with the chat template: {exc}",
                              400, "messages") from None
        # The template already holds the special tokens (BOS, role markers).
        return self.tokenize(text, add_special_tokens=False)

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     raw_request: Any = None) -> dict | AsyncIterator[str]:
        """A response dict, or (stream=true) an async iterator of SSE strings.
        Raises OpenAIError for bad requests before anything is streamed."""
        model = self.check_model(request.model)
        fmt = (request.response_format or {}).get("type", "text")
        if fmt != "text":
            raise OpenAIError(f"response_format type {fmt!r} is not supported", 400,
                              "response_format")
        top = request.top_logprobs
        if top is not None and not 0 <= top <= self.max_logprobs:
            raise OpenAIError(f"top_logprobs must be between 0 and {self.max_logprobs} (the "
                              f"server's --max-logprobs), got {top}", 400, "top_logprobs")
        if top and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", 400, "top_logprobs")
        prompt = self.render(request)
        if not prompt:
            raise OpenAIError("messages rendered to an empty prompt", 400, "messages")
        budget_param = "max_completion_tokens" if request.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = self.resolve_max_tokens(len(prompt), request.output_budget(), "messages",
                                             budget_param)
        num_logprobs = (top or 0) if request.logprobs else None
        params = self.sampling_params(request.sampling_kwargs(self.default_sampling),
                                      max_tokens, num_logprobs)
        base_id = random_id("chatcmpl")
        created = int(time.time())
        streams = await self.start(base_id, [prompt], params)
        if request.stream:
            return ClosingStream(
                self._stream(request, streams, len(prompt), base_id, created, model),
                streams, self)
        finals = await self.collect(streams, raw_request)
        return self._response(request, finals[0], len(prompt), base_id, created, model)

    def _response(self, request: ChatCompletionRequest, final: RequestOutput,
                  prompt_tokens: int, base_id: str, created: int, model: str) -> dict:
        choices = []
        completion_tokens = 0
        for c in final.outputs:
            completion_tokens += len(c.token_ids)
            logprobs = None
            if request.logprobs:
                logprobs = self.chat_logprobs(c.token_ids, c.logprobs,
                                              request.top_logprobs or 0)
            choices.append({"index": c.index,
                            "message": {"role": "assistant", "content": c.text},
                            "logprobs": logprobs, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
        choices.sort(key=lambda ch: ch["index"])
        return {"id": base_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    async def _stream(self, request: ChatCompletionRequest, streams: list[RequestStream],
                      prompt_tokens: int, base_id: str, created: int,
                      model: str) -> AsyncIterator[str]:
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()

        def usage() -> dict:
            done = sum(sent_tokens.values())
            return {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                    "total_tokens": prompt_tokens + done}

        def chunk(choices: list[dict]) -> str:
            body = {"id": base_id, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": choices}
            if include_usage:
                body["usage"] = usage() if continuous else None
            return sse(body)

        try:
            # One choice per chunk, as vLLM streams (clients read `chunk.choices[0]`).
            for i in range(request.n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
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
                                                      request.top_logprobs or 0)
                    sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    choices.append({"index": c.index,
                                    "delta": {"content": delta} if delta else {},
                                    "logprobs": logprobs, "finish_reason": c.finish_reason,
                                    "stop_reason": c.stop_reason})
                for choice in choices:
                    yield chunk([choice])
            if include_usage:
                yield sse({"id": base_id, "object": "chat.completion.chunk", "created": created,
                           "model": model, "choices": [], "usage": usage()})
        except EngineDeadError as exc:
            yield sse(error_body(str(exc), 500))
        finally:
            self.abort_unfinished(streams)
        yield sse("[DONE]")
