"""Sampler: greedy, filters, seeded reproducibility, logprobs, min_tokens, penalties."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_top_k_top_p,
)


def meta(n, temperature=1.0, **kw) -> SamplingMetadata:
    temps = torch.full((n,), float(temperature))
    greedy = temperature == 0
    if greedy:
        temps.fill_(1.0)
    return SamplingMetadata(temperature=temps, all_greedy=greedy, all_random=not greedy, **kw)


def test_greedy_is_argmax_and_logprobs():
    logits = torch.randn(3, 50)
    out = Sampler()(logits, meta(3, 0.0, max_num_logprobs=2))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    lp = out.logprobs_tensors
    ref = logits.log_softmax(-1)
    assert lp.token_ids.shape == (3, 3)
    assert torch.equal(lp.token_ids[:, 0], logits.argmax(-1))
    assert torch.equal(lp.ranks[:, 0], torch.ones(3, dtype=torch.long))
    assert torch.allclose(lp.logprobs[:, 1], ref.max(-1).values)


def test_rank_of_sampled_token():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    md = meta(1, top_k=torch.tensor([4]), max_num_logprobs=0)
    torch.manual_seed(0)
    out = Sampler()(logits, md)
    token = int(out.sampled_token_ids[0])
    expected_rank = int((logits[0] > logits[0, token]).sum()) + 1
    assert int(out.logprobs_tensors.ranks[0, 0]) == expected_rank


def test_top_k_top_p_masks():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 4]), None)
    assert torch.isinf(out[0]).tolist() == [True, False, False, True]
    assert not torch.isinf(out[1]).any()
    out = apply_top_k_top_p(logits, None, torch.tensor([1e-6, 1.0]))
    assert torch.isinf(out[0]).tolist() == [True, False, True, True]
    assert not torch.isinf(out[1]).any()


def test_top_k_one_equals_greedy_in_mixed_batch():
    logits = torch.randn(4, 100)
    md = meta(4, 0.8, top_k=torch.tensor([1, 1, 1, 1]))
    assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.argmax(-1))
    mixed = meta(4, 1.0, greedy_mask=torch.tensor([True, False, True, False]))
    mixed.all_random = False
    out = Sampler()(logits, mixed).sampled_token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_seeded_rows_independent_of_batch():
    logits = torch.randn(3, 1000)

    def run(rows):
        gens = {i: torch.Generator().manual_seed(1234) for i in range(len(rows))}
        md = meta(len(rows), 1.0, generators=gens)
        return Sampler()(logits[rows], md).sampled_token_ids

    torch.manual_seed(1)
    a = run([0, 1, 2])
    torch.manual_seed(2)
    b = run([2, 0])
    assert a[2] == b[0] and a[0] == b[1]


def test_sampling_follows_distribution():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(4000, 3).contiguous()
    tokens = Sampler()(logits, meta(4000, 1.0)).sampled_token_ids
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_banned_tokens_and_penalties():
    logits = torch.tensor([[5.0, 1.0, 0.0], [5.0, 1.0, 0.0]])
    md = meta(2, 0.0, banned_tokens=(torch.tensor([0]), torch.tensor([0])))
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1, 0]
    md = meta(2, 0.0, repetition_penalties=torch.tensor([10.0, 1.0]),
              frequency_penalties=torch.zeros(2), presence_penalties=torch.tensor([0.0, 5.0]),
              prompt_token_ids=torch.tensor([[0], [3]]), output_token_ids=torch.tensor([[3],
                                                                                         [0]]))
    # Row 0: token 0 seen in the prompt -> 5/10 < 1. Row 1: token 0 in the output -> 5-5 = 0.
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1, 1]


def test_all_greedy_batches_need_no_temperatures():
    """The runner leaves `temperature` unset when every row is greedy (one tensor less per
    step); a batch with random rows must have them."""
    logits = torch.randn(3, 50)
    md = SamplingMetadata(temperature=None, all_greedy=True, all_random=False)
    assert Sampler()(logits, md).sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    md = SamplingMetadata(temperature=None, all_greedy=False, all_random=True)
    with pytest.raises(AssertionError, match="needs temperatures"):
        Sampler()(logits, md)


def test_logit_bias_and_allowed_tokens_steer_sampling_not_logprobs():
    """logit_bias is added before sampling and allowed_tokens masks the rest out; the
    logprobs returned stay the model's raw ones; rows without either are untouched."""
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.5], [5.0, 1.0, 0.0, 0.5], [5.0, 1.0, 0.0, 0.5]])
    allowed = torch.tensor([[False, False, True, True]])
    md = meta(3, 0.0, max_num_logprobs=0,
              logit_bias=(torch.tensor([0, 0]), torch.tensor([2, 0]), torch.tensor([10.0, -1.0])),
              allowed_tokens=(torch.tensor([1]), allowed))
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.tolist() == [2, 3, 0]
    raw = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs_tensors.logprobs[:, 0],
                          raw[torch.arange(3), out.sampled_token_ids])
    # Random rows never draw a masked-out token.
    md = meta(1, 1.0, allowed_tokens=(torch.tensor([0]), allowed[:, :]))
    draws = {int(Sampler()(logits[:1], md).sampled_token_ids[0]) for _ in range(50)}
    assert draws <= {2, 3}
