"""Adding a graph pass is one registry entry (PassConfig flag, order, class): the pass
manager builds and runs it in its place, the config's start-up line lists it there, and the
manager's uuid (part of the compile cache's key) changes with it."""
from __future__ import annotations

import logging

import torch
import torch.fx as fx

from vllm.compilation.passes import registry
from vllm.compilation.passes.inductor_pass import VllmInductorPass
from vllm.compilation.passes.pass_manager import PostGradPassManager, has_pass
from vllm.config import CompilationConfig, PassConfig, VllmConfig

# An upstream flag this engine has no pass for: the dummy entry gives it one.
FLAG = "enable_qk_norm_rope_fusion"


class DummyPass(VllmInductorPass):
    """Counts the graphs it saw; rewrites nothing."""

    seen = 0

    def apply(self, graph: fx.Graph) -> int:
        DummyPass.seen += 1
        return 1


def config() -> VllmConfig:
    flags = dict.fromkeys(("fuse_norm_quant", "fuse_act_quant", "fuse_attn_quant"), False)
    return VllmConfig(optimization_level=2, compilation_config=CompilationConfig(
        backend="eager", pass_config=PassConfig(eliminate_noops=True, **{FLAG: True}, **flags)))


def with_dummy(monkeypatch, order: int) -> None:
    entries = [e for e in registry.PASS_REGISTRY if e.flag != FLAG]
    monkeypatch.setattr(registry, "PASS_REGISTRY",
                        [*entries, registry.PassEntry(FLAG, order, f"{__name__}:DummyPass")])


def graph() -> fx.Graph:
    return fx.symbolic_trace(lambda x: torch.relu(x) + 1).graph


def test_one_entry_is_enough(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="vllm")
    vllm_config = config()
    before = PostGradPassManager().configure(vllm_config)
    assert "has no pass for it yet" in caplog.text  # the flag alone fuses nothing
    assert [p.name for p in before.passes] == ["NoOpEliminationPass"]

    with_dummy(monkeypatch, order=5)  # before no-op elimination (10)
    caplog.clear()
    manager = PostGradPassManager().configure(vllm_config)
    assert has_pass(FLAG)
    assert "has no pass" not in caplog.text
    assert "Enabled fusions: enable_qk_norm_rope_fusion" in caplog.text
    assert [p.name for p in manager.all_passes()] == [
        "DummyPass", "NoOpEliminationPass", "PostCleanupPass", "FixFunctionalizationPass"]
    DummyPass.seen = 0
    manager(graph())
    assert DummyPass.seen == 1 and manager.match_counts()["DummyPass"] == 1
    assert manager.uuid() != before.uuid()  # the compile cache's key sees the new pass
    assert "passes: enable_qk_norm_rope_fusion, eliminate_noops," in vllm_config.summary_line()


def test_order_decides_the_place(monkeypatch):
    with_dummy(monkeypatch, order=15)
    vllm_config = config()
    manager = PostGradPassManager().configure(vllm_config)
    assert [p.name for p in manager.passes] == ["NoOpEliminationPass", "DummyPass"]
    assert vllm_config.compilation_config.pass_config.enabled_passes() == [
        "eliminate_noops", FLAG]


def test_every_entry_names_a_pass_config_flag_and_an_importable_class():
    import dataclasses
    import importlib

    fields = {f.name for f in dataclasses.fields(PassConfig)}
    flags = [e.flag for e in registry.PASS_REGISTRY]
    assert len(flags) == len(set(flags)) and set(flags) <= fields
    assert len({e.order for e in registry.PASS_REGISTRY}) == len(flags)
    for entry in registry.PASS_REGISTRY:
        if entry.pass_class is not None:
            module, cls = entry.pass_class.split(":")
            assert issubclass(getattr(importlib.import_module(module), cls), VllmInductorPass)
