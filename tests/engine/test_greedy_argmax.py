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


WIDTHS = [*range(1, 80), 127, 128, 129, 255, 256, 257, 1000, 1031, 4096 + 13]


@pytest.mark.parametrize("width", WIDTHS)
def test_every_position_of_the_maximum_ties_and_nan(width):
    """Around the kernel's vector steps (8 or 16 lanes, four running maxima, a scalar tail):
    the maximum at each position of a row, a tie with a later position, a NaN at each position
    beside a larger finite maximum, +inf, and rows of -inf, each against torch.argmax."""
    torch.manual_seed(width)
    positions = list(range(width)) if width <= 300 else sorted(
        set(range(0, width, 7)) | set(range(width - 40, width)))
    rows = []
    for p in positions:
        row = torch.randn(width)
        row[p] = 50.0
        rows.append(row)
        tie = row.clone()
        tie[(p + 1 + width // 2) % width] = 50.0  # another position with the same maximum
        rows.append(tie)
        nan = torch.randn(width)
        nan[(p * 5) % width] = 99.0
        nan[p] = float("nan")
        rows.append(nan)
        inf = torch.randn(width)
        inf[p] = float("inf")
        rows.append(inf)
    rows.append(torch.full((width,), float("-inf")))
    x = torch.stack(rows)
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))
