"""What the engine returns: RequestOutput holding one CompletionOutput per sampled sequence."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token, its 1-based rank in the vocabulary, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the sampled/actual token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a request.

    index: which of the request's n completions; text/token_ids: the output so far;
    cumulative_logprob: sum of the sampled tokens' logprobs (None unless logprobs were asked);
    finish_reason: None while running, then "stop" (EOS, stop token or stop string), "length"
    (max_tokens or max_model_len) or "abort"; stop_reason: the stop string or stop token id
    that ended it (None for EOS or length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, "
                f"token_ids={self.token_ids}, cumulative_logprob={self.cumulative_logprob}, "
                f"logprobs={self.logprobs}, finish_reason={self.finish_reason}, "
                f"stop_reason={self.stop_reason})")


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its completions (cumulative; with
    `SamplingParams.output_kind=DELTA`, only what the step added).

    prompt_logprobs: None unless asked; otherwise one entry per prompt token, None for the
    first (nothing predicts it), then {token_id: Logprob} with the actual token and the top-k.
    num_cached_tokens: prompt tokens served from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, "
                f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
                f"finished={self.finished}, num_cached_tokens={self.num_cached_tokens})")
