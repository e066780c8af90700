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


# ---- splitting ops: set_splitting_ops_for_v1, splitting_ops_contain_attention ---------------
def test_attention_ops_are_the_default_split_points():
    assert CompilationConfig._attention_ops == ["vllm::unified_attention_with_output"]
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    assert not cc.splitting_ops_contain_attention()  # unset
    assert cc.set_splitting_ops_for_v1() is not None
    assert cc.splitting_ops == cc._attention_ops and cc.splitting_ops_contain_attention()
    cc.set_splitting_ops_for_v1()  # a second call changes nothing
    assert cc.splitting_ops == cc._attention_ops
    explicit = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, splitting_ops=["a::b"])
    assert explicit.set_splitting_ops_for_v1() is None and explicit.splitting_ops == ["a::b"]
    assert not explicit.splitting_ops_contain_attention()


def test_splitting_ops_without_piecewise_compile_and_with_attention_fusion():
    none = CompilationConfig(mode=CompilationMode.NONE)
    none.set_splitting_ops_for_v1()
    assert none.splitting_ops == []
    fused = CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                              pass_config=PassConfig(fuse_attn_quant=True))
    fused.set_splitting_ops_for_v1()
    assert fused.splitting_ops == [] and not fused.splitting_ops_contain_attention()
    with pytest.raises(ValidationError, match="fuse_attn_quant"):
        VllmConfig(compilation_config=CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, pass_config=PassConfig(fuse_attn_quant=True),
            splitting_ops=CompilationConfig()._attention_ops))


def test_vllm_config_fills_splitting_ops_through_the_compilation_config():
    config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE))
    assert config.compilation_config.splitting_ops_contain_attention()
    assert config.provenance["compilation_config.splitting_ops"].label.endswith(
        "default split points")


def test_deepep_all_to_all_is_refused():
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    with pytest.raises(ValueError, match="DeepEP"):
        cc.set_splitting_ops_for_v1(all2all_backend="deepep_high_throughput",
                                    data_parallel_size=8)
    cc.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    assert cc.splitting_ops_contain_attention()


# ---- capture sizes: post_init_cudagraph_sizes, _set_cudagraph_sizes ------------------------
def test_post_init_cudagraph_sizes_sorts_and_expands():
    cc = CompilationConfig(cudagraph_capture_sizes=[8, 1, 4, 2, 4],
                           compile_sizes=["cudagraph_capture_sizes", 64],
                           cudagraph_mode=CUDAGraphMode.FULL)
    cc.post_init_cudagraph_sizes()
    assert cc.cudagraph_capture_sizes == [1, 2, 4, 8]
    assert cc.max_cudagraph_capture_size == 8
    assert cc.compile_sizes == [1, 2, 4, 8, 64]  # 64: above every capture size, unpadded


@pytest.mark.parametrize("compile_size, padded", [(3, 4), (5, 8)])
def test_compile_size_that_would_be_padded_is_refused(compile_size, padded):
    cc = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8], compile_sizes=[compile_size],
                           cudagraph_mode=CUDAGraphMode.FULL)
    with pytest.raises(ValueError, match=f"entry {compile_size} would be padded to {padded}"):
        cc.post_init_cudagraph_sizes()
    # Without CUDA graphs nothing is padded: the same sizes are fine.
    cc = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8], compile_sizes=[compile_size],
                           cudagraph_mode=CUDAGraphMode.NONE)
    cc.post_init_cudagraph_sizes()
    assert cc.compile_sizes == [compile_size]


def test_dispatcher_checks_padding_for_the_mode_it_captures():
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    cc = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8], compile_sizes=[3],
                           cudagraph_mode=CUDAGraphMode.NONE)
    cc.post_init_cudagraph_sizes()
    config = dataclasses.replace(VllmConfig(), compilation_config=cc)
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.NONE)
    with pytest.raises(ValueError, match="would be padded to 4"):
        dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL)


class _SpecConfig:
    """A stand-in for upstream's SpeculativeConfig (this engine has no speculative decoding)."""

    def __init__(self, num_speculative_tokens, schedule=None):
        self.num_speculative_tokens = num_speculative_tokens
        self.num_speculative_tokens_per_batch_size = schedule

    def uses_dynamic_speculative_decoding(self):
        return self.num_speculative_tokens_per_batch_size is not None


