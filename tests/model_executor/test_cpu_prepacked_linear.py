"""`vllm::cpu_prepacked_linear`: the oneDNN-reordered weight gives F.linear's result for every
row count, a weight changed in place (or never prepacked) falls back to the plain weight,
and the reordered copy is dropped with its parameter."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from vllm.model_executor.layers import cpu_prepacked_linear as cpl

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="needs oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 5, 16, 77])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(rows, bias):
    torch.manual_seed(rows)
    weight = torch.nn.Parameter(torch.randn(48, 32), requires_grad=False)
    b = torch.randn(48) if bias else None
    assert cpl.prepack(weight)
    x = torch.randn(rows, 32)
    out = torch.ops.vllm.cpu_prepacked_linear(x, weight, b)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_stale_or_missing_copy_falls_back_and_copies_die_with_the_weight():
    weight = torch.nn.Parameter(torch.randn(16, 8), requires_grad=False)
    x = torch.randn(8, 8)
    gc.collect()  # other tests' models and their copies
    before = cpl.num_prepacked()
    assert cpl.prepack(weight) and cpl.num_prepacked() == before + 1
    with torch.no_grad():
        weight.mul_(2)  # in place: the reordered copy is stale
    torch.testing.assert_close(torch.ops.vllm.cpu_prepacked_linear(x, weight),
                               F.linear(x, weight))
    other = torch.randn(16, 8)  # never prepacked
    torch.testing.assert_close(torch.ops.vllm.cpu_prepacked_linear(x, other), F.linear(x, other))
    del weight
    gc.collect()
    assert cpl.num_prepacked() == before


def test_not_eligible():
    assert not cpl.prepack(torch.randn(4, 4, dtype=torch.bfloat16))
    assert not cpl.prepack(torch.randn(4, 4).t())  # not contiguous


def test_traced_by_the_compiler():
    weight = torch.nn.Parameter(torch.randn(24, 16), requires_grad=False)
    cpl.prepack(weight)

    def f(x):
        return torch.ops.vllm.cpu_prepacked_linear(x.relu(), weight).sum(-1)

    x = torch.randn(9, 16)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x), F.linear(x.relu(), weight).sum(-1))
