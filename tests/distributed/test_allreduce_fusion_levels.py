"""fuse_allreduce_rms on the CPU: off at every level (inside compiled code the fused op measured
slower than the shared-memory all-reduce plus Inductor's add + RMSNorm kernel), the provenance
at -O2/-O3 naming the platform and the measurement; an explicit value wins."""
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
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_off_by_default_even_with_tp2(platform, level):
    config = resolve(2, level, "mp")
    assert config.compilation_config.pass_config.fuse_allreduce_rms is False
    if level >= 2:
        prov = config.provenance[FLAG]
        assert prov.label == "platform cpu" and "measured slower" in prov.reason


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
    for level in (1, 2, 3):
        config = resolve(2, level, "mp", fuse_allreduce_rms=True)
        assert config.compilation_config.pass_config.fuse_allreduce_rms is True
        assert config.provenance[FLAG].label == "user"
