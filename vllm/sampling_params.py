"""SamplingParams: how one request samples and when it stops (upstream field names)."""
from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are treated as greedy (argmax).
_SAMPLING_EPS = 1e-5


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
    """A logit_bias key as an int where it is one ("42" -> 42); anything else is kept for
    the check to name."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return key


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

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.logit_bias, dict):
            # JSON object keys arrive as strings ("50256": -100).
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, str):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters cannot change argmax, so turn them off.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        if self.top_k == -1:
            self.top_k = 0
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        def is_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", ">= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an integer >= -1 (0 or -1 disables top-k)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got "
                             f"{self.min_tokens}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < -1):
            raise bad("logprobs", "an integer >= 0, -1 (the whole vocabulary) or None")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or self.prompt_logprobs < -1):
            raise bad("prompt_logprobs", "an integer >= 0, -1 (the whole vocabulary) or None")
        if self.truncate_prompt_tokens is not None and (
                not is_int(self.truncate_prompt_tokens)
                or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)):
            raise bad("truncate_prompt_tokens", "an integer >= 1, -1 (max_model_len) or None")
        if self.bad_words is not None and (
                not isinstance(self.bad_words, (list, tuple))
                or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words", "a list of non-empty strings or None")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, "
                             f"got {self.stop!r}")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got "
                             f"{self.stop_token_ids!r}")
        if self.logit_bias is not None and (
                not isinstance(self.logit_bias, dict)
                or any(not is_int(k) or k < 0 for k in self.logit_bias)
                or any(isinstance(v, bool) or not isinstance(v, (int, float))
                       or not math.isfinite(v) for v in self.logit_bias.values())):
            raise bad("logit_bias", "a dict of token id (integer >= 0) -> finite number")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or any(not is_int(t) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "a non-empty list of token ids (integers >= 0)")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise bad("output_kind", "a RequestOutputKind (CUMULATIVE 0, DELTA 1, "
                      "FINAL_ONLY 2)") from None

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
        """Tokenize bad_words: each word as written and with a leading space (how it reads
        after another word), without special tokens; duplicates dropped."""
        sequences: list[list[int]] = []
        for word in self.bad_words or []:
            for text in (word, " " + word.lstrip()):
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        self._bad_words_token_ids = sequences

    def banned_by_bad_words(self, output_token_ids: list[int]) -> set[int]:
        """The tokens bad_words forbid next, after `output_token_ids`."""
        banned = set()
        for seq in self._bad_words_token_ids:
            prefix = seq[:-1]
            if not prefix or output_token_ids[-len(prefix):] == prefix:
                banned.add(seq[-1])
        return banned

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if not k.startswith("_"))
        return f"SamplingParams({fields})"
