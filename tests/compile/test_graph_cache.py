"""The traced graph in the compile cache (graph_cache.py): the runner that replaces Dynamo on a
warm start (sources, guards, weights resolved once), and warm starts of a toy model in one
process (Inductor; slow): a second instance loads the graph instead of tracing (its static
compile sizes from the cache too), follows a replaced weight, falls back to Dynamo for
another input dtype, and never looks with VLLM_DISABLE_COMPILE_CACHE=1."""
from __future__ import annotations

import inspect
import logging

import pytest
import torch
from torch import nn

from vllm.compilation.counter import compilation_counter
from vllm.compilation.decorators import support_torch_compile
from vllm.compilation.graph_cache import (
    CachedGraphRunner,
    GraphCacheMiss,
    GuardMismatch,
)
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config


# ---- the runner, on a hand-made record ------------------------------------------------------
class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, input_ids: torch.Tensor, scale: float = 2.0, extra=None):
        raise AssertionError("not called: the runner calls the graph")


RECORD = {
    "self": "self",
    "args": [["input_ids", "tensor", "int64", 1], ["scale", "const", 2.0],
             ["extra", "const", None]],
    "sources": ["L['self']._modules['lin']._parameters['weight']", "L['input_ids'].size()[0]",
                "L['input_ids']"],
    "kinds": ["tensor", "int", "tensor"],
    "output": ["tuple", [["graph", 1], ["none"]]],
    "stable_meta": [["float32", [4, 4], "cpu"]],
}


def make_runner() -> tuple[Plain, CachedGraphRunner, list]:
    model = Plain()
    calls = []

    def graph(weight, n, ids):
        calls.append((weight, n, ids))
        return (weight.sum(), ids * n)

    runner = CachedGraphRunner(model, inspect.signature(Plain.forward), RECORD, globals())
    runner.forward = graph
    ids = torch.arange(3)
    locals_ = runner.locals_for((ids,), {})
    assert runner.guard(locals_)
    runner.resolve(locals_)
    runner.build(locals_)
    return model, runner, calls


def test_runner_evaluates_sources_per_call_and_weights_once():
    model, runner, calls = make_runner()
    out, none = runner((torch.arange(5),), {})
    assert none is None and out.tolist() == [0, 5, 10, 15, 20]
    weight, n, ids = calls[-1]
    assert weight is model.lin.weight and n == 5 and isinstance(n, int)
    # Keyword and defaulted arguments bind like the forward's signature.
    out, _ = runner((), {"input_ids": torch.arange(2), "scale": 2.0})
    assert out.tolist() == [0, 2]
    # A replaced weight is picked up (resolved again), not the stale object.
    model.lin.weight = nn.Parameter(torch.ones(4, 4))
    runner((torch.arange(1),), {})
    assert calls[-1][0] is model.lin.weight
    # One of another shape: the compiled pieces do not serve it (Dynamo would recompile).
    model.lin.weight = nn.Parameter(torch.ones(2, 4))
    with pytest.raises(GuardMismatch, match=r"\[2, 4\].*compiled for \['float32', \[4, 4\]"):
        runner((torch.arange(1),), {})


def test_runner_binds_arguments_as_the_signature_does():
    """The runner's own binding (no inspect.bind per call) gives the same locals as binding
    the forward's signature, defaults filled; calls the signature rejects still raise its
    TypeError."""
    model, runner, _ = make_runner()
    sig = inspect.signature(Plain.forward)
    ids = torch.arange(3)
    for args, kwargs in [((ids,), {}), ((ids, 3.0), {}), ((ids,), {"extra": 1}),
                         ((), {"input_ids": ids, "scale": 1.0}), ((ids, 1.0, None), {}),
                         ((), {"extra": 2, "input_ids": ids})]:
        bound = sig.bind(model, *args, **kwargs)
        bound.apply_defaults()
        assert runner.locals_for(args, kwargs) == dict(bound.arguments), (args, kwargs)
    for args, kwargs in [((), {}), ((ids, 1.0, None, 4), {}), ((ids,), {"input_ids": ids}),
                         ((ids,), {"other": 1})]:
        with pytest.raises(TypeError):
            runner.locals_for(args, kwargs)


def test_runner_guards_dtype_dim_and_constants():
    _, runner, _ = make_runner()
    with pytest.raises(GuardMismatch, match="int32 dim 1, saved int64 dim 1"):
        runner((torch.arange(3, dtype=torch.int32),), {})
    with pytest.raises(GuardMismatch, match="dim 2"):
        runner((torch.zeros(2, 3, dtype=torch.int64),), {})
    with pytest.raises(GuardMismatch, match="scale: 3.0, saved 2.0"):
        runner((torch.arange(3), 3.0), {})
    with pytest.raises(GuardMismatch, match="extra"):
        runner((torch.arange(3), 2.0, torch.zeros(1)), {})


def test_sources_that_do_not_evaluate_are_a_miss():
    record = dict(RECORD, sources=["L['self']._modules['gone']._parameters['weight']"],
                  kinds=["tensor"])
    runner = CachedGraphRunner(Plain(), inspect.signature(Plain.forward), record, globals())
    locals_ = runner.locals_for((torch.arange(3),), {})
    with pytest.raises(GraphCacheMiss, match="does not evaluate"):
        runner.resolve(locals_)
    record = dict(RECORD, sources=["L['input_ids'].size()[0]"], kinds=["tensor"])
    runner = CachedGraphRunner(Plain(), inspect.signature(Plain.forward), record, globals())
    with pytest.raises(GraphCacheMiss, match="graph takes a tensor"):
        runner.build(locals_)


# ---- warm starts of a toy model in one process (Inductor) -----------------------------------
SILLY_OP = "silly_graph_cache::attention"


