"""/v1/responses: OpenAI's Responses API, text in and text out, as upstream serves it.

The conversation (`ResponsesRequest.messages`) is rendered with the chat template and
generated like a chat completion (one choice), through the same tokenizer thread, length
checks, engine requests and disconnect handling (`OpenAIServingChat`). The answer is a
response object:

    {"id": "resp_...", "object": "response", "created_at", "model", "status",
     "output": [{"type": "message", "id": "msg_...", "role": "assistant",
                 "status": "completed",
                 "content": [{"type": "output_text", "text", "annotations": []}]}],
     "usage": {"input_tokens", "output_tokens", "total_tokens", ...}, ...}

status is "completed", "incomplete" (incomplete_details {"reason": "max_output_tokens"})
when the output budget ran out, or "cancelled" when the request was aborted (shutdown). A
reply with no text has no content part (as upstream).

With stream=true the body is server-sent events, each `event: <type>` plus its JSON with a
sequence_number: response.created, response.in_progress, then (from the first text on)
response.output_item.added, response.content_part.added, response.output_text.delta...,
response.output_text.done, response.content_part.done, response.output_item.done, and last
response.completed with the whole response (whatever its status, as upstream). An engine
failure mid-stream ends it with an `error` event and response.failed. No [DONE] line.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from vllm.engine.async_llm import EngineError, RequestStream
from vllm.entrypoints.openai.protocol import OpenAIError, ResponsesRequest
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_engine import ClosingStream
from vllm.outputs import RequestOutput
from vllm.utils import random_uuid


def _event(kind: str, seq: int, **fields: Any) -> str:
    """One typed server-sent event of the Responses API."""
    body = json.dumps({"type": kind, "sequence_number": seq, **fields})
    return f"event: {kind}\ndata: {body}\n\n"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reply(output: RequestOutput | None) -> tuple[str, int, str | None]:
    """(text, output tokens, finish_reason) of the request's one completion; an output
    aborted before its first step has none: ("", 0, "abort")."""
    if output is None or not output.outputs:
        return "", 0, "abort"
    c = output.outputs[0]
    return c.text, len(c.token_ids), c.finish_reason


_STATUS = {"length": "incomplete", "abort": "cancelled"}


def _message(item_id: str, parts: list[dict], status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": parts}


class OpenAIServingResponses(OpenAIServingChat):
    """POST /v1/responses (see the module docstring)."""

    @classmethod
    def sharing(cls, chat: OpenAIServingChat) -> OpenAIServingResponses:
        """A handler over the chat handler's engine, tokenizer, tokenizer thread, options."""
        return cls(chat.engine, chat.served_model_names, chat.max_model_len, chat.tokenizer,
                   chat.options, chat.tokenizer_worker)

    async def create_response(self, request: ResponsesRequest,
                              raw_request: Any = None) -> dict | AsyncIterator[str]:
        """A response object, or (stream=true) an async iterator of SSE strings.
        Raises OpenAIError for bad requests before anything is streamed."""
        model = self.check_model(request.model)
        request.check_supported()
        chat = request.to_chat_request()
        prompt = await self._render(chat)
        if not prompt:
            raise OpenAIError("input rendered to an empty prompt", 400, "input")
        max_tokens = self.resolve_max_tokens(len(prompt), request.max_output_tokens, "input",
                                             "max_output_tokens")
        params = self.sampling_params(chat.sampling_kwargs(self.default_sampling), max_tokens,
                                      None)
        response_id = request.request_id or f"resp_{random_uuid()}"
        shell = self._shell(request, response_id, model, params)
        streams = await self.start(response_id, [prompt], params)
        if request.stream:
            return ClosingStream(self._stream(streams, shell, len(prompt)), streams, self)
        final = (await self.collect(streams, raw_request))[0]
        return self._finish(shell, final, len(prompt))

    async def _render(self, chat: Any) -> list[int]:
        """The prompt's token ids; the checks of `render_off_loop`, naming `input`."""
        total = sum(len(m["content"]) for m in chat.messages)
        self.check_text_length(total, "input")
        try:
            return await self.off_loop(lambda: self.render(chat),
                                       "rendering the chat template and tokenizing")
        except OpenAIError as exc:
            if exc.param == "messages":
                exc.param = "input"
            raise

    def _shell(self, request: ResponsesRequest, response_id: str, model: str,
               params: Any) -> dict:
        """The response object without output, status or usage (what response.created
        shows); the sampling values are the ones in effect."""
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()),
            "model": model, "status": "in_progress", "output": [], "usage": None,
            "error": None, "incomplete_details": None, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {}, "parallel_tool_calls":
            request.parallel_tool_calls if request.parallel_tool_calls is not None else True,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": {"type": "text"}}, "tool_choice": request.tool_choice or "auto",
            "tools": [], "truncation": "disabled", "user": request.user, "background": False,
        }

    def _finish(self, shell: dict, final: RequestOutput | None, prompt_len: int,
                item_id: str | None = None) -> dict:
        """The whole response for the request's final output: status "completed",
        "incomplete" (the output budget ran out) or "cancelled" (aborted, e.g. at shutdown)."""
        text, output_tokens, finish_reason = _reply(final)
        response = dict(shell)
        response["status"] = _STATUS.get(finish_reason or "", "completed")
        if finish_reason == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        parts = [_text_part(text)] if text else []
        response["output"] = [_message(item_id or f"msg_{random_uuid()}", parts, "completed")]
        cached = final.num_cached_tokens if final is not None else 0
        response["usage"] = {
            "input_tokens": prompt_len,
            "input_tokens_details": {"cached_tokens": cached or 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_len + output_tokens}
        return response

    async def _stream(self, streams: list[RequestStream], shell: dict,
                      prompt_len: int) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            return _event(kind, seq - 1, **fields)

        item_id = f"msg_{random_uuid()}"
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=shell)
        yield event("response.in_progress", response=shell)
        sent = 0
        final: RequestOutput | None = None
        try:
            async for _, output in self.merged(streams):
                final = output
                text = _reply(output)[0]
                if len(text) > sent:
                    if sent == 0:
                        yield event("response.output_item.added", output_index=0,
                                    item=_message(item_id, [], "in_progress"))
                        yield event("response.content_part.added", item_id=item_id,
                                    output_index=0, content_index=0, part=_text_part(""))
                    yield event("response.output_text.delta", **where, delta=text[sent:],
                                logprobs=[])
                    sent = len(text)
            text = _reply(final)[0]
            if sent:
                yield event("response.output_text.done", **where, text=text, logprobs=[])
                yield event("response.content_part.done", **where, part=_text_part(text))
                yield event("response.output_item.done", output_index=0,
                            item=_message(item_id, [_text_part(text)], "completed"))
            yield event("response.completed",
                        response=self._finish(shell, final, prompt_len, item_id))
        except (EngineError, OpenAIError) as exc:
            message = str(exc)
            yield event("error", code="server_error", message=message, param=None)
            yield event("response.failed", response={
                **shell, "status": "failed",
                "error": {"code": "server_error", "message": message}})
        finally:
            self.abort_unfinished(streams)
