"""`OpenAIServing`: what the completion and chat handlers (and those built on them) share.

It checks the model name, tokenizes and length-checks prompts, builds `SamplingParams`, hands
the requests to the `AsyncLLM` (so a bad request fails with 400 before anything is streamed),
and collects or streams the outputs. A client that goes away (closed stream, or a dropped
connection while waiting for a non-streaming answer) aborts its requests so their KV blocks
are freed.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from vllm.engine.async_llm import AsyncLLM, EngineError, RequestStream
from vllm.entrypoints.openai.frontend_options import FrontendOptions
from vllm.entrypoints.openai.protocol import OpenAIError
from vllm.entrypoints.openai.tokenizer_worker import JobTimeout, TokenizerWorker
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.utils import random_uuid

logger = init_logger(__name__)

MAX_N = 128
_DISCONNECT_POLL_S = 0.25
# Characters per token allowed for in the length bound (normalizers can merge characters).
_CHARS_PER_TOKEN_SLACK = 4
_DONE = object()


class ClientDisconnected(Exception):
    """The client went away before its (non-streaming) answer was ready."""


class ClosingStream:
    """The SSE strings of a streaming response. `aclose()` closes the generator and aborts
    the engine requests that are still running, even if iteration never started (a client
    gone before its first byte)."""

    def __init__(self, gen: AsyncIterator[str], streams: list[RequestStream],
                 serving: OpenAIServing) -> None:
        self._gen = gen
        self._streams = streams
        self._serving = serving

    def __aiter__(self) -> ClosingStream:
        return self

    async def __anext__(self) -> str:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        try:
            await self._gen.aclose()  # type: ignore[attr-defined]
        finally:
            self._serving.abort_unfinished(self._streams)


def random_id(prefix: str) -> str:
    return f"{prefix}-{random_uuid()}"


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _finite(value: float) -> float:
    # JSON has no -inf; clients get a very small number instead.
    return max(float(value), -9999.0)


class OpenAIServing:
    """Shared by the completion and chat handlers."""

    def __init__(self, engine: AsyncLLM, served_model_names: Sequence[str],
                 max_model_len: int, tokenizer: Any,
                 options: FrontendOptions | None = None,
                 tokenizer_worker: TokenizerWorker | None = None) -> None:
        """`tokenizer_worker`: the thread that uses `tokenizer` (share one between handlers
        that share the tokenizer); None starts one."""
        self.options = options or FrontendOptions()
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.tokenizer_worker = tokenizer_worker or TokenizerWorker()
        self.max_prompt_chars = max_model_len * _longest_token_chars(tokenizer) * \
            _CHARS_PER_TOKEN_SLACK
        """No text longer than this fits max_model_len tokens: refused before tokenizing."""
        self.vocab_size = _vocab_size(tokenizer, engine)
        self.max_logprobs = _max_logprobs(engine)
        self.default_sampling = _generation_defaults(engine)
        # generation_config's max_new_tokens: a cap on every request's output, as upstream
        self.default_max_tokens: int | None = self.default_sampling.pop("max_tokens", None)
        self._token_text: dict[int, str] = {}

    # ---- request checks ------------------------------------------------------------------
    def check_model(self, name: str | None) -> str:
        """The served model name to report; 404 for a model this server does not serve."""
        if name is None or name in self.served_model_names:
            return self.served_model_names[0] if name is None else name
        raise OpenAIError(f"The model `{name}` does not exist.", 404, "model")

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def off_loop(self, fn: Any, what: str) -> Any:
        """fn() in the tokenizer thread, under VLLM_TOKENIZE_TIMEOUT_S; a 400 naming `what`
        when it runs longer."""
        from vllm import envs

        limit = envs.VLLM_TOKENIZE_TIMEOUT_S
        try:
            return await self.tokenizer_worker.run(fn, limit)
        except JobTimeout:
            raise OpenAIError(f"{what} took more than {limit:g} s (VLLM_TOKENIZE_TIMEOUT_S) "
                              f"and was stopped", 400) from None

    def check_text_length(self, text_len: int, param: str, keep: int | None = None,
                          what: str | None = None) -> None:
        """400 naming `param` for a text (`what`, default the param) too long to fit
        max_model_len tokens, decided from its length alone: no tokenizing a prompt that
        cannot be served. With truncate_prompt_tokens (`keep`) any length may be cut down."""
        if keep is None and text_len > self.max_prompt_chars:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"{what or param} has {text_len} characters, more than that many tokens can "
                f"hold ({self.max_prompt_chars}). Please shorten the {param}.", 400, param)

    def tail_for_truncation(self, text: str, keep: int | None) -> str:
        """With truncate_prompt_tokens, only the text's end can survive: tokenize no more
        of it than `keep` tokens (-1: max_model_len) can span, with room to spare."""
        if keep is None:
            return text
        tokens = self.max_model_len if keep == -1 else max(keep, 1)
        span = (tokens + 8) * self.max_prompt_chars // max(self.max_model_len, 1)
        return text[-span:] if len(text) > span else text

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise OpenAIError(f"{param} must not be empty", 400, param)
        if self.vocab_size is not None:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise OpenAIError(f"{param} holds token id {bad[0]}, outside the vocabulary "
                                  f"[0, {self.vocab_size})", 400, param)

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, prompt_param: str,
                           max_param: str = "max_tokens") -> int:
        """The output budget; 400 naming the field when prompt + output do not fit."""
        if requested is not None and requested < 1:
            raise OpenAIError(f"{max_param} must be at least 1, got {requested}", 400,
                              max_param)
        room = self.max_model_len - prompt_len
        if room < 1:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens, but the "
                f"{prompt_param} has {prompt_len} tokens, which leaves no room for output. "
                f"Please shorten the {prompt_param}.", 400, prompt_param)
        if requested is not None and requested > room:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_len + requested} tokens ({prompt_len} in the "
                f"{prompt_param}, {requested} in the completion). Please reduce the length of "
                f"the {prompt_param} or {max_param}.", 400, max_param)
        budget = room if requested is None else requested
        return budget if self.default_max_tokens is None else min(budget,
                                                                   self.default_max_tokens)

    def check_prompt_fits(self, prompt_len: int, prompt_param: str = "prompt") -> None:
        """400 naming the prompt when it is longer than max_model_len (for requests that
        generate nothing the caller sees)."""
        if prompt_len > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens, but the "
                f"{prompt_param} has {prompt_len} tokens. Please shorten the {prompt_param}.",
                400, prompt_param)

    def sampling_params(self, kwargs: dict[str, Any], max_tokens: int,
                        logprobs: int | None) -> Any:
        """SamplingParams, turning its ValueError into a 400 naming the field."""
        from vllm.sampling_params import SamplingParams

        n = kwargs.get("n", 1)
        if not 1 <= n <= MAX_N:
            raise OpenAIError(f"n must be between 1 and {MAX_N}, got {n}", 400, "n")
        seed = kwargs.get("seed")
        if seed is not None and not -(2**63) <= seed < 2**63:
            raise OpenAIError(f"seed must fit in a signed 64-bit integer, got {seed}", 400,
                              "seed")
        try:
            return SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=logprobs)
        except ValueError as exc:
            message = str(exc)
            field = message.split(" ", 1)[0]
            param = field if field in kwargs or field in ("max_tokens", "logprobs") else None
            raise OpenAIError(message, 400, param) from None

    # ---- running requests ----------------------------------------------------------------
    async def start(self, base_id: str, prompts: list[list[int]],
                    params: Any) -> list[RequestStream]:
        """Add one engine request per prompt, all in one command batch (the engine thread
        takes them between two steps, not one per step); if one is refused, abort the
        others."""
        ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        if self.options.enable_log_requests:
            for rid, token_ids in zip(ids, prompts):
                self.log_request(rid, token_ids, params)
        results = await self.engine.add_requests(
            [(rid, {"prompt_token_ids": ids_}, params) for rid, ids_ in zip(ids, prompts)])
        streams = [r for r in results if isinstance(r, RequestStream)]
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is None:
            return streams
        if streams:
            self.engine.abort_nowait([s.request_id for s in streams])
        if isinstance(error, ValueError):
            raise OpenAIError(str(error), 400) from None
        if isinstance(error, EngineError):
            raise OpenAIError(str(error), 500) from None
        raise error

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """The prompt's last `keep` tokens (-1: max_model_len; None: all); 400 naming
        truncate_prompt_tokens for another value."""
        from vllm.sampling_params import truncate_prompt

        try:
            return truncate_prompt(ids, keep, self.max_model_len)
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, "truncate_prompt_tokens") from None

    def check_prompt_logprobs(self, request: Any) -> int | None:
        """The request's prompt_logprobs; a 400 naming it outside [0, --max-logprobs]."""
        wanted = request.prompt_logprobs
        if wanted is not None and not 0 <= wanted <= self.max_logprobs:
            raise OpenAIError(f"prompt_logprobs must be between 0 and {self.max_logprobs} "
                              f"(the server's --max-logprobs), got {wanted}", 400,
                              "prompt_logprobs")
        return wanted

    def prompt_fields(self, request: Any, output: RequestOutput,
                      prompt_ids: list[int]) -> dict:
        """vLLM's optional prompt fields: prompt_logprobs (prompt_logprobs=N) and
        prompt_token_ids (return_token_ids)."""
        fields: dict[str, Any] = {}
        if request.prompt_logprobs is not None:
            fields["prompt_logprobs"] = [
                None if entry is None else {
                    str(tid): {"logprob": lp.logprob, "rank": lp.rank,
                               "decoded_token": lp.decoded_token}
                    for tid, lp in entry.items()}
                for entry in prompt_entries(output, len(prompt_ids))]
        if request.return_token_ids:
            fields["prompt_token_ids"] = list(prompt_ids)
        return fields

    def extra_choice_fields(self, request: Any, output: RequestOutput, prompt_ids: list[int],
                            token_ids: Any, first: bool) -> dict:
        """A completion choice's optional fields: the prompt's (`prompt_fields`) with its
        first chunk, and its token_ids (return_token_ids)."""
        extra = self.prompt_fields(request, output, prompt_ids) if first else {}
        if request.return_token_ids:
            extra["token_ids"] = list(token_ids)
        return extra

    def log_request(self, request_id: str, prompt_ids: list[int], params: Any) -> None:
        """One line per request (--enable-log-requests), the prompt cut to --max-log-len."""
        limit = self.options.max_log_len
        text = self.tokenizer.decode(prompt_ids[:limit] if limit is not None else prompt_ids)
        if limit is not None:
            text = text[:limit]
        shown = prompt_ids if limit is None else prompt_ids[:limit]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s "
                    "(%d tokens)", request_id, text, params, shown, len(prompt_ids))

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        ids = [s.request_id for s in streams if not s.finished]
        if ids:
            self.engine.abort_nowait(ids)

    async def merged(self, streams: list[RequestStream]
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from all streams as they arrive."""
        if len(streams) == 1:
            async for output in streams[0]:
                yield 0, output
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((i, output))
            except BaseException as exc:  # noqa: BLE001 - re-raised by the reader
                queue.put_nowait((i, exc))
            finally:
                queue.put_nowait((i, _DONE))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()

    async def collect(self, streams: list[RequestStream],
                      raw_request: Any = None) -> list[RequestOutput]:
        """The final output of every stream. Aborts them all if the client disconnects
        (then raises ClientDisconnected) or if this coroutine is cancelled."""
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def drain() -> None:
            async for i, output in self.merged(streams):
                finals[i] = output

        task = asyncio.create_task(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    task.result()
                    break
                if raw_request is not None and await raw_request.is_disconnected():
                    logger.info("client disconnected; aborting %s",
                                ", ".join(s.request_id for s in streams))
                    raise ClientDisconnected()
        except EngineError as exc:
            raise OpenAIError(str(exc), 500) from None
        finally:
            if not task.done():
                task.cancel()
            self.abort_unfinished(streams)
        return [f for f in finals if f is not None]

    # ---- tokens and logprobs -------------------------------------------------------------
    def tokens_as_ids(self, request: Any) -> bool:
        """Whether logprob tokens are shown as "token_id:N": the request's
        return_tokens_as_token_ids, else the server's --return-tokens-as-token-ids."""
        wanted = getattr(request, "return_tokens_as_token_ids", None)
        return self.options.return_tokens_as_token_ids if wanted is None else wanted

    def token_label(self, token_id: int, logprob: Any, as_ids: bool) -> str:
        """How a logprob entry names its token: its text, or "token_id:N" (`as_ids`: for
        tokens whose text alone is not valid UTF-8, or clients that map ids themselves)."""
        return f"token_id:{token_id}" if as_ids else self.token_text(token_id, logprob)

    def token_text(self, token_id: int, logprob: Any = None) -> str:
        decoded = getattr(logprob, "decoded_token", None)
        if decoded is not None:
            return decoded
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def completion_logprobs(self, token_ids: list[int], entries: list[dict] | None,
                            text_offset: int, as_ids: bool = False) -> dict:
        """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset.
        `as_ids`: tokens named "token_id:N"; the offsets still count the tokens' text."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for pos, tid in enumerate(token_ids):
            entry = (entries[pos] if entries is not None and pos < len(entries) else None) or {}
            chosen = entry.get(tid)
            text = self.token_text(tid, chosen)
            tokens.append(f"token_id:{tid}" if as_ids else text)
            token_logprobs.append(None if chosen is None else _finite(chosen.logprob))
            tops.append({self.token_label(t, lp, as_ids): _finite(lp.logprob)
                         for t, lp in _by_rank(entry)} if entry else None)
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def chat_logprobs(self, token_ids: list[int], entries: list[dict] | None,
                      num_top: int, as_ids: bool = False) -> dict:
        """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}.
        `as_ids`: tokens named "token_id:N" (bytes: that name's, as upstream)."""
        content = []
        for pos, tid in enumerate(token_ids):
            entry = entries[pos] if entries is not None and pos < len(entries) else {}
            chosen = entry.get(tid)
            text = self.token_label(tid, chosen, as_ids)
            top = [{"token": label, "logprob": _finite(lp.logprob),
                    "bytes": list(label.encode("utf-8"))}
                   for t, lp in _by_rank(entry)[:num_top]
                   for label in (self.token_label(t, lp, as_ids),)]
            content.append({"token": text,
                            "logprob": -9999.0 if chosen is None else _finite(chosen.logprob),
                            "bytes": list(text.encode("utf-8")), "top_logprobs": top})
        return {"content": content}


def _by_rank(entry: dict) -> list[tuple[int, Any]]:
    return sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None
                                                 else 1 << 30, -kv[1].logprob))


