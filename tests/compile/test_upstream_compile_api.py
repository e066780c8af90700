"""Upstream's compile API, in our words: passes at upstream's module paths, InductorPass /
CallableInductorPass, the pass manager's uuid, and the small torch/math helpers."""
from __future__ import annotations

import copy
import importlib

import pytest
import torch

from vllm.compilation.passes.inductor_pass import (
    CallableInductorPass,
    InductorPass,
    get_pass_context,
    pass_context,
)
from vllm.compilation.passes.pass_manager import PostGradPassManager
from vllm.config import CompilationConfig, CompilationMode, PassConfig, VllmConfig
from vllm.config.utils import Range


def _noop(graph: torch.fx.Graph) -> None:
    pass


class _Proper(InductorPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        pass


@pytest.mark.parametrize("module, name", [
    ("vllm.compilation.passes.utility.noop_elimination", "NoOpEliminationPass"),
    ("vllm.compilation.passes.utility.fix_functionalization", "FixFunctionalizationPass"),
    ("vllm.compilation.passes.utility.post_cleanup", "PostCleanupPass"),
    ("vllm.compilation.passes.fusion.rms_quant_fusion", "RMSNormQuantFusionPass"),
    ("vllm.compilation.passes.fusion.act_quant_fusion", "ActivationQuantFusionPass"),
    ("vllm.compilation.passes.fusion.attn_quant_fusion", "AttnQuantFusionPass"),
])
def test_passes_at_upstreams_paths_take_the_config(module, name):
    config = VllmConfig()
    graph_pass = getattr(importlib.import_module(module), name)(config)
    assert isinstance(graph_pass, InductorPass)
    assert len(graph_pass.uuid()) == 64


def test_pass_keeps_the_compilation_config_and_deep_copies():
    config = VllmConfig()
    from vllm.compilation.passes.utility.fix_functionalization import FixFunctionalizationPass

    copied = copy.deepcopy(FixFunctionalizationPass(config))
    assert copied.compilation_config.splitting_ops == config.compilation_config.splitting_ops


def test_pass_context_takes_the_range_positionally():
    with pass_context(Range(start=1, end=8)):
        assert get_pass_context().compile_range == Range(1, 8)
    assert get_pass_context().compile_range is None


def test_manager_refuses_a_plain_callable():
    manager = PostGradPassManager().configure(VllmConfig())
    with pytest.raises(AssertionError, match="CallableInductorPass"):
        manager.add(_noop)
    with pytest.raises(TypeError):
        manager.add(_noop)


@pytest.mark.parametrize("make", [
    _Proper, lambda: CallableInductorPass(_noop),
    lambda: CallableInductorPass(_noop, InductorPass.hash_source(__file__)),
])
def test_manager_uuid(make):
    graph_pass = make()
    config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE))
    with pass_context(Range(start=1, end=8)):
        manager = PostGradPassManager().configure(config)
        manager.add(graph_pass)
        first = manager.uuid()
        manager.add(graph_pass)
        assert manager.uuid() != first  # the same pass twice is a different pipeline
        again = PostGradPassManager().configure(config)
        again.add(graph_pass)
        assert again.uuid() == first
        flipped = copy.deepcopy(config)
        pc = flipped.compilation_config.pass_config
        pc.fuse_norm_quant = not pc.fuse_norm_quant
        other = PostGradPassManager().configure(flipped)
        other.add(graph_pass)
        assert other.uuid() != first
    with pass_context(Range(start=9, end=64)):
        assert again.uuid() != first  # the compile range is part of it


def test_hash_helpers():
    assert InductorPass.hash_dict({"a": 1, "b": 2}) == InductorPass.hash_dict({"b": 2, "a": 1})
    assert InductorPass.hash_source(__file__) != InductorPass.hash_source("some text")
    assert CallableInductorPass(_noop, "fixed").uuid() == "fixed"


def test_noop_elimination_built_as_upstream_leaves_no_dead_nodes():
    """NoOpEliminationPass(vllm_config) on its own: the no-op reshape and slice go, and no
    node is left without users."""
    from vllm.compilation.passes.utility.noop_elimination import NoOpEliminationPass

    def f(x):
        y = x.reshape(-1, 4).reshape(-1, 8)  # chain: one reshape stays
        z = y.reshape(-1, 8)  # no-op
        return z[0:z.shape[0]] * 2  # no-op slice

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, pre_dispatch=False)(torch.randn(4, 8))
    config = VllmConfig(compilation_config=CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, pass_config=PassConfig(eliminate_noops=True)))
    NoOpEliminationPass(config)(gm.graph)
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.slice.Tensor) == 0
    assert all(n.users for n in gm.graph.nodes if n.op == "call_function")
    x = torch.randn(4, 8)
    torch.testing.assert_close(gm(x), f(x))


