"""Levels set defaults only: explicit values survive, per leaf, or fail with a clear error."""
from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.config import model_configs
from vllm.config import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    PassConfig,
    VllmConfig,
)
from vllm.config.levels import (
    LEVEL_CONTROLLED_FIELDS,
    OPTIMIZATION_LEVEL_TO_CONFIG,
    iter_level_defaults,
)
from vllm.config.vllm import ConfigSource, cudagraph_mode_for_backend
from vllm.platforms import reset_current_platform

BOOL_FIELDS = [p for p in LEVEL_CONTROLLED_FIELDS
               if p not in ("compilation_config.mode", "compilation_config.cudagraph_mode",
                            "compilation_config.compile_sizes")]
VALUES = {
    "compilation_config.mode": st.sampled_from(list(CompilationMode)),
    "compilation_config.cudagraph_mode": st.sampled_from(list(CUDAGraphMode)),
    "compilation_config.compile_sizes": st.lists(st.integers(1, 64), max_size=4, unique=True)
    .map(sorted),
    **{path: st.booleans() for path in BOOL_FIELDS},
}


def _build(explicit: dict, level: int, model: str) -> VllmConfig:
    cc: dict = {}
    for path, value in explicit.items():
        keys = path.split(".")[1:]
        node = cc
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return VllmConfig(model_config=model_configs.MODELS[model](), optimization_level=level,
                      compilation_config=CompilationConfig.from_dict(cc))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(explicit=st.fixed_dictionaries({}, optional=VALUES), level=st.integers(0, 3),
       model=st.sampled_from(["none", "dense", "fp8", "moe"]),
       platform=st.sampled_from(["cpu", "cuda"]))
def test_explicit_values_survive_or_clear_error(explicit, level, model, platform):
    import os

    os.environ["VLLM_PLATFORM"] = platform
    reset_current_platform()
    try:
        try:
            config = _build(explicit, level, model)
        except ValueError as exc:
            # Impossible on this platform: the message names one of the fields that were set.
            leaves = {path.split(".")[-1] for path in explicit}
            assert any(leaf in str(exc) for leaf in leaves), str(exc)
            return
        for path, value in explicit.items():
            prov = config.provenance[path]
            if path == "compilation_config.cudagraph_mode" and prov.source is \
                    ConfigSource.DERIVED:
                # The one narrowing of an explicit value (warned, as upstream): full CUDA
                # graphs only for the batches the attention backend runs inside one.
                from vllm.attention.selector import default_backend

                assert f"({value} was set explicitly)" in prov.reason
                assert config.get_path(path) == cudagraph_mode_for_backend(
                    value, default_backend().cudagraph_support, config.piecewise_compiled)
                continue
            assert config.get_path(path) == value, path
            assert prov.label == "user", path
    finally:
        os.environ.pop("VLLM_PLATFORM", None)
        reset_current_platform()


def test_every_preset_key_names_a_real_field():
    for table in OPTIMIZATION_LEVEL_TO_CONFIG.values():
        paths = [path for path, _ in iter_level_defaults(table)]
        assert tuple(paths) == LEVEL_CONTROLLED_FIELDS
        for path in paths:
            *parents, leaf = path.split(".")
            cls = VllmConfig
            for part in parents:
                cls = {f.name: f for f in dataclasses.fields(cls)}[part].default_factory
            assert leaf in {f.name for f in dataclasses.fields(cls)}, path


def test_every_level_field_is_none_on_a_fresh_config():
    fresh = {"compilation_config": CompilationConfig()}
    for path in LEVEL_CONTROLLED_FIELDS:
        obj = fresh["compilation_config"]
        for part in path.split(".")[1:]:
            obj = getattr(obj, part)
        assert obj is None, path
    assert all(getattr(PassConfig(), f.name) is None for f in dataclasses.fields(PassConfig))