_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


def _generation_defaults(engine: Any) -> dict[str, Any]:
    """The model's generation_config sampling defaults (used for fields a request leaves
    unset), if the engine exposes them."""
    getter = getattr(getattr(engine, "engine", None), "get_default_sampling_params", None)
    if not callable(getter):
        return {}
    try:
        params = getter()
    except Exception:  # noqa: BLE001 - a bad generation_config must not stop serving
        logger.warning("ignoring the model's generation_config defaults", exc_info=True)
        return {}
    from vllm.sampling_params import SamplingParams

    plain = SamplingParams()
    return {name: getattr(params, name) for name in _DEFAULTABLE
            if getattr(params, name) != getattr(plain, name)}


def prompt_entries(output: RequestOutput, num_prompt_tokens: int) -> list:
    """The prompt's logprob entries (the first token's None), or Nones when the engine gave
    none."""
    entries = list(output.prompt_logprobs or [])
    return entries + [None] * (num_prompt_tokens - len(entries))


def _longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of the vocabulary spells (byte-level vocabularies: its
    bytes), so that len(text) / this bounds the text's token count from below."""
    vocab = getattr(tokenizer, "get_vocab", None)
    try:
        return max(1, max((len(t) for t in vocab()), default=1)) if vocab else 64
    except Exception:  # noqa: BLE001 - an odd tokenizer: a generous bound
        return 64


def _max_logprobs(engine: Any) -> int:
    """The engine's bound on logprobs per token (--max-logprobs, within the vocabulary);
    upstream's default 20 for an engine that does not say."""
    getter = getattr(getattr(engine, "model_config", None), "get_max_logprobs", None)
    return int(getter()) if callable(getter) else 20


def _vocab_size(tokenizer: Any, engine: Any) -> int | None:
    try:
        return int(engine.model_config.get_vocab_size())
    except Exception:  # noqa: BLE001 - fall back to the tokenizer
        try:
            return len(tokenizer)
        except Exception:  # noqa: BLE001
            return None
