"""SamplingParams: how one request samples and when it stops (upstream field names)."""
from __future__ import annotations

import copy
import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from vllm.engine.bad_words import BadWordsIndex, encode_all
from vllm.engine.stop_matcher import StopStringMatcher

# Temperatures below this are treated as greedy (argmax).
_SAMPLING_EPS = 1e-5

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Integer fields end up in int64 tensors or torch seeds: they must fit."""

# Size limits, checked when SamplingParams is built. Far above what real clients send (OpenAI
# allows 4 stop strings), low enough to bound one request's work. Matching costs per step do
# not depend on them (an automaton, an index); what does is the one-off build on the engine
# thread when the request is added: the stop-string automaton (~1.5 us of CPU per character
# on a loaded 2-core dev box: ~25 ms at the total below) and the bad words' tokenization and
# index. The n sequences of a request share both.
MAX_N = 1024
"""Sequences per request (the OpenAI server caps n lower, at 128)."""
MAX_STOP_STRINGS = 1024
MAX_STOP_STRING_LENGTH = 1024
"""Characters per stop string; streamed text holds back up to this many minus one."""
MAX_STOP_STRINGS_TOTAL_LENGTH = 16384
"""Characters over all stop strings (e.g. 1024 strings of 16, or 16 of 1024)."""
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_LENGTH = 1024
MAX_BAD_WORDS_TOTAL_LENGTH = 16384
MAX_ALLOWED_TOKEN_IDS = 262144
"""Vocabulary scale (Gemma 3 has 262144 tokens); the engine also checks each id against the
model's vocabulary."""
MAX_LOGIT_BIAS_ENTRIES = 262144

# Float ranges that keep the sampler's float32 arithmetic finite: a logit of ~1e5 plus a bias
# of 1e10, divided by the smallest repetition penalty and the smallest sampling temperature,
# stays below 1e22 (float32 overflows at 3.4e38 and an inf logit turns softmax into NaN).
MAX_TEMPERATURE = 1e6
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6
MAX_ABS_LOGIT_BIAS = 1e10


class RequestOutputKind(enum.IntEnum):
    """Which RequestOutputs a request yields (upstream's names and values)."""

    CUMULATIVE = 0
    """After every step: the text, tokens and logprobs so far."""
    DELTA = 1
    """After every step: only what that step added (and the prompt logprobs in the first)."""
    FINAL_ONLY = 2
    """Once, when the request is finished (what `LLM.generate` uses)."""


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _token_key(key: Any) -> Any:
    """A logit_bias key as an int where it is one ("42" -> 42); anything else (including
    digit strings too long for int64) is kept for the check to name."""
    if isinstance(key, str):
        text = key.strip()
        digits = text[1:] if text.startswith("-") else text
        if digits.isascii() and digits.isdigit() and len(digits) <= 19:
            return int(text)
    return key


def _show(value: Any, limit: int = 80) -> str:
    """repr() for error messages, cut to `limit` characters (a 100k-string stop list or an
    int past Python's 4300-digit str() limit must not end up in, or break, the message)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<a {value.bit_length()}-bit integer>"
    if isinstance(value, (list, tuple, set, dict)) and len(value) > 8:
        return f"<a {type(value).__name__} of {len(value)} items>"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_float(value: Any) -> float | None:
    """`value` as a finite float, or None when it is not a finite real number (bools, NaN,
    inf, ints past the float range are None)."""
    if not _is_real(value):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    return number if math.isfinite(number) else None


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len; None: all).
    Raises ValueError naming it when it is not -1 or in [1, max_model_len]."""
    if keep is None:
        return token_ids
    if (keep < 1 and keep != -1) or keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens must be -1 or between 1 and max_model_len "
                         f"({max_model_len}), got {keep}")
    keep = max_model_len if keep == -1 else keep
    return token_ids[-keep:] if len(token_ids) > keep else token_ids


