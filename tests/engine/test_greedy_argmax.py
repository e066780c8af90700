"""greedy_argmax (the sampler's argmax; a C++ kernel for float32 CPU logits) equals
torch.argmax: first index of the maximum, NaN rows, all -inf rows, odd widths, strided rows."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.sampler import greedy_argmax


@pytest.mark.parametrize("shape", [(1, 151936), (16, 32000), (3, 7), (5, 17), (2, 1)])
def test_matches_torch_argmax(shape):
    torch.manual_seed(0)
    x = torch.randn(*shape)
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))


def test_ties_nan_and_inf():
    torch.manual_seed(0)
    x = torch.randn(6, 1000)
    x[0, 10] = x[0, 900] = 50.0  # tie: the first index wins
    x[1, 333] = float("nan")
    x[1, 444] = float("nan")  # NaN is the maximum; the first one wins
    x[2] = float("-inf")
    x[3, -1] = 99.0  # in the scalar tail
    x[4, 0] = 99.0
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))


def test_strided_rows_and_other_dtypes():
    torch.manual_seed(0)
    x = torch.randn(4, 300)[:, 50:250]
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))
    xb = torch.randn(4, 300).bfloat16()
    assert torch.equal(greedy_argmax(xb), xb.argmax(dim=-1))