def test_explicit_mode_at_o0_is_honoured():
    config = VllmConfig(model_config=model_configs.dense(), optimization_level=0,
                        compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE))
    cc = config.compilation_config
    assert cc.mode == CompilationMode.VLLM_COMPILE
    assert config.provenance["compilation_config.mode"].label == "user"
    assert cc.cudagraph_mode == CUDAGraphMode.NONE
    assert cc.pass_config.eliminate_noops is False  # the rest of O0 still applies
    assert cc.splitting_ops  # compiled piecewise, split at attention


def test_one_pass_flag_leaves_the_others_defaulted():
    config = VllmConfig(model_config=model_configs.fp8(), optimization_level=2,
                        compilation_config={"pass_config": {"fuse_norm_quant": False}})
    pc = config.compilation_config.pass_config
    assert pc.fuse_norm_quant is False and pc.fuse_act_quant is True
    # (the base table's predicate, or the CPU's table restating it with its measurement)
    assert config.provenance["compilation_config.pass_config.fuse_act_quant"].source in (
        ConfigSource.LEVEL, ConfigSource.PLATFORM)


@pytest.mark.parametrize("platform", ["cuda"], indirect=True)
def test_explicit_cudagraph_none_at_o2_kept(platform):
    config = VllmConfig(model_config=model_configs.dense(), optimization_level=2,
                        compilation_config={"cudagraph_mode": "NONE"})
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert config.compilation_config.mode == CompilationMode.VLLM_COMPILE
    assert config.compilation_config.cudagraph_capture_sizes == []


def test_enforce_eager_means_o0_and_warns(caplog):
    model = model_configs.dense()
    model.enforce_eager = True
    with pytest.warns(DeprecationWarning, match="enforce_eager"):
        import vllm.config.vllm as vllm_mod

        vllm_mod._enforce_eager_warned = False
        config = VllmConfig(model_config=model)
    assert int(config.optimization_level) == 0
    assert config.compilation_config.mode == CompilationMode.NONE
    assert config.provenance["optimization_level"].label == "derived: enforce_eager"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        VllmConfig(model_config=model)  # warns only once


@pytest.mark.parametrize("level", [1, 2, 3, "O3"])
def test_enforce_eager_with_explicit_level_is_error(level):
    model = model_configs.dense()
    model.enforce_eager = True
    with pytest.raises(ValueError, match="enforce_eager.*contradicts"):
        VllmConfig(model_config=model, optimization_level=level)


def test_enforce_eager_with_explicit_o0_is_fine():
    model = model_configs.dense()
    model.enforce_eager = True
    assert int(VllmConfig(model_config=model, optimization_level=0).optimization_level) == 0


def test_enforce_eager_keeps_explicit_mode():
    model = model_configs.dense()
    model.enforce_eager = True
    config = VllmConfig(model_config=model, compilation_config={"mode": "VLLM_COMPILE"})
    assert config.compilation_config.mode == CompilationMode.VLLM_COMPILE


def test_torch_compile_disable_env(monkeypatch):
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    config = VllmConfig(model_config=model_configs.dense(), optimization_level=2)
    assert config.compilation_config.mode == CompilationMode.NONE
    assert config.provenance["compilation_config.mode"].label == "env TORCH_COMPILE_DISABLE"


@pytest.mark.parametrize("mode", ["VLLM_COMPILE", 1, "DYNAMO_TRACE_ONCE"])
def test_torch_compile_disable_env_wins_over_an_explicit_mode(monkeypatch, caplog, mode):
    """As upstream: torch.compile cannot run at all, so even an explicit mode becomes NONE,
    with a warning (it used to stay and fail deep in the Dynamo trace)."""
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    with caplog.at_level(logging.WARNING, logger="vllm"):
        config = VllmConfig(model_config=model_configs.dense(),
                            compilation_config={"mode": mode})
    assert config.compilation_config.mode == CompilationMode.NONE
    assert config.provenance["compilation_config.mode"].label == "env TORCH_COMPILE_DISABLE"
    assert any("TORCH_COMPILE_DISABLE=1" in r.getMessage() for r in caplog.records)

