"""dispatch_linear: the oneDNN route for float32 CPU products matches F.linear; other dtypes,
traced code and VLLM_CPU_ONEDNN_LINEAR=0 keep F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.model_executor.layers import linear


@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (2, 3, 64), (0, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(shape, with_bias):
    torch.manual_seed(0)
    w, b = torch.randn(48, 64), torch.randn(48) if with_bias else None
    x = torch.randn(*shape)
    torch.testing.assert_close(linear.dispatch_linear(x, w, b), F.linear(x, w, b),
                               atol=1e-5, rtol=1e-5)


def test_strided_input_and_bf16():
    torch.manual_seed(0)
    w = torch.randn(48, 32)
    x = torch.randn(5, 80)[:, 16:48]  # a column slice, as after a fused projection's split
    torch.testing.assert_close(linear.dispatch_linear(x, w), F.linear(x, w), atol=1e-5,
                               rtol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(linear.dispatch_linear(xb, wb), F.linear(xb, wb))


def test_routes_float32_multi_row_products_to_onednn(monkeypatch):
    if not linear._onednn_linear_enabled():
        pytest.skip("oneDNN is not available")
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __getattr__(self, name):
            assert name == "_linear_pointwise"

            def op(*args):
                calls.append(args[0].shape)
                return real(*args)
            return op

    monkeypatch.setattr(torch.ops, "mkldnn", Spy())
    w = torch.randn(16, 8)
    linear.dispatch_linear(torch.randn(4, 8), w)  # several rows: oneDNN
    linear.dispatch_linear(torch.randn(1, 8), w)  # one row, small weight: F.linear
    linear.dispatch_linear(torch.randn(4, 8).double(), w.double())  # not float32
    assert calls == [torch.Size([4, 8])]


def test_env_switch_off(monkeypatch):
    monkeypatch.setattr(linear, "_onednn_linear", None)
    monkeypatch.setenv("VLLM_CPU_ONEDNN_LINEAR", "0")
    assert not linear._onednn_linear_enabled()
    monkeypatch.setattr(linear, "_onednn_linear", None)  # re-read after the test
