"""Per-token log-probabilities as the engine returns them (upstream's `vllm.logprobs`).

One position's logprobs are a dict token id -> `Logprob`: the sampled (or, for a prompt, the
actual) token and the top-k alternatives. A sequence's are a list of such dicts; a prompt's
list starts with None (nothing predicts the first token). Upstream's flat container
(`FlatLogprobs`) is not provided: the lists are the only form here.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Logprob", "LogprobsOnePosition", "PromptLogprobs", "SampleLogprobs",
           "create_prompt_logprobs", "create_sample_logprobs"]


@dataclass
class Logprob:
    """The log-probability of one token, its 1-based rank in the vocabulary, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsOnePosition = dict[int, Logprob]
PromptLogprobs = list[LogprobsOnePosition | None]
"""One entry per prompt token; the first is None."""
SampleLogprobs = list[LogprobsOnePosition]
"""One entry per generated token."""


def _check_not_flat(flat_logprobs: bool) -> None:
    if flat_logprobs:
        raise ValueError("flat_logprobs=True is not supported: this engine keeps logprobs as "
                         "lists of {token_id: Logprob} dicts (use flat_logprobs=False)")


def create_prompt_logprobs(flat_logprobs: bool = False) -> PromptLogprobs:
    """An empty prompt-logprobs container holding the first token's None entry."""
    _check_not_flat(flat_logprobs)
    return [None]


def create_sample_logprobs(flat_logprobs: bool = False) -> SampleLogprobs:
    """An empty sample-logprobs container."""
    _check_not_flat(flat_logprobs)
    return []
