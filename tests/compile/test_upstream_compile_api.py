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
