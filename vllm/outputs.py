"""What the engine returns: RequestOutput holding one CompletionOutput per sampled sequence.

The fields and their positional order follow upstream's classes, so code written against
upstream reads them unchanged; fields of features this engine does not have (LoRA,
encoder-decoder models, multi-modal inputs, KV transfer) are present and None (empty for
multi_modal_placeholders, as upstream).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.logprobs import Logprob, PromptLogprobs, SampleLogprobs

__all__ = ["CompletionOutput", "Logprob", "PromptLogprobs", "RequestOutput", "SampleLogprobs"]


@dataclass
class CompletionOutput:
    """One completion of a request.

    index: which of the request's n completions; text/token_ids: the output so far;
    cumulative_logprob: sum of the sampled tokens' logprobs (None unless logprobs were asked);
    finish_reason: None while running, then "stop" (EOS, stop token or stop string), "length"
    (max_tokens or max_model_len) or "abort"; stop_reason: the stop string or stop token id
    that ended it (None for EOS or length). lora_request, kv_transfer_params, routed_experts:
    always None here (no LoRA, KV transfer or expert-routing capture).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None
    kv_transfer_params: dict[str, Any] | None = None
    routed_experts: Any = None

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
    metrics: the engine's per-request timings when it records them, else None.
    lora_request, encoder_prompt, encoder_prompt_token_ids, kv_transfer_params: None (no
    LoRA, no encoder-decoder models, no KV transfer); multi_modal_placeholders: {} (text only).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict | None = field(default=None, repr=False)
    lora_request: Any = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int = 0
    multi_modal_placeholders: dict[str, Any] = field(default_factory=dict, kw_only=True)
    kv_transfer_params: dict[str, Any] | None = field(default=None, kw_only=True)

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one: with `aggregate`, append
        the completions' new text, tokens and logprobs (DELTA outputs); otherwise replace
        each completion with its newer state."""
        self.finished |= next_output.finished
        for new in next_output.outputs:
            for i, old in enumerate(self.outputs):
                if old.index != new.index:
                    continue
                if aggregate:
                    old.text += new.text
                    old.token_ids = [*old.token_ids, *new.token_ids]
                    if new.logprobs:
                        old.logprobs = [*(old.logprobs or []), *new.logprobs]
                    old.cumulative_logprob = new.cumulative_logprob
                    old.finish_reason = new.finish_reason
                    old.stop_reason = new.stop_reason
                else:
                    self.outputs[i] = new
                break
            else:
                self.outputs.append(new)

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, "
                f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
                f"finished={self.finished}, num_cached_tokens={self.num_cached_tokens})")
