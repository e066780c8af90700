"""Request: one sequence the scheduler runs (a prompt plus the tokens sampled so far)."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from vllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """The scheduler's view of a sequence.

    `num_computed_tokens` counts the tokens whose KV is in the cache; the scheduler moves it
    towards `num_tokens` (prompt + outputs). After a recompute preemption it drops back to 0 and
    the outputs so far are kept, so the recompute prefills prompt + outputs.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, max_tokens: int,
                 arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        """Resolved output budget (max_tokens, or what max_model_len leaves)."""
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        """Prompt tokens found in the prefix cache at first scheduling (-1 = not yet)."""
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.generator: torch.Generator | None = None
        """Per-request RNG for seeded sampling; it lives here so it survives preemption."""
        self.num_runner_tokens = 0
        """Tokens the model runner holds for this request (the rest are sent next step)."""
        self.num_prompt_logprobs_done = 0
        """Prompt positions whose logprobs were delivered (a recompute skips them)."""
        self.block_hashes: list[int] = []
        """Chained hashes of this request's full blocks (filled by the KV cache manager)."""

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