@torch.library.custom_op(SILLY_OP, mutates_args=["out"])
def silly_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(q * 2 + k - v)


@support_torch_compile
class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + positions.unsqueeze(-1).to(torch.float32)
        for layer in self.layers:
            out = torch.empty_like(x)
            torch.ops.silly_graph_cache.attention(x, x, x, out)
            x = layer(out).relu()
        return x


def build() -> Toy:
    config = VllmConfig(optimization_level=1, compilation_config=CompilationConfig(
        backend="inductor", splitting_ops=[SILLY_OP], compile_sizes=[4]))
    torch.manual_seed(0)
    with set_current_vllm_config(config):
        return Toy()


def check(model: Toy, n: int, positions_dtype: torch.dtype = torch.int64) -> None:
    ids, pos = torch.randint(0, 32, (n,)), torch.arange(n, dtype=positions_dtype)
    expected = model._vllm_compile_state.original_forward(model, ids, pos)
    torch.testing.assert_close(model(ids, pos), expected)


@pytest.mark.slow
def test_second_instance_loads_the_graph_instead_of_tracing(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("VLLM_TEST_FAIL_ON_RECOMPILE", "1")
    caplog.set_level(logging.INFO, logger="vllm")
    with torch.no_grad():
        # 3 pieces, each compiled for the token range and for the compile size 4.
        with compilation_counter.expect(num_graphs_seen=1, num_graphs_saved=1,
                                        num_graphs_loaded=0, num_inductor_compiles=6):
            cold = build()
            check(cold, 5)
            check(cold, 4)
        warm = build()
        # ... and every piece (range and size 4) without Inductor (inductor_light.py).
        with compilation_counter.expect(num_graphs_seen=0, num_graphs_loaded=1,
                                        num_inductor_compiles=0, num_cache_hits=6,
                                        num_light_loads=6):
            for n in (5, 1, 4, 9):
                check(warm, n)
        assert warm._vllm_compile_state.cached_graph is not None
        # A weight replaced by a new Parameter: followed, still without Dynamo.
        warm.layers[1].weight = nn.Parameter(torch.randn(8, 8))
        with compilation_counter.expect(num_graphs_seen=0):
            check(warm, 4)
        # Another dtype for an argument: Dynamo's guards would not have held either; this
        # instance traces (a warning), and keeps serving that dtype.
        with compilation_counter.expect(num_graphs_seen=1, num_graphs_loaded=0):
            check(warm, 3, torch.int32)
            check(warm, 6, torch.int32)
        assert "does not serve (positions: int32 dim 1, saved int64 dim 1)" in caplog.text
        assert warm._vllm_compile_state.cached_graph is None

        # With the cache off the graph is never looked at.
        monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
        caplog.clear()
        with compilation_counter.expect(num_graphs_seen=1, num_graphs_loaded=0,
                                        num_graphs_saved=0):
            check(build(), 5)
        assert "traced graph not used" not in caplog.text
        assert "compile cache: disabled" in caplog.text


@pytest.mark.slow
def test_a_warm_start_builds_a_piece_graph_only_to_compile_a_new_size(monkeypatch, tmp_path):
    """The pieces' graphs are pickled apart and unpickled (FX re-traces them) only when one
    is compiled again: not to load the compile size 4 the cold instance compiled at its first
    forward; here, once that entry is gone from the cache."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    with torch.no_grad():
        with compilation_counter.expect(num_inductor_compiles=6):
            check(build(), 5)  # the token range and the size 4, each of the 3 pieces
        for run in ("load", "compile"):
            warm = build()
            with compilation_counter.expect(num_graphs_loaded=1, num_graphs_seen=0):
                check(warm, 5)
            pieces = warm._vllm_compile_state.vllm_backend.piece_backends
            assert len(pieces) == 3 and all(p._gm is None for p in pieces)
            compiles = 3 if run == "compile" else 0
            with compilation_counter.expect(num_graphs_seen=0, num_inductor_compiles=compiles):
                check(warm, 4)
            assert all((p._gm is not None) == (run == "compile") for p in pieces)
            for entry in tmp_path.rglob("*size_4*"):  # the next start misses size 4
                if entry.is_file():
                    entry.unlink()


# ---- after the first trace: the runner serves the calls, not Dynamo ---------------------------
def test_after_the_first_trace_calls_skip_dynamo(monkeypatch, caplog):
    """With the cache off too: once traced, the calls go through the runner (Dynamo's guard
    checks cost ~130 us a step on the demo model); a call it does not serve goes back to
    Dynamo for good."""
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    caplog.set_level(logging.INFO, logger="vllm")
    config = VllmConfig(optimization_level=1, compilation_config=CompilationConfig(
        backend="eager", splitting_ops=[SILLY_OP]))
    torch.manual_seed(0)
    with set_current_vllm_config(config):
        model = Toy()
    state = model._vllm_compile_state
    with torch.no_grad():
        with compilation_counter.expect(num_graphs_seen=1, num_graphs_saved=0):
            check(model, 5)
        assert state.cached_graph is not None
        dynamo_calls = []
        traced = state.compiled

        def through_dynamo(*args, **kwargs):
            dynamo_calls.append(args)
            return traced(*args, **kwargs)

        state.compiled = through_dynamo
        for n in (1, 7, 3):
            check(model, n)
        assert dynamo_calls == []
        # Another dtype: Dynamo serves it (a recompile, as its guards would have had it), and
        # every later call.
        with compilation_counter.expect(num_graphs_seen=1):
            check(model, 3, torch.int32)
        assert "the compiled graph does not serve (positions: int32" in caplog.text
        assert state.cached_graph is None
        check(model, 2, torch.int32)
        assert len(dynamo_calls) == 2
