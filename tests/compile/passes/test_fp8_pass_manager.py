"""The FP8 fusion passes in the pass manager: order, flags, uuid, start-up and match-count
logs, the warning for an enabled fusion that matched nothing on an FP8 model."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tests.config import model_configs
from vllm.compilation.passes import pass_manager as pm
from vllm.compilation.passes.fusion import matcher_utils as mu
from vllm.config import CompilationConfig, PassConfig, VllmConfig

ALL = {"eliminate_noops": True, "fuse_norm_quant": True, "fuse_act_quant": True,
       "fuse_attn_quant": True}


def config(model=None, **flags) -> VllmConfig:
    """-O2 with exactly the given passes on (every other pass flag explicitly off)."""
    flags = dict.fromkeys(ALL, False) | flags
    return VllmConfig(model_config=model, optimization_level=2,
                      compilation_config=CompilationConfig(backend="eager",
                                                           pass_config=PassConfig(**flags)))


def manager(vllm_config: VllmConfig) -> pm.PostGradPassManager:
    return pm.PostGradPassManager().configure(vllm_config)


def test_registry_order_is_upstreams():
    from vllm.compilation.passes.registry import registered_passes

    flags = [e.flag for e in registered_passes() if e.pass_class is not None]
    assert flags == ["eliminate_noops", "fuse_allreduce_rms", "fuse_norm_quant",
                     "fuse_act_quant", "fuse_attn_quant"]
    names = [p.name for p in manager(config(model_configs.fp8("static"), **ALL,
                                            fuse_allreduce_rms=True)).all_passes()]
    assert names == ["NoOpEliminationPass", "AllReduceFusionPass", "RMSNormQuantFusionPass",
                     "ActivationQuantFusionPass", "AttnQuantFusionPass", "PostCleanupPass",
                     "FixFunctionalizationPass"]


def test_levels_enable_the_fusions_for_fp8_models():
    static = manager(VllmConfig(model_config=model_configs.fp8("static"), optimization_level=2))
    assert {p.name for p in static.passes} >= {"RMSNormQuantFusionPass",
                                              "ActivationQuantFusionPass"}
    dense = manager(VllmConfig(model_config=model_configs.dense(), optimization_level=2))
    assert [p.name for p in dense.passes] == ["NoOpEliminationPass"]


def test_uuid_follows_flags_and_sources(monkeypatch):
    model = model_configs.fp8("dynamic")
    a = manager(config(model, eliminate_noops=True, fuse_norm_quant=True)).uuid()
    assert a == manager(config(model, eliminate_noops=True, fuse_norm_quant=True)).uuid()
    assert a != manager(config(model, eliminate_noops=True, fuse_norm_quant=True,
                               fuse_act_quant=True)).uuid()
    assert a != manager(config(model, eliminate_noops=True, fuse_norm_quant=False)).uuid()
    # The source the patterns are traced from is part of each fusion pass's uuid.
    monkeypatch.setattr(mu, "dependency_hash", lambda: "edited")
    assert a != manager(config(model, eliminate_noops=True, fuse_norm_quant=True)).uuid()


def test_patterns_follow_the_models_scheme(cpu_platform):  # auto dtype float32 anywhere
    static = manager(config(model_configs.fp8("static"), fuse_norm_quant=True)).passes[0]
    dynamic = manager(config(model_configs.fp8("dynamic"), fuse_norm_quant=True)).passes[0]
    assert static.schemes == [mu.STATIC] and dynamic.schemes == [mu.PER_TOKEN]
    group = manager(config(model_configs.compressed_tensors_fp8(True),
                           fuse_act_quant=True)).passes[0]
    assert group.schemes == [mu.PER_TOKEN]
    assert all("float32" in name and "aten" in name for name in static.patterns.registered)


def test_startup_and_match_count_logs(caplog):
    caplog.set_level(logging.INFO, logger="vllm")
    m = manager(config(model_configs.fp8("static"), **ALL))
    assert "Enabled fusions: norm_quant, act_quant, attn_quant" in caplog.text
    m.log_match_counts()
    assert "did not run" in caplog.text  # nothing compiled yet (e.g. every piece cached)

    caplog.clear()
    gm = make_fx(lambda x: torch.relu(x) + 1)(torch.randn(4))
    m(gm.graph)
    m.log_match_counts()
    assert "RMSNormQuantFusionPass=0" in caplog.text
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("RMSNormQuantFusionPass is enabled but matched nothing" in w for w in warned)
    assert any("AttnQuantFusionPass is enabled but matched nothing" in w for w in warned)


def test_no_warning_for_unquantized_models(caplog):
    caplog.set_level(logging.INFO, logger="vllm")
    m = manager(config(model_configs.dense(), eliminate_noops=True, fuse_norm_quant=True))
    gm = make_fx(lambda x: x * 2)(torch.randn(4))
    m(gm.graph)
    m.log_match_counts()
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("flag", ["fuse_norm_quant", "fuse_act_quant"])
def test_fusion_without_model_registers_every_scheme(flag):
    m = manager(config(None, **{flag: True}))
    assert m.passes[0].schemes == [mu.STATIC, mu.PER_TOKEN, mu.QuantScheme(False, 128)]


@pytest.mark.parametrize("platform", ["cuda"], indirect=True)
def test_allreduce_fusion_on_cuda_where_flashinfer_can_serve_it(caplog, monkeypatch, platform):
    """fuse_allreduce_rms has a pass (AllReduceFusionPass; without a fusable TP group it
    registers and matches nothing); on CUDA the level turns it on with TP 2/4/8 on Hopper or
    Blackwell with FlashInfer installed (the worker then sets up FlashInfer's workspace and
    the all-reduce is emitted as the op the pass matches), and nowhere else."""
    from vllm.config import ParallelConfig
    from vllm.platforms.cuda import CudaPlatform

    caplog.set_level(logging.INFO, logger="vllm")
    assert pm.has_pass("fuse_allreduce_rms") and pm.has_pass("fuse_norm_quant")
    m = manager(config(model_configs.fp8("static"), fuse_norm_quant=True,
                       fuse_allreduce_rms=True))
    assert "Enabled fusions: allreduce_rms, norm_quant\n" in caplog.text + "\n"
    assert [p.name for p in m.passes] == ["AllReduceFusionPass", "RMSNormQuantFusionPass"]
    assert m.passes[0].patterns.registered == []

    def resolved(tp: int, capability, present: bool) -> bool:
        monkeypatch.setattr(CudaPlatform, "get_device_capability", lambda *a: capability)
        monkeypatch.setattr("importlib.util.find_spec",
                            lambda name, *a: object() if present else None)
        cfg = VllmConfig(optimization_level=2,
                         parallel_config=ParallelConfig(tensor_parallel_size=tp,
                                                        distributed_executor_backend="mp"))
        return cfg.compilation_config.pass_config.fuse_allreduce_rms

    assert resolved(2, (9, 0), True) is True
    assert resolved(4, (10, 0), True) is True
    assert resolved(1, (9, 0), True) is False       # no all-reduce
    assert resolved(2, (8, 0), True) is False       # Ampere: no fused kernel
    assert resolved(2, (9, 0), False) is False      # FlashInfer not installed
    assert resolved(3, (9, 0), True) is False       # FlashInfer fuses 2, 4 or 8 ranks


@pytest.mark.parametrize("platform", ["cpu", "cuda"], indirect=True)
def test_tracing_patterns_builds_the_cpu_kernels_only_for_a_cpu_model(monkeypatch, platform):
    """The patterns are traced with CPU example tensors, which runs the ops' CPU forms: on a
    GPU machine that must not build the C++ CPU kernels (a compiler run at the first FP8
    compile, or a logged failure without one)."""
    from vllm.model_executor.kernels import cpu_loader
    from vllm.utils import cpu_kernels

    builds = []
    monkeypatch.setattr(cpu_loader, "cpu_fp8_kernels_loaded", lambda: False)
    monkeypatch.setattr(cpu_loader, "load_cpu_extension",
                        lambda *a, **k: builds.append(a[0]) or False)
    monkeypatch.setattr(cpu_kernels, "load_cpu_extension", cpu_loader.load_cpu_extension)
    from vllm.compilation.passes.fusion.rms_quant_fusion import RMSNormQuantFusionPass

    RMSNormQuantFusionPass(config(model_configs.fp8("static"), fuse_norm_quant=True))
    assert cpu_loader._allowed  # restored after the registration
    if not platform.is_cpu():
        assert builds == []
