"""NoOpEliminationPass on ATen graphs with a symbolic token dimension."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from vllm.compilation.passes.utility.noop_elimination import NoOpEliminationPass
from vllm.compilation.passes.utility.post_cleanup import PostCleanupPass

aten = torch.ops.aten


def _trace(fn, *inputs):
    return make_fx(fn, tracing_mode="symbolic")(*inputs)


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def _run(gm):
    noop = NoOpEliminationPass()
    noop(gm.graph)
    PostCleanupPass()(gm.graph)
    gm.recompile()
    return noop


def test_removes_redundant_reshapes_and_full_slices_keeps_end_minus_one():
    def fn(x):
        n = x.shape[0]
        a = x.reshape(n, 16)                     # same shape: no-op
        b = a.reshape(n, 4, 4).reshape(n, 16)    # chain back to the same shape: no-op
        c = b[0:n]                               # full extent (symbolic end): no-op
        d = c[:, :-1]                            # drops the last column: kept
        e = c[:n + 0, 0:16]                      # full extent again: no-op
        return d.reshape(n, 5, 3), e

    x = torch.randn(6, 16)
    gm = _trace(fn, x)
    expected = fn(x)
    slices_before = _count(gm, aten.slice.Tensor)
    assert slices_before >= 2
    noop = _run(gm)
    assert noop.matched_count > 0
    # One reshape remains (the one that changes the shape) and one slice (the end=-1 one).
    assert _count(gm, aten.view.default) + _count(gm, aten.reshape.default) == 1
    assert _count(gm, aten.slice.Tensor) == 1
    kept = next(n for n in gm.graph.nodes if n.target == aten.slice.Tensor)
    assert kept.args[3] == -1
    for size in (6, 3, 1):
        x = torch.randn(size, 16)
        for got, want in zip(gm(x), fn(x)):
            torch.testing.assert_close(got, want)
    del expected


def test_full_slice_scatter_becomes_its_source():
    def fn(base, src):
        full = torch.slice_scatter(base, src * 2, 1)  # default end: the whole dimension
        partial = torch.slice_scatter(base, src[:, :4], 1, 0, 4)
        return full, partial

    gm = _trace(fn, torch.zeros(5, 8), torch.randn(5, 8))
    assert _count(gm, aten.slice_scatter.default) == 2
    _run(gm)
    assert _count(gm, aten.slice_scatter.default) == 1  # the partial one stays
    base, src = torch.zeros(3, 8), torch.randn(3, 8)
    for got, want in zip(gm(base, src), fn(base, src)):
        torch.testing.assert_close(got, want)


def test_nothing_to_do_reports_zero_and_keeps_graph():
    def fn(x):
        return x.reshape(-1, 2, 4).sum(1).narrow(1, 0, 3)

    gm = _trace(fn, torch.randn(4, 8))
    code = gm.code
    noop = _run(gm)
    assert noop.matched_count == 0
    assert gm.code == code


def test_uuid_is_stable_and_tracks_source():
    assert NoOpEliminationPass().uuid() == NoOpEliminationPass().uuid()
    assert NoOpEliminationPass().uuid() != PostCleanupPass().uuid()
