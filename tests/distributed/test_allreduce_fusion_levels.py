"""fuse_allreduce_rms on the CPU: on at -O2/-O3 with TP > 1 where the shared-memory all-reduce
runs (mp executor, switch on), off at TP = 1, at -O0/-O1, with Ray or the switch off; an
explicit value wins; the provenance names the platform and why."""
from __future__ import annotations

import pytest

from vllm.config import CompilationConfig, ParallelConfig, PassConfig, VllmConfig

FLAG = "compilation_config.pass_config.fuse_allreduce_rms"


def resolve(tp: int, level: int, backend: str | None = None, **flags) -> VllmConfig:
    return VllmConfig(optimization_level=level,
                      parallel_config=ParallelConfig(tensor_parallel_size=tp,
                                                     distributed_executor_backend=backend),
                      compilation_config=CompilationConfig(pass_config=PassConfig(**flags)))


@pytest.mark.parametrize("platform", ["cpu"], indirect=True)
@pytest.mark.parametrize("level, expected", [(0, False), (1, False), (2, True), (3, True)])
def test_on_at_o2_o3_with_tp2(platform, level, expected):
    config = resolve(2, level, "mp")
    assert config.compilation_config.pass_config.fuse_allreduce_rms is expected
    if level >= 2:
        prov = config.provenance[FLAG]
        assert prov.label == "platform cpu" and "shared-memory all-reduce" in prov.reason


@pytest.mark.parametrize("platform", ["cpu"], indirect=True)
def test_off_at_tp1(platform):
    for level in (2, 3):
        assert resolve(1, level).compilation_config.pass_config.fuse_allreduce_rms is False


@pytest.mark.parametrize("platform", ["cpu"], indirect=True)
def test_off_with_the_switch_off_or_ray(platform, monkeypatch):
    assert resolve(2, 2, "ray").compilation_config.pass_config.fuse_allreduce_rms is False
    monkeypatch.setenv("VLLM_CPU_SHM_ALLREDUCE", "0")
    assert resolve(2, 2, "mp").compilation_config.pass_config.fuse_allreduce_rms is False


@pytest.mark.parametrize("platform", ["cpu"], indirect=True)
def test_explicit_value_wins(platform):
    config = resolve(2, 2, "mp", fuse_allreduce_rms=False)
    assert config.compilation_config.pass_config.fuse_allreduce_rms is False
    assert config.provenance[FLAG].label == "user"
    config = resolve(2, 1, "mp", fuse_allreduce_rms=True)
    assert config.compilation_config.pass_config.fuse_allreduce_rms is True
