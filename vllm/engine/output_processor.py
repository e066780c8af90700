"""OutputProcessor: turn the scheduler's per-step token ids into RequestOutputs.

Incremental detokenisation, stop strings (which finish a request here, and the engine then
finishes it in the scheduler), logprob dicts, and fan-in of the n sequences of one request.
"""
from __future__ import annotations

from typing import Any, Callable

from vllm.engine.sched_output import EngineCoreOutput, LogprobsLists
from vllm.engine.stop_matcher import StopStringMatcher
from vllm.outputs import CompletionOutput, Logprob, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

# Prompt tokens decoded in front of the output, so the first output token gets its leading
# space (and byte-level pieces their context) right.
_PROMPT_CONTEXT = 5


def list_decoder(tokenizer: Any) -> Callable[..., str]:
    """`tokenizer.decode` for a list of int ids. Where the tokenizer keeps transformers' own
    `decode` (not overridden), its `_decode`: the same text (special tokens, clean-up), without
    `decode`'s conversion of the ids to Python objects, which checks every id each call and
    took ~3/4 of the incremental detokenizer's time (two decodes of a few ids per token)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return tokenizer.decode
    plain = (isinstance(tokenizer, PreTrainedTokenizerBase)
             and type(tokenizer).decode is PreTrainedTokenizerBase.decode
             and callable(getattr(tokenizer, "_decode", None)))
    return tokenizer._decode if plain else tokenizer.decode


class IncrementalDetokenizer:
    """Decode one token at a time. Keeps a window [prefix_offset, read_offset) of ids that
    were already turned into text; a new token's text is what decoding the window plus the
    new ids adds, held back while it ends in an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_list = list_decoder(tokenizer)
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_list(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, token_id: int, flush: bool = False) -> str:
        """Add one token; return the new text it completes ('' while incomplete)."""
        self.ids.append(token_id)
        return self._emit(flush)

    def flush(self) -> str:
        return self._emit(True)

    def _emit(self, flush: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        seen = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) <= len(seen) or (text.endswith("\ufffd") and not flush):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(seen):]


def find_stop_string(text: str, num_new_chars: int, stops: list[str],
                     include: bool) -> tuple[str, int] | None:
    """The earliest stop string completed by the last `num_new_chars` characters (at equal
    starts, the one listed first), and the length to truncate the text to (before it, or
    after it when `include`). One-off form of what a sequence's StopStringCursor does step by
    step."""
    found = StopStringMatcher(stops).cursor().find(text, num_new_chars)
    if found is None:
        return None
    index, stop = found
    return stop, index + len(stop) if include else index


class SequenceState:
    """One of a request's n sequences (one internal engine request)."""

    def __init__(self, internal_id: str, index: int, params: SamplingParams,
                 prompt_token_ids: list[int], tokenizer: Any) -> None:
        self.internal_id = internal_id
        self.index = index
        self.params = params
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None \
            else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.sent = (0, 0)
        """DELTA outputs: the characters of text and the tokens already sent."""
        self.detokenizer = (IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                   params.skip_special_tokens)
                            if params.detokenize and tokenizer is not None else None)
        # Per step, stop matching reads only the new characters: the request's automaton
        # (shared by its n sequences) and this sequence's position in it.
        matcher = params.stop_matcher() if self.detokenizer is not None else None
        self.stop_cursor = matcher.cursor() if matcher is not None else None
        self.hold = params.output_text_buffer_length
        """Characters held back from unfinished text (computed once: it is a max over the
        stop strings)."""

    def completion(self, delta: bool = False) -> CompletionOutput:
        """The completion so far, or with `delta` what was added since the last delta."""
        text = self.text
        hold = self.hold
        if hold and self.finish_reason is None:
            text = text[:max(len(text) - hold, 0)]
        tokens, logprobs = self.token_ids, self.logprobs
        if delta:
            text_sent, tokens_sent = self.sent
            self.sent = (len(text), len(tokens))
            text, tokens = text[text_sent:], tokens[tokens_sent:]
            logprobs = None if logprobs is None else logprobs[tokens_sent:]
        return CompletionOutput(index=self.index, text=text, token_ids=list(tokens),
                                cumulative_logprob=self.cumulative_logprob,
                                logprobs=None if logprobs is None else list(logprobs),
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)


