"""/v1/completions (the shared request handling is `OpenAIServing`, serving_engine.py)."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from vllm.engine.async_llm import EngineError, RequestStream
from vllm.entrypoints.openai.protocol import CompletionRequest, OpenAIError, error_body
from vllm.entrypoints.openai.serving_engine import (
    ClosingStream,
    OpenAIServing,
    prompt_entries,
    random_id,
    sse,
)
from vllm.outputs import RequestOutput


def _without_generation(output: RequestOutput) -> RequestOutput:
    """A finished echo-only output (max_tokens=0) as the client sees it: every completion
    empty, finished by "length" (the budget of 0 tokens), unless it was aborted or failed."""
    return dataclasses.replace(output, outputs=[
        dataclasses.replace(
            c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
            cumulative_logprob=None if c.cumulative_logprob is None else 0.0,
            finish_reason=c.finish_reason if c.finish_reason not in ("stop", "length")
            else "length", stop_reason=None)
        for c in output.outputs])


def _end_offset(logprobs: dict, start: int) -> int:
    """The text offset after the last token of a completions logprobs dict (`start` when it
    holds no token)."""
    if not logprobs["tokens"]:
        return start
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


class OpenAIServingCompletion(OpenAIServing):
    """POST /v1/completions."""

    async def create_completion(self, request: CompletionRequest,
                                raw_request: Any = None) -> dict | AsyncIterator[str]:
        """A response dict, or (stream=true) an async iterator of SSE strings.
        Raises OpenAIError for bad requests before anything is streamed."""
        model = self.check_model(request.model)
        request.check_stream_and_format()
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported", 400, "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of is not supported (use n)", 400, "best_of")
        if request.logprobs is not None and not 0 <= request.logprobs <= self.max_logprobs:
            raise OpenAIError(f"logprobs must be between 0 and {self.max_logprobs} (the "
                              f"server's --max-logprobs), got {request.logprobs}", 400,
                              "logprobs")
        items = request.prompts()
        limit = self.options.max_prompts_per_request
        if len(items) > limit:
            raise OpenAIError(f"prompt holds {len(items)} prompts, more than the server's "
                              f"limit of {limit} per request (--max-prompts-per-request)", 400,
                              "prompt")
        keep = request.truncate_prompt_tokens
        for item in items:
            if isinstance(item, str):
                self.check_text_length(len(item), "prompt", keep)
        echo_only = request.echo and request.max_tokens == 0
        if request.max_tokens == 0 and not request.echo:
            raise OpenAIError("max_tokens must be at least 1, got 0 (0 is allowed only with "
                              "echo=true, to score the prompt without generating)", 400,
                              "max_tokens")
        if echo_only and request.min_tokens > 0:
            raise OpenAIError(f"min_tokens must be <= max_tokens (0), got {request.min_tokens}",
                              400, "min_tokens")
        texts, prompts = await self.off_loop(lambda: self._prompt_tokens(request, items),
                                             "tokenizing the prompt")
        longest = max(len(p) for p in prompts)
        if echo_only:
            # The engine computes the prompt's logprobs in the step that samples the first
            # token: that one token is generated and dropped (as upstream does), so the
            # prompt may fill max_model_len.
            self.check_prompt_fits(longest)
            max_tokens = 1
        else:
            max_tokens = self.resolve_max_tokens(longest, request.max_tokens, "prompt")
        kwargs = request.sampling_kwargs(self.default_sampling)
        wanted = self.check_prompt_logprobs(request)
        if request.echo and request.logprobs is not None:
            # The echoed prompt's tokens get logprobs too (the first one None), as in vLLM.
            wanted = max(wanted or 0, request.logprobs)
        if wanted is not None:
            kwargs["prompt_logprobs"] = wanted
        params = self.sampling_params(kwargs, max_tokens, request.logprobs)
        base_id = random_id("cmpl")
        created = int(time.time())
        streams = await self.start(base_id, prompts, params)
        if request.stream:
            return ClosingStream(
                self._stream(request, streams, prompts, texts, base_id, created, model,
                             echo_only), streams, self)
        finals = await self.collect(streams, raw_request)
        if echo_only:
            finals = [_without_generation(f) for f in finals]
        return self._response(request, finals, prompts, texts, base_id, created, model)

    def _prompt_tokens(self, request: CompletionRequest, items: list[str | list[int]]
                       ) -> tuple[list[str], list[list[int]]]:
        """(texts to echo, token ids) of each prompt, cut to truncate_prompt_tokens (runs
        in the tokenizer thread)."""
        texts: list[str] = []
        prompts: list[list[int]] = []
        keep = request.truncate_prompt_tokens
        for item in items:
            if isinstance(item, str):
                ids = self.tokenize(self.tail_for_truncation(item, keep))
                texts.append(item)
            else:
                ids = list(item)
                self.check_token_ids(ids, "prompt")
                texts.append(self.tokenizer.decode(ids) if request.echo else "")
            if not ids:
                raise OpenAIError("prompt must not be empty", 400, "prompt")
            cut = self.truncate(ids, keep)
            if len(cut) < len(ids) and request.echo:
                texts[-1] = self.tokenizer.decode(cut)  # echo what the model saw
            prompts.append(cut)
        return texts, prompts

    def _response(self, request: CompletionRequest, finals: list[RequestOutput],
                  prompts: list[list[int]], texts: list[str], base_id: str, created: int,
                  model: str) -> dict:
        choices = []
        completion_tokens = 0
        n = request.n
        as_ids = self.tokens_as_ids(request)
        for i, final in enumerate(finals):
            prefix = texts[i] if request.echo else ""
            for c in final.outputs:
                completion_tokens += len(c.token_ids)
                logprobs = None
                if request.logprobs is not None and request.echo:
                    logprobs = self.completion_logprobs(
                        prompts[i] + list(c.token_ids),
                        prompt_entries(final, len(prompts[i])) + list(c.logprobs or []), 0,
                        as_ids)
                elif request.logprobs is not None:
                    logprobs = self.completion_logprobs(c.token_ids, c.logprobs, 0, as_ids)
                choice = {"index": i * n + c.index, "text": prefix + c.text,
                          "logprobs": logprobs, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason}
                choice.update(self.extra_choice_fields(request, final, prompts[i],
                                                       c.token_ids, first=True))
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        prompt_tokens = sum(len(p) for p in prompts)
        return {"id": base_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    async def _stream(self, request: CompletionRequest, streams: list[RequestStream],
                      prompts: list[list[int]], texts: list[str], base_id: str, created: int,
                      model: str, echo_only: bool = False) -> AsyncIterator[str]:
        """`echo_only` (echo with max_tokens=0): each choice is one chunk, the prompt and its
        logprobs, sent when its request has finished (its one token dropped)."""
        n = request.n
        as_ids = self.tokens_as_ids(request)
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        # echo + logprobs: the text offset of each choice's next token (its tokens' texts
        # summed, the prompt's included), as the whole response counts them.
        next_offset: dict[int, int] = {}
        finished: set[int] = set()
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        prompt_tokens = sum(len(p) for p in prompts)

        def usage() -> dict:
            done = sum(sent_tokens.values())
            return {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                    "total_tokens": prompt_tokens + done}

        try:
            async for i, output in self.merged(streams):
                if echo_only:
                    if not output.finished:
                        continue
                    output = _without_generation(output)
                choices = []
                for c in output.outputs:
                    index = i * n + c.index
                    if index in finished:
                        continue
                    first = index not in sent_text
                    start_text, start_tok = sent_text.get(index, 0), sent_tokens.get(index, 0)
                    delta = c.text[start_text:]
                    new_ids = c.token_ids[start_tok:]
                    if not delta and not new_ids and c.finish_reason is None and not (
                            first and request.echo):
                        continue
                    prefix = texts[i] if first and request.echo else ""
                    logprobs = None
                    if request.logprobs is not None:
                        entries = [] if c.logprobs is None else list(c.logprobs[start_tok:])
                        ids, offset = new_ids, start_text
                        if request.echo:  # offsets run on over the echoed prompt's tokens
                            if first:
                                ids = prompts[i] + list(new_ids)
                                entries = prompt_entries(output, len(prompts[i])) + entries
                            offset = next_offset.get(index, 0)
                        logprobs = self.completion_logprobs(ids, entries, offset, as_ids)
                        next_offset[index] = _end_offset(logprobs, offset)
                    sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                    if c.finish_reason is not None:
                        finished.add(index)
                    choice = {"index": index, "text": prefix + delta, "logprobs": logprobs,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    choice.update(self.extra_choice_fields(request, output, prompts[i],
                                                           new_ids, first))
                    choices.append(choice)
                for choice in choices:  # one per chunk, as vLLM streams
                    chunk = {"id": base_id, "object": "text_completion", "created": created,
                             "model": model, "choices": [choice]}
                    if include_usage:
                        chunk["usage"] = usage() if continuous else None
                    yield sse(chunk)
            if include_usage:
                yield sse({"id": base_id, "object": "text_completion", "created": created,
                           "model": model, "choices": [], "usage": usage()})
        except EngineError as exc:
            yield sse(error_body(str(exc), 500))
        finally:
            self.abort_unfinished(streams)
        yield sse("[DONE]")