def test_torch_and_math_utils():
    from vllm.utils.math_utils import cdiv, next_power_of_2, round_down, round_up
    from vllm.utils.torch_utils import _is_torch_equal_or_newer, is_torch_equal_or_newer

    assert _is_torch_equal_or_newer("2.8.0.dev20250624+cu128", "2.8.0.dev")
    assert _is_torch_equal_or_newer("2.8.0a0+gitc82a174", "2.8.0.dev")
    assert _is_torch_equal_or_newer("2.8.1", "2.8.0.dev")
    assert not _is_torch_equal_or_newer("2.7.1", "2.8.0.dev")
    assert not _is_torch_equal_or_newer("2.8.0", "2.8.1")
    assert is_torch_equal_or_newer("1.0")
    assert (cdiv(7, 2), cdiv(8, 2), round_up(5, 4), round_down(5, 4)) == (4, 4, 8, 4)
    assert [next_power_of_2(n) for n in (0, 1, 3, 8, 9)] == [1, 1, 4, 8, 16]


# ---- partition_rules.should_split ------------------------------------------------------------
@torch.library.custom_op("silly_upstream_api::attention", mutates_args=["out"])
def _silly_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
                     ) -> None:
    out.copy_(q + k + v)


@_silly_attention.register_fake
def _(q, k, v, out):
    return None


def _call(target, args=()) -> torch.fx.Node:
    return torch.fx.Node(torch.fx.Graph(), "n", "call_function", target, args, {})


def test_should_split_matches_ops_and_overloads():
    from vllm.compilation.partition_rules import should_split

    add = _call(torch.ops.aten.add.default)
    assert should_split(add, ["aten::add"]) and should_split(add, ["aten::add.default"])
    assert not should_split(add, ["aten::add.Tensor"]) and not should_split(add, [])
    t = (torch.ones(1),) * 4
    packet = _call(torch.ops.silly_upstream_api.attention, t)
    overload = _call(torch.ops.silly_upstream_api.attention.default, t)
    assert should_split(packet, ["silly_upstream_api::attention"])
    assert should_split(overload, ["silly_upstream_api::attention"])
    assert should_split(overload, ["silly_upstream_api::attention.default"])
    placeholder = torch.fx.Node(torch.fx.Graph(), "x", "placeholder", "x", (), {})
    assert not should_split(placeholder, ["aten::add"])


def test_split_graph_splits_where_should_split_says():
    from vllm.compilation.partition_rules import should_split
    from vllm.compilation.split import split_graph

    def f(x):
        out = torch.empty_like(x)
        torch.ops.silly_upstream_api.attention(x, x, x, out)
        return out * 2 + x

    gm = torch.fx.symbolic_trace(f)
    ops = ["silly_upstream_api::attention"]
    assert sum(should_split(n, ops) for n in gm.graph.nodes) == 1
    _, items = split_graph(gm, ops)
    assert [item.is_splitting for item in items] == [False, True, False]