class RequestState:
    """A user request: its prompt and its n sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, sequences: list[SequenceState]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.sequences = sequences
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.num_cached_tokens = 0
        self.outputs_sent = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def make_output(self) -> RequestOutput | None:
        """This step's RequestOutput, as the request's `output_kind` asks (None: nothing to
        send this step)."""
        finished, kind = self.finished, self.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        prompt_logprobs = self.prompt_logprobs
        if delta:
            prompt_logprobs = None if self.outputs_sent else prompt_logprobs
        self.outputs_sent += 1
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids,
                             prompt_logprobs=prompt_logprobs,
                             outputs=[s.completion(delta) for s in self.sequences],
                             finished=finished, num_cached_tokens=self.num_cached_tokens)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._seq_to_request: dict[str, tuple[RequestState, SequenceState]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, internal_ids: list[str],
                    child_params: list[SamplingParams]) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seqs = [SequenceState(iid, i, p, prompt_token_ids, self.tokenizer)
                for i, (iid, p) in enumerate(zip(internal_ids, child_params))]
        state = RequestState(request_id, prompt, prompt_token_ids, params, seqs)
        self.requests[request_id] = state
        for seq in seqs:
            self._seq_to_request[seq.internal_id] = (state, seq)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests; returns the internal ids the scheduler must finish."""
        internal = []
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            for seq in state.sequences:
                self._seq_to_request.pop(seq.internal_id, None)
                if seq.finish_reason is None:
                    internal.append(seq.internal_id)
        return internal

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs of the requests that changed (in first-change order)
        and the internal ids that a stop string finished (to finish in the scheduler)."""
        changed: dict[str, RequestState] = {}
        stopped: list[str] = []
        for out in outputs:
            entry = self._seq_to_request.get(out.request_id)
            if entry is None:
                continue
            state, seq = entry
            if seq.finish_reason is not None:
                # Finished here (a stop string) while the engine core, in its own process,
                # already ran the next step: that step's tokens are not part of it.
                continue
            state.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._logprob_dict(lp)
                                             for lp in out.new_prompt_logprobs)
            if self._update_sequence(seq, out):
                stopped.append(seq.internal_id)
            changed[state.request_id] = state
        results = []
        for request_id, state in changed.items():
            output = state.make_output()
            if output is not None:
                results.append(output)
            if state.finished:
                self.requests.pop(request_id, None)
                for seq in state.sequences:
                    self._seq_to_request.pop(seq.internal_id, None)
        return results, stopped

    def _update_sequence(self, seq: SequenceState, out: EngineCoreOutput) -> bool:
        """Apply one step to a sequence; True when a stop string finished it here."""
        params = seq.params
        seq.token_ids.extend(out.new_token_ids)
        for lp in out.new_logprobs or ():
            seq.logprobs.append(self._logprob_dict(lp))
            seq.cumulative_logprob += lp.logprobs[0]
        if out.finished:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        if seq.detokenizer is None:
            return False
        new_text = ""
        for token in out.new_token_ids:
            # The stop token that finished the request is not part of the text.
            if (out.finish_reason == "stop" and token == out.new_token_ids[-1]
                    and not params.include_stop_str_in_output
                    and token in params.all_stop_token_ids):
                continue
            new_text += seq.detokenizer.update(token)
        if out.finished:
            new_text += seq.detokenizer.flush()
        seq.text += new_text
        if (not new_text or seq.stop_cursor is None or len(seq.token_ids) < params.min_tokens
                or out.finish_reason == "stop"):
            return False
        found = seq.stop_cursor.find(seq.text, len(new_text))
        if found is None:
            return False
        index, stop = found
        seq.text = seq.text[:index + len(stop) if params.include_stop_str_in_output else index]
        seq.finish_reason, seq.stop_reason = "stop", stop
        # A request that just hit its length limit is already finished in the scheduler.
        return not out.finished

    def _logprob_dict(self, lp: LogprobsLists) -> dict[int, Logprob]:
        result: dict[int, Logprob] = {}
        for token, logprob, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
            if token not in result:
                decoded = (self.tokenizer.decode([token]) if self.tokenizer is not None
                           else None)
                result[token] = Logprob(logprob, rank, decoded)
        return result
