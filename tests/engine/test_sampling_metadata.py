"""The runner's per-step sampling metadata: per-request tensors (logit_bias, allowed token
ids, up to 262144 entries each) are built once per request, not every step."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm.engine.model_runner import CachedRequestState, ModelRunner
from vllm.sampling_params import SamplingParams


def _state(req_id: str, params: SamplingParams) -> CachedRequestState:
    return CachedRequestState(req_id=req_id, prompt_token_ids=[1, 2], token_ids=[1, 2],
                              sampling_params=params, generator=None, block_ids=[0],
                              num_computed_tokens=0)


def _metadata(states, vocab_size=10):
    runner = SimpleNamespace(device=torch.device("cpu"))
    return ModelRunner._sampling_metadata(runner, states, vocab_size)


def test_logit_bias_and_allowed_ids_are_built_once_per_request():
    biased = _state("a", SamplingParams(temperature=0.5, logit_bias={3: 2.0, 7: -1.0, 50: 9.0}))
    plain = _state("b", SamplingParams(temperature=0.5))
    limited = _state("c", SamplingParams(temperature=0.5, allowed_token_ids=[4, 5, 99]))
    first = _metadata([plain, biased, limited])
    rows, cols, values = first.logit_bias
    assert rows.tolist() == [1, 1] and cols.tolist() == [3, 7]  # (50 is outside the vocab)
    assert values.tolist() == [2.0, -1.0]
    index, mask = first.allowed_tokens
    assert index.tolist() == [2] and mask[0].nonzero().flatten().tolist() == [4, 5]
    cached_bias, cached_allowed = biased._logit_bias, limited._allowed_ids
    assert cached_bias is not None and cached_allowed is not None
    again = _metadata([biased, limited])
    assert biased._logit_bias is cached_bias and limited._allowed_ids is cached_allowed
    assert again.logit_bias[0].tolist() == [0, 0]
    assert again.allowed_tokens[0].tolist() == [1]


def test_a_bias_only_outside_the_vocabulary_adds_nothing():
    md = _metadata([_state("a", SamplingParams(temperature=0.5, logit_bias={50: 1.0}))])
    assert md.logit_bias is None