def _stand_in(max_num_seqs, max_num_batched_tokens, spec=None):
    """What `VllmConfig._set_cudagraph_sizes` reads, without resolving a VllmConfig."""
    from unittest import mock

    config = mock.MagicMock(spec=VllmConfig)
    config.compilation_config = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    config.scheduler_config = SchedulerConfig.default_factory(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    config.model_config = mock.MagicMock(enforce_eager=False)
    config.speculative_config = spec
    config.num_speculative_tokens = VllmConfig.num_speculative_tokens.fget(config)
    return config


@pytest.mark.parametrize("max_num_seqs", [8, 100, 101, 300, 2048])
def test_capture_sizes_without_speculation_are_unchanged(max_num_seqs):
    from vllm.config.capture_sizes import default_capture_sizes

    config = _stand_in(max_num_seqs, 1_000_000)
    VllmConfig._set_cudagraph_sizes(config)
    cc = config.compilation_config
    top = min(2 * max_num_seqs, 512)
    widest = {max_num_seqs} if max_num_seqs <= 512 else set()  # off-stride 101: added
    expected = sorted(set(default_capture_sizes(top)) | widest)
    assert cc.cudagraph_capture_sizes == expected
    assert cc.max_cudagraph_capture_size == expected[-1]


def test_capture_sizes_cover_decode_batches_under_the_ceiling():
    # 24 requests x (1 + 16) tokens = 408 <= 512: captured exactly; 33 x 17 = 561: not.
    for seqs, widest_captured in ((24, True), (33, False)):
        config = _stand_in(seqs, 32768, _SpecConfig(16))
        VllmConfig._set_cudagraph_sizes(config)
        cc = config.compilation_config
        assert cc.max_cudagraph_capture_size == cc.cudagraph_capture_sizes[-1] == 512
        assert (seqs * 17 in cc.cudagraph_capture_sizes) is widest_captured
        assert max(cc.cudagraph_capture_sizes) <= 512


def test_capture_sizes_follow_a_dynamic_speculation_schedule():
    # Width 4 for 1-2 requests (also the gap 3-4), then width 1 from 5 (also the tail to 17).
    config = _stand_in(17, 32768, _SpecConfig(4, [(1, 2, 4), (5, 5, 1)]))
    VllmConfig._set_cudagraph_sizes(config)
    sizes = config.compilation_config.cudagraph_capture_sizes
    assert {5, 10, 20} <= set(sizes)  # 1, 2, 4 requests x 5 tokens
    assert 34 in sizes  # 17 requests x 2 tokens
    # A configured width above num_speculative_tokens is clamped to it.
    config = _stand_in(16, 32768, _SpecConfig(3, [(1, 16, 5)]))
    VllmConfig._set_cudagraph_sizes(config)
    sizes = config.compilation_config.cudagraph_capture_sizes
    assert 64 in sizes and 6 not in sizes


def test_capture_sizes_stay_within_the_token_budget_with_speculation():
    config = _stand_in(32, 512, _SpecConfig(16))
    VllmConfig._set_cudagraph_sizes(config)
    cc = config.compilation_config
    assert cc.max_cudagraph_capture_size == cc.cudagraph_capture_sizes[-1] == 512
    assert 544 not in cc.cudagraph_capture_sizes


def test_blackwell_raises_the_capture_ceiling(monkeypatch):
    from vllm.config.capture_sizes import default_max_capture_size
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "get_device_capability", lambda: (10, 0))
    assert current_platform.is_device_capability_family(100)
    assert default_max_capture_size() == 1024
    config = _stand_in(1024, 1_000_000)
    VllmConfig._set_cudagraph_sizes(config)
    assert config.compilation_config.max_cudagraph_capture_size == 1024
    monkeypatch.setattr(current_platform, "get_device_capability", lambda: (9, 0))
    assert default_max_capture_size() == 512


def test_speculative_config_is_refused_and_query_len_is_one():
    config = VllmConfig()
    assert config.speculative_config is None
    assert config.num_speculative_tokens == 0 and config.uniform_decode_query_len == 1
    with pytest.raises(ValidationError, match="speculative decoding is not supported"):
        VllmConfig(speculative_config=_SpecConfig(2))


def test_empty_capture_sizes_with_cuda_graphs_is_an_error():
    from vllm.config.capture_sizes import resolve_capture_sizes

    with pytest.raises(ValueError, match=r"cudagraph_capture_sizes=\[\] captures nothing"):
        resolve_capture_sizes([], None, 8, 2048)
    with pytest.raises(ValueError, match="must be >= 1"):
        resolve_capture_sizes(None, 0, 8, 2048)


def test_user_graph_pass_is_kept_out_of_the_config_hash():
    from vllm.compilation.passes.inductor_pass import CallableInductorPass

    plain = CompilationConfig(inductor_compile_config={"max_autotune": True})
    with_pass = CompilationConfig(inductor_compile_config={
        "max_autotune": True, "post_grad_custom_post_pass": CallableInductorPass(print)})
    assert plain.compute_hash() == with_pass.compute_hash()
    assert "post_grad_custom_post_pass" in with_pass.inductor_compile_config
    with pytest.raises(ValidationError, match="must be an InductorPass"):
        CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": print})