@dataclass
class SamplingParams:
    """Per-request sampling settings. Invalid values raise ValueError naming the field and the
    allowed range; `temperature=0` means greedy; `top_k` 0 or -1 means off."""

    n: int = 1
    """Completions to return for the prompt."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens, whatever else runs in the batch."""
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    """Output tokens at most; None = up to max_model_len."""
    min_tokens: int = 0
    """EOS and stop tokens are masked (and stop strings ignored) until this many tokens."""
    logprobs: int | None = None
    """Return this many top logprobs (plus the sampled token's) per output token; -1: the
    whole vocabulary. The engine refuses more than its max_logprobs (default 20)."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first."""
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    """token id -> value added to its logit before sampling (OpenAI's logit_bias). The
    returned logprobs stay the model's own."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids can be sampled."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last N tokens (-1: the last max_model_len)."""
    bad_words: list[str] | None = None
    """Words never generated: a word's last token is banned wherever the output so far ends
    with its other tokens (each word as written and with a leading space)."""
    # Filled by the engine from the tokenizer and generation config (not user fields).
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False,
                                          compare=False)
    _eos_token_ids: set[int] = field(default_factory=set, init=False, repr=False, compare=False)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False,
                                                  compare=False)
    # Derived, read-only once built, and shared by clones (the n sequences of a request).
    _stop_matcher: StopStringMatcher | None = field(default=None, init=False, repr=False,
                                                    compare=False)
    _bad_words_index: BadWordsIndex | None = field(default=None, init=False, repr=False,
                                                   compare=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = self._as_list("stop", self.stop,
                                      "a non-empty string or a list of non-empty strings")
        self.stop_token_ids = self._as_list("stop_token_ids", self.stop_token_ids or [],
                                            "a list of token ids")
        if isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES:
            # JSON object keys arrive as strings ("50256": -100).
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, str):
            self.allowed_token_ids = self._as_list("allowed_token_ids", self.allowed_token_ids,
                                                   "a non-empty list of token ids")
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        elif isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words)
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters cannot change argmax, so turn them off.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        if self.top_k == -1:
            self.top_k = 0
        self._all_stop_token_ids = set(self.stop_token_ids)

    @staticmethod
    def _as_list(name: str, value: Any, allowed: str) -> list:
        if isinstance(value, (list, tuple, set, frozenset)):
            return list(value)
        raise ValueError(f"{name} must be {allowed}, got {_show(value)}")

    def _verify(self) -> None:
        """Check every field's type and range; normalise numbers to plain int / float (so an
        int or float subclass cannot answer the range checks one way and the tensors another).
        Raises ValueError starting with the field's name (the server reports it as the bad
        parameter)."""

        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {_show(getattr(self, name))}")

        def check_int(name: str, low: int, high: int, allowed: str, optional: bool = False,
                      extra: tuple[int, ...] = ()) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            if not _is_int(value) or not (low <= value <= high or value in extra):
                raise bad(name, allowed)
            setattr(self, name, int(value))

        def check_float(name: str, low: float, high: float, allowed: str,
                        low_open: bool = False) -> None:
            number = _as_float(getattr(self, name))
            if number is None or not low <= number <= high or (low_open and number == low):
                raise bad(name, allowed)
            setattr(self, name, number)

        check_int("n", 1, MAX_N, f"an integer in [1, {MAX_N}]")
        check_float("presence_penalty", -2.0, 2.0, "a number in [-2, 2]")
        check_float("frequency_penalty", -2.0, 2.0, "a number in [-2, 2]")
        check_float("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY,
                    f"a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                    "(> 0; 1 means no penalty)")
        check_float("temperature", 0.0, MAX_TEMPERATURE,
                    f"a finite number in [0, {MAX_TEMPERATURE:g}] (0 means greedy)")
        check_float("top_p", 0.0, 1.0, "a number in (0, 1]", low_open=True)
        check_int("top_k", -1, INT64_MAX,
                  "an integer >= -1 that fits in 64 bits (0 or -1 disables top-k; values "
                  "above the vocabulary size keep every token)")
        check_float("min_p", 0.0, 1.0, "a number in [0, 1]")
        check_int("seed", INT64_MIN, INT64_MAX,
                  "an integer that fits in a signed 64-bit integer, or None", optional=True)
        check_int("max_tokens", 1, INT64_MAX, "an integer >= 1 that fits in 64 bits, or None",
                  optional=True)
        check_int("min_tokens", 0, INT64_MAX, "an integer >= 0 that fits in 64 bits")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got "
                             f"{self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            check_int(name, 0, INT64_MAX,
                      "an integer >= 0, -1 (the whole vocabulary) or None", optional=True,
                      extra=(-1,))
        check_int("truncate_prompt_tokens", 1, INT64_MAX,
                  "an integer >= 1, -1 (max_model_len) or None", optional=True, extra=(-1,))
        self._verify_stops()
        self._verify_token_ids()
        self._verify_bad_words()
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise bad("output_kind", "a RequestOutputKind (CUMULATIVE 0, DELTA 1, "
                      "FINAL_ONLY 2)") from None

    def _verify_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} "
                             "are allowed")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, "
                             f"got {_show(self.stop)}")
        longest = max(self.stop, key=len, default="")
        if len(longest) > MAX_STOP_STRING_LENGTH:
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_LENGTH} "
                             f"characters long, got one of {len(longest)}")
        total = sum(map(len, self.stop))
        if total > MAX_STOP_STRINGS_TOTAL_LENGTH:
            raise ValueError(f"stop strings must total at most {MAX_STOP_STRINGS_TOTAL_LENGTH} "
                             f"characters, got {total}")

    def _verify_token_ids(self) -> None:
        def token_ids(name: str, ids: list, limit: int, allowed: str) -> list[int]:
            if len(ids) > limit:
                raise ValueError(f"{name} has {len(ids)} entries; at most {limit} are allowed")
            for t in ids:
                if not _is_int(t) or not 0 <= t <= INT64_MAX:
                    raise ValueError(f"{name} must be {allowed}, got {_show(t)} in it")
            return [int(t) for t in ids]

        self.stop_token_ids = token_ids("stop_token_ids", self.stop_token_ids,
                                        MAX_STOP_TOKEN_IDS,
                                        "a list of token ids (integers in [0, 2**63))")
        if self.logit_bias is not None:
            allowed = (f"a dict of token id (an integer in [0, 2**63)) -> bias (a finite number "
                       f"in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}])")
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be {allowed}, got {_show(self.logit_bias)}")
            keys = token_ids("logit_bias", list(self.logit_bias), MAX_LOGIT_BIAS_ENTRIES,
                             allowed)
            values = [_as_float(v) for v in self.logit_bias.values()]
            for key, value, number in zip(keys, self.logit_bias.values(), values):
                if number is None or abs(number) > MAX_ABS_LOGIT_BIAS:
                    raise ValueError(f"logit_bias must be {allowed}, got {_show(value)} for "
                                     f"token {key}")
            self.logit_bias = dict(zip(keys, values))
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids "
                                 f"(integers in [0, 2**63)), got "
                                 f"{_show(self.allowed_token_ids)}")
            self.allowed_token_ids = token_ids(
                "allowed_token_ids", self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS,
                "a non-empty list of token ids (integers in [0, 2**63))")

    def _verify_bad_words(self) -> None:
        words = self.bad_words
        if words is None:
            return
        if isinstance(words, list) and len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words has {len(words)} words; at most {MAX_BAD_WORDS} are "
                             "allowed")
        if (not isinstance(words, list)
                or any(not isinstance(w, str) or not w.strip() for w in words)):
            raise ValueError(f"bad_words must be a list of non-empty strings or None, got "
                             f"{_show(words)}")
        longest = max(words, key=len, default="")
        if len(longest) > MAX_BAD_WORD_LENGTH:
            raise ValueError(f"bad_words must be at most {MAX_BAD_WORD_LENGTH} characters "
                             f"long each, got one of {len(longest)}")
        total = sum(map(len, words))
        if total > MAX_BAD_WORDS_TOTAL_LENGTH:
            raise ValueError(f"bad_words must total at most {MAX_BAD_WORDS_TOTAL_LENGTH} "
                             f"characters, got {total}")

    # ---- derived ------------------------------------------------------------------------
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        """stop_token_ids plus the model's EOS ids (unless ignore_eos)."""
        return self._all_stop_token_ids

    @property
    def eos_token_ids(self) -> set[int]:
        return self._eos_token_ids

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def output_text_buffer_length(self) -> int:
        """Characters held back from streamed text so a partial stop string is never shown."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    def update_from_eos(self, eos_token_ids: set[int]) -> None:
        """Record the model's EOS ids (tokenizer + generation config); they stop the request
        unless ignore_eos."""
        self._eos_token_ids = set() if self.ignore_eos else set(eos_token_ids)
        self._all_stop_token_ids = set(self.stop_token_ids) | self._eos_token_ids

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize bad_words (in one batch where the tokenizer takes one): each word as
        written and with a leading space (how it reads after another word), without special
        tokens; duplicates dropped. Builds the index `banned_by_bad_words` walks."""
        texts = [text for word in self.bad_words or [] for text in (word, " " + word.lstrip())]
        sequences: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for ids in encode_all(tokenizer, texts):
            if ids and tuple(ids) not in seen:
                seen.add(tuple(ids))
                sequences.append(ids)
        self._bad_words_token_ids = sequences
        self._bad_words_index = BadWordsIndex.build(sequences) if sequences else None

    def banned_by_bad_words(self, token_ids: list[int], start: int = 0) -> set[int]:
        """The tokens bad_words forbid next, after the output `token_ids[start:]` (a word's
        prefix must lie within it: pass the whole sequence and the prompt length to save a
        copy). Walks the index backwards from the last token, so the cost is the length of
        the longest matching word prefix, whatever the number of words."""
        index = self._bad_words_index
        if index is None:
            if not self._bad_words_token_ids:
                return set()
            index = self._bad_words_index = BadWordsIndex.build(self._bad_words_token_ids)
        return index.banned_after(token_ids, start)

    def stop_matcher(self) -> StopStringMatcher | None:
        """The matcher of `stop` (an Aho-Corasick automaton when there are more than a few;
        None without stop strings): built at first use, rebuilt if `stop` was changed since,
        and shared by clones."""
        if not self.stop:
            return None
        matcher = self._stop_matcher
        if matcher is None or matcher.stops != tuple(self.stop):
            matcher = self._stop_matcher = StopStringMatcher(self.stop)
        return matcher

    def clone(self) -> SamplingParams:
        """An independent copy. The validated containers hold only ints, floats and strings,
        so they are copied one level deep (a deepcopy walks every element: 128 children of a
        request with a 262144-entry logit_bias took seconds); the derived stop-string
        automaton, bad-words sequences and index are read-only and shared."""
        memo: dict[int, Any] = {}
        for name in ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids",
                     "bad_words", "_all_stop_token_ids", "_eos_token_ids"):
            value = getattr(self, name)
            if isinstance(value, (list, dict, set)):
                memo[id(value)] = copy.copy(value)
        memo[id(self._bad_words_token_ids)] = self._bad_words_token_ids
        new = copy.deepcopy(self, memo)  # __getstate__ leaves the derived caches out
        new._stop_matcher = self.stop_matcher()
        new._bad_words_index = self._bad_words_index
        return new

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (e.g. to tensor-parallel workers, which do not sample) without the derived
        caches: they are rebuilt where they are used."""
        state = self.__dict__.copy()
        state["_stop_matcher"] = state["_bad_words_index"] = None
        return state

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if not k.startswith("_"))
        return f"SamplingParams({fields})"
