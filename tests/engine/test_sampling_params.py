"""SamplingParams validation and derived fields."""
from __future__ import annotations

import pytest

from vllm import SamplingParams
from vllm.sampling_params import SamplingType


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"logprobs": -2}, "logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": 1.5}, "seed"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    sp = SamplingParams()
    assert sp.max_tokens == 16 and sp.n == 1 and sp.temperature == 1.0 and sp.top_k == 0
    assert sp.skip_special_tokens and sp.detokenize and sp.stop == []
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(top_k=-1).top_k == 0
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=3)
    assert greedy.sampling_type == SamplingType.GREEDY and greedy.top_k == 0
    assert SamplingParams(seed=1).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams().sampling_type == SamplingType.RANDOM
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_eos_and_stop_ids():
    sp = SamplingParams(stop_token_ids=[5])
    sp.update_from_eos({2})
    assert sp.all_stop_token_ids == {2, 5} and sp.eos_token_ids == {2}
    sp = SamplingParams(stop_token_ids=[5], ignore_eos=True)
    sp.update_from_eos({2})
    assert sp.all_stop_token_ids == {5}


def test_stop_string_hold_back():
    assert SamplingParams(stop=["ab", "xyz"]).output_text_buffer_length == 2
    assert SamplingParams(stop=["xyz"], include_stop_str_in_output=True) \
        .output_text_buffer_length == 0