# ---- a user's graph pass (inductor_compile_config["post_grad_custom_post_pass"]) -------------
class _RangeRecorder(InductorPass):
    """Records the compile range and whether the graph's shapes are static, per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Range, bool]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch.fx.experimental.symbolic_shapes import is_symbolic

        symbolic = any(
            isinstance(v, torch.Tensor) and any(is_symbolic(d) for d in v.shape)
            for v in (n.meta.get("val") for n in graph.nodes))
        self.calls.append((get_pass_context().compile_range, not symbolic))

    def uuid(self) -> str:
        return InductorPass.hash_dict({"recorder": 1})


def test_user_pass_runs_after_ours_in_the_manager():
    user = _RangeRecorder()
    config = VllmConfig(compilation_config=CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, pass_config=PassConfig(eliminate_noops=True),
        inductor_compile_config={"post_grad_custom_post_pass": user}))
    manager = PostGradPassManager().configure(config)
    names = [p.name for p in manager.all_passes()]
    assert names == ["NoOpEliminationPass", "_RangeRecorder", "PostCleanupPass",
                     "FixFunctionalizationPass"]
    with pass_context(Range(1, 8)):
        without = PostGradPassManager().configure(VllmConfig(compilation_config=CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, pass_config=PassConfig(eliminate_noops=True))))
        assert manager.uuid() != without.uuid()  # the user's pass is in the cache key
        manager(torch.fx.Graph())
    assert user.calls == [(Range(1, 8), True)]


def test_user_pass_alone_for_torchs_own_backend():
    from vllm.compilation.compiler_interface import inductor_config_patches

    user = _RangeRecorder()
    config = VllmConfig(compilation_config=CompilationConfig(
        mode=CompilationMode.STOCK_TORCH_COMPILE,
        inductor_compile_config={"post_grad_custom_post_pass": user}))
    wrapped = inductor_config_patches(config, None)["post_grad_custom_post_pass"]
    from torch._inductor.custom_graph_pass import CustomGraphPass

    assert isinstance(wrapped, CustomGraphPass) and wrapped.uuid() == user.uuid()


# ---- compile sizes compiled at start-up ------------------------------------------------------
class _Model(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + x
        out = torch.empty_like(x)
        torch.ops.silly_upstream_api.attention(x, x, x, out)
        return out * 3


def _compiled(backend: str, user: InductorPass, endpoints: list[int], sizes: list[int]):
    from vllm.compilation.decorators import support_torch_compile
    from vllm.config import SchedulerConfig, set_current_vllm_config

    config = VllmConfig(
        scheduler_config=SchedulerConfig(max_num_batched_tokens=8192, max_model_len=8192),
        compilation_config=CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, backend=backend,
            compile_ranges_endpoints=endpoints, compile_sizes=sizes,
            inductor_compile_config={"post_grad_custom_post_pass": user}))
    cls = support_torch_compile(type("UpstreamApiModel", (_Model,), {}))
    with set_current_vllm_config(config):
        return config, cls().eval()


def _run(config, model, batch_sizes):
    from vllm.forward_context import set_forward_context

    with torch.inference_mode(), set_forward_context({}, vllm_config=config):
        for n in batch_sizes:
            x = torch.randn(n, 16)
            torch.testing.assert_close(model(x), (x + x) * 3 * 3)


@pytest.fixture
def _no_compile_cache(monkeypatch):
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_sizes_are_compiled_at_start_up(_no_compile_cache):
    """Endpoints [8, 32] and sizes [16, 64, 128]: 3 ranges + 3 static sizes = 6 compiles at the
    first forward, 128 included though no batch of 128 ever runs; later batches compile
    nothing."""
    from vllm.compilation.counter import compilation_counter

    user = _RangeRecorder()
    config, model = _compiled("eager", user, [8, 32], [16, 64, 128])
    with compilation_counter.expect(num_graphs_seen=1, num_piecewise_graphs_seen=1,
                                    num_backend_compilations=6):
        _run(config, model, [64])
    with compilation_counter.expect(num_backend_compilations=0):
        _run(config, model, [1, 4, 16, 24, 48, 8192])
    assert sorted((r.start, r.end, static) for r, static in user.calls) == [
        (1, 8, False), (9, 32, False), (16, 16, True), (33, 8192, False), (64, 64, True),
        (128, 128, True)]


@pytest.mark.slow
def test_compile_sizes_are_static_inductor_compiles(_no_compile_cache):
    from vllm.compilation.counter import compilation_counter

    user = _RangeRecorder()
    config, model = _compiled("inductor", user, [8], [16])
    with compilation_counter.expect(num_backend_compilations=3, num_inductor_compiles=3):
        _run(config, model, [1])
    with compilation_counter.expect(num_backend_compilations=0):
        _run(config, model, [16, 64])
    assert sorted((r.start, r.end, static) for r, static in user.calls) == [
        (1, 8, False), (9, 8192, False), (16, 16, True)]


def test_concrete_inputs_of_a_static_compile():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from vllm.compilation.piecewise_backend import concrete_inputs

    captured = {}

    def backend(gm, example_inputs):
        captured["values"] = [n.meta["example_value"] for n in gm.graph.nodes
                              if n.op == "placeholder"]
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda x, y: (x.reshape(-1) * 2, y.t()), backend=backend)
    x = torch.randn(6, 3)
    torch._dynamo.mark_dynamic(x, 0)
    fn(x, torch.randn(3, 5).t())  # y: not contiguous
    torch._dynamo.reset()
    values = captured["values"]
    assert isinstance(values[0], torch.SymInt)
    size, xs, ys = concrete_inputs(values, 16)
    assert size == 16 and isinstance(xs, FakeTensor) and isinstance(ys, FakeTensor)
    assert (tuple(xs.shape), xs.stride()) == ((16, 3), (3, 1))
    assert (tuple(ys.shape), ys.stride()) == ((5, 3), (1, 5))  # strides kept
    assert xs.fake_mode is not values[1].fake_mode  # no shape environment: all static
    # An input without a strided layout cannot be rebuilt: compiled from real inputs later.
    sparse = FakeTensorMode().from_tensor(torch.randn(4, 4).to_sparse())
    assert concrete_inputs([sparse], 4) is None
