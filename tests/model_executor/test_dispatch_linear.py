"""dispatch_linear: the oneDNN route (float32) and the small-M C++ kernel (float32 and
bfloat16, a few rows) match F.linear; other dtypes, traced code and the environment switches
keep F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.model_executor.layers import cpu_linear


@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (7, 64), (2, 3, 64), (0, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear_float32(shape, with_bias):
    torch.manual_seed(0)
    w, b = torch.randn(48, 64), torch.randn(48) if with_bias else None
    x = torch.randn(*shape)
    torch.testing.assert_close(cpu_linear.dispatch_linear(x, w, b), F.linear(x, w, b),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_linear.small_m_linear_available(),
                    reason="the small-M linear kernel could not be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16])
@pytest.mark.parametrize("n,k", [(37, 100), (130, 64), (1000, 33), (70, 1500)])
def test_small_m_kernel(dtype, rows, n, k):
    """Odd sizes: N not a multiple of the 4-row tile, K not a multiple of 16 lanes, several
    row groups of x; strided rows of x."""
    torch.manual_seed(rows)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype)
    x = torch.randn(rows, k + 7).to(dtype)[:, 3:k + 3]
    got = cpu_linear.small_m_linear(x, w, b)
    want = (x.float() @ w.float().t() + b.float()).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # float32 sums of up to 1500 products
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(cpu_linear.small_m_linear(x, w).float(),
                               (x.float() @ w.float().t()).to(dtype).float(), atol=tol, rtol=tol)


def test_bfloat16_dispatch_matches_f_linear():
    torch.manual_seed(0)
    w, b = torch.randn(96, 80).bfloat16(), torch.randn(96).bfloat16()
    for rows in (1, 3, 8):
        x = torch.randn(rows, 80).bfloat16()
        torch.testing.assert_close(cpu_linear.dispatch_linear(x, w, b).float(),
                                   F.linear(x, w, b).float(), atol=2e-2, rtol=2e-2)


def test_routes(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_linear, "small_m_linear_available", lambda: True)

    def small(x, w, b=None):
        calls.append(("small", x.shape[0]))
        return F.linear(x, w, b)

    monkeypatch.setattr(cpu_linear, "small_m_linear", small)
    monkeypatch.setattr(cpu_linear, "onednn_linear_enabled", lambda: True)
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __getattr__(self, name):
            assert name == "_linear_pointwise"

            def op(x, *args):
                calls.append(("onednn", x.shape[0]))
                return real(x, *args)
            return op

    monkeypatch.setattr(torch.ops, "mkldnn", Spy())
    w = torch.randn(16, 8)
    monkeypatch.setattr(cpu_linear, "_max_rows_cache", {torch.bfloat16: 4})
    cpu_linear.dispatch_linear(torch.randn(4, 8), w)  # float32, 4 rows: small-M kernel
    cpu_linear.dispatch_linear(torch.randn(5, 8), w)  # float32, 5 rows: oneDNN
    cpu_linear.dispatch_linear(torch.randn(4, 8).bfloat16(), w.bfloat16())  # small-M
    cpu_linear.dispatch_linear(torch.randn(5, 8).bfloat16(), w.bfloat16())  # F.linear
    cpu_linear.dispatch_linear(torch.randn(4, 8).double(), w.double())  # F.linear
    assert calls == [("small", 4), ("onednn", 5), ("small", 4)]


def test_env_switch_off(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_onednn", None)
    monkeypatch.setenv("VLLM_CPU_ONEDNN_LINEAR", "0")
    assert not cpu_linear.onednn_linear_enabled()
    monkeypatch.setattr(cpu_linear, "_onednn", None)  # re-read after the test
