"""The messages of one engine step: SchedulerOutput (scheduler -> runner; the only thing the
runner receives), ModelRunnerOutput (runner -> scheduler) and EngineCoreOutput (scheduler ->
output processor)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from vllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption
    (then `token_ids` holds prompt + the outputs so far, and everything is recomputed)."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens already in the KV cache (prefix-cache hit)."""


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed since the last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    new_token_ids: list[int] = field(default_factory=list)
    """Tokens sampled since the runner last saw the request (every rank gets them, so tensor
    parallel ranks never depend on their own sampling)."""


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    """Tokens to compute this step per request, in batch order."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    """Finished, aborted or preempted since the last step: the runner drops their state."""
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class LogprobsLists:
    """Logprobs for one position: index 0 is the actual (sampled or prompt) token, then the
    top-k. Ranks are 1-based ranks in the vocabulary."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    sampled_token_ids: dict[str, int]
    """Only requests whose known tokens are all computed after this step sample."""
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[LogprobsLists]]] = field(default_factory=dict)
    """req_id -> (first prompt position predicted, one entry per predicted prompt token)."""


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids={})


@dataclass
class EngineCoreOutput:
    """What one step did to one request, for the output processor."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsLists] | None = None
    new_prompt_logprobs: list[LogprobsLists] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
