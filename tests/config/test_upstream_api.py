"""Upstream's config API, in our words: the nested level table with named predicates, the pass
flags, compile ranges, scheduler/model constructors and pydantic ValidationErrors."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from pydantic import ValidationError

from tests.config import model_configs
from vllm.config import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    ModelConfig,
    PassConfig,
    SchedulerConfig,
    VllmConfig,
    levels,
)
from vllm.config.utils import Range
from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG, OptimizationLevel


# ---- the level table -----------------------------------------------------------------------
def test_table_is_nested_per_config():
    for level in OptimizationLevel:
        table = OPTIMIZATION_LEVEL_TO_CONFIG[level]
        assert set(table) == {"compilation_config"}
        assert isinstance(table["compilation_config"]["pass_config"], dict)
        assert table["compilation_config"]["mode"] == (
            CompilationMode.NONE if level == 0 else CompilationMode.VLLM_COMPILE)
    assert OPTIMIZATION_LEVEL_TO_CONFIG[2]["compilation_config"]["cudagraph_mode"] == (
        CUDAGraphMode.FULL_AND_PIECEWISE)


def test_conditional_defaults_are_named_documented_functions():
    seen = set()
    for level in OptimizationLevel:
        for path, value in levels.iter_level_defaults(OPTIMIZATION_LEVEL_TO_CONFIG[level]):
            if callable(value):
                seen.add(value)
                assert value.__name__ != "<lambda>", path
                assert getattr(levels, value.__name__) is value, path
                assert levels.describe(value) and value.__doc__, path
    assert levels.enable_norm_fusion in seen and levels.enable_allreduce_rms_fusion in seen


def test_every_table_leaf_is_unset_on_a_fresh_config():
    for level in OptimizationLevel:
        cc = OPTIMIZATION_LEVEL_TO_CONFIG[level]["compilation_config"]
        fresh = CompilationConfig()
        for key in cc["pass_config"]:
            assert getattr(fresh.pass_config, key) is None, key
        for key in cc:
            if key != "pass_config":
                assert getattr(fresh, key) is None, key


@pytest.mark.parametrize("platform", ["cuda"], indirect=True)
@pytest.mark.parametrize("level", list(OptimizationLevel))
@pytest.mark.parametrize("model", ["none", "dense", "fp8"])
def test_resolved_values_equal_the_table_evaluated_on_the_final_config(platform, level, model,
                                                                       monkeypatch):
    """Upstream's check: each table leaf, a predicate called with the resolved config, equals
    the resolved value (CUDA with TRITON_ATTN: its level table changes nothing here but the
    attention fusion, and that backend keeps the levels' CUDA-graph modes)."""
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TRITON_ATTN")
    config = VllmConfig(model_config=model_configs.MODELS[model](), optimization_level=level)
    for path, value in levels.iter_level_defaults(OPTIMIZATION_LEVEL_TO_CONFIG[level]):
        if path == "compilation_config.pass_config.fuse_attn_quant" and model == "fp8":
            continue  # CUDA's level table keeps piecewise graphs over attention fusion
        expected = value(config) if callable(value) else value
        assert config.get_path(path) == expected, path


@pytest.mark.parametrize("platform", ["cuda", "cpu"], indirect=True)
def test_predicate_reason_is_its_docstring_line(platform):
    """From the base table (CUDA) or a platform's table that restates the predicate with its
    measurement (the CPU), the reason starts with what the predicate asks, and its answer."""
    config = VllmConfig(model_config=model_configs.fp8(), optimization_level=1)
    prov = config.provenance["compilation_config.pass_config.fuse_norm_quant"]
    assert prov.label == ("level O1" if platform.is_cuda() else "platform cpu")
    assert prov.reason.startswith(levels.describe(levels.enable_norm_fusion) + ": yes")


# ---- pass flags ----------------------------------------------------------------------------
def test_upstreams_pass_flags_exist_and_are_off_at_every_level():
    names = {f.name for f in dataclasses.fields(PassConfig)}
    for flag in ("enable_qk_norm_rope_fusion", "enable_sp", "fuse_gemm_comms",
                 "fuse_rope_kvcache", "fuse_act_padding", "fuse_mla_dual_rms_norm",
                 "fuse_qk_norm_rope_kvcache", "fuse_rope_kvcache_cat_mla"):
        assert flag in names
        for level in OptimizationLevel:
            config = VllmConfig(optimization_level=level)
            assert getattr(config.compilation_config.pass_config, flag) is False


def test_explicit_no_pass_flag_survives():
    config = VllmConfig(optimization_level=2, compilation_config=CompilationConfig(
        pass_config=PassConfig(enable_qk_norm_rope_fusion=True)))
    assert config.compilation_config.pass_config.enable_qk_norm_rope_fusion is True
    assert config.provenance[
        "compilation_config.pass_config.enable_qk_norm_rope_fusion"].label == "user"


def test_qk_norm_rope_fusion_contradicts_disabled_rotary_op():
    with pytest.raises(ValueError, match="cannot both enable and disable.*rotary_embedding"):
        CompilationConfig(custom_ops=["-rotary_embedding"],
                          pass_config=PassConfig(enable_qk_norm_rope_fusion=True))
    CompilationConfig(custom_ops=["-rotary_embedding"])  # alone it is fine


def test_bad_pass_flag_values():
    with pytest.raises(ValueError, match="enable_sp must be true or false"):
        PassConfig(enable_sp="yes")
    with pytest.raises(ValueError, match="sp_min_token_num must be a positive integer"):
        PassConfig(sp_min_token_num=0)


# ---- compile ranges ------------------------------------------------------------------------
def test_get_compile_ranges():
    cc = CompilationConfig(compile_ranges_endpoints=[8, 32])
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        cc.get_compile_ranges()
    VllmConfig(scheduler_config=SchedulerConfig(max_num_batched_tokens=8192, max_model_len=8192,
                                                is_encoder_decoder=False),
               compilation_config=cc)
    assert cc.get_compile_ranges() == [Range(start=1, end=8), Range(start=9, end=32),
                                       Range(start=33, end=8192)]


def test_range_single_size_is_a_method():
    assert Range(start=16, end=16).is_single_size()
    assert not Range(start=1, end=8).is_single_size()
    assert 4 in Range(1, 8) and 9 not in Range(1, 8)


def test_resolved_budget_is_not_part_of_equality_or_hash():
    a, b = CompilationConfig(), CompilationConfig()
    a.max_num_batched_tokens = 8192
    assert a == b and a.compute_hash() == b.compute_hash()


# ---- constructors --------------------------------------------------------------------------
def test_scheduler_config_default_factory_and_encoder_decoder():
    sc = SchedulerConfig.default_factory(max_num_seqs=8)
    assert sc.max_num_seqs == 8 and sc.max_num_batched_tokens is None
    with pytest.raises(ValueError, match="encoder-decoder"):
        SchedulerConfig(is_encoder_decoder=True)


def test_model_config_takes_a_torch_dtype():
    assert ModelConfig(model="demo", dtype=torch.bfloat16).dtype == "bfloat16"
    assert ModelConfig(model="demo", dtype=torch.float32).dtype == "float32"
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig(model="demo", dtype=torch.int8)


def test_non_default_dict_round_trips():
    cc = CompilationConfig.from_dict({"mode": 3, "cudagraph_mode": "PIECEWISE",
                                      "pass_config": {"fuse_norm_quant": False}})
    data = cc.non_default_dict()
    assert data == {"mode": "VLLM_COMPILE", "cudagraph_mode": "PIECEWISE",
                    "pass_config": {"fuse_norm_quant": False}}
    assert CompilationConfig.from_dict(data) == cc
    assert CompilationConfig().non_default_dict() == {}


# ---- validation errors ---------------------------------------------------------------------
@pytest.mark.parametrize("build, words", [
    (lambda: CompilationConfig(mode="INVALID_MODE"), "Invalid compilation mode"),
    (lambda: CompilationConfig(custom_ops=["all", "none"]), "only one base mode"),
    (lambda: PassConfig(fuse_norm_quant="maybe"), "fuse_norm_quant must be true or false"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs must be a positive integer"),
    (lambda: VllmConfig(optimization_level=7), "Invalid optimization level 7"),
])
def test_config_errors_are_pydantic_validation_errors_with_our_message(build, words):
    with pytest.raises(ValidationError) as info:
        build()
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(words) or words in str(info.value)
    assert "\n" not in str(info.value)  # one line, not pydantic's report


@pytest.mark.parametrize("platform", ["cuda"], indirect=True)
def test_attention_split_with_attention_fusion_is_a_validation_error(platform):
    with pytest.raises(ValidationError, match="fuse_attn_quant"):
        VllmConfig(compilation_config=CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, pass_config=PassConfig(fuse_attn_quant=True),
            splitting_ops=["vllm::unified_attention_with_output"]))


@pytest.mark.parametrize("platform", ["cuda"], indirect=True)
def test_inconsistent_capture_sizes_are_a_validation_error(platform):
    with pytest.raises(ValidationError, match="should be consistent"):
        VllmConfig(model_config=model_configs.dense(), compilation_config=CompilationConfig(
            cudagraph_capture_sizes=[1, 2, 4], max_cudagraph_capture_size=8))
