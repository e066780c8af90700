"""CompilationConfig parsing and validation, custom-op switches, and the config hash."""
from __future__ import annotations

import pytest

from tests.config import model_configs
from vllm.config import (
    CacheConfig,
    CompilationConfig,
    CompilationMode,
    SchedulerConfig,
    VllmConfig,
)


@pytest.mark.parametrize("value,expected", [
    (3, CompilationMode.VLLM_COMPILE), ("3", CompilationMode.VLLM_COMPILE),
    ("vllm_compile", CompilationMode.VLLM_COMPILE), ("None", CompilationMode.NONE),
    ("Stock_Torch_Compile", CompilationMode.STOCK_TORCH_COMPILE), (2, 2),
])
def test_mode_parsing(value, expected):
    assert CompilationConfig(mode=value).mode == expected


@pytest.mark.parametrize("bad", ["INVALID_MODE", 7, -1, "fast"])
def test_invalid_mode(bad):
    with pytest.raises(ValueError, match="Invalid compilation mode.*Valid modes are: NONE"):
        CompilationConfig(mode=bad)


@pytest.mark.parametrize("ops,message", [
    (["rms_norm"], "Invalid syntax 'rms_norm' for custom op"),
    (["+"], "Invalid syntax '\\+'"),
    (["all", "none"], "only one base mode"),
    (["+rms_norm", "-rms_norm"], "both enable and disable the same operation.*rms_norm"),
])
def test_custom_op_validation(ops, message):
    with pytest.raises(ValueError, match=message):
        CompilationConfig(custom_ops=ops)


def _resolved(custom_ops, backend="inductor", level=2) -> CompilationConfig:
    return VllmConfig(optimization_level=level, compilation_config=CompilationConfig(
        custom_ops=custom_ops, backend=backend)).compilation_config


def test_is_custom_op_enabled():
    assert _resolved([], backend="eager").is_custom_op_enabled("rms_norm")
    assert not _resolved(["all", "-rms_norm"]).is_custom_op_enabled("rms_norm")
    assert not _resolved([]).is_custom_op_enabled("rms_norm")  # Inductor: native ops
    assert _resolved(["none", "+rms_norm"]).is_custom_op_enabled("rms_norm")
    assert not _resolved(["none", "-rms_norm"]).is_custom_op_enabled("rms_norm")
    assert _resolved([], level=0).is_custom_op_enabled("silu_and_mul")  # eager: kernels
    with pytest.raises(ValueError, match="exactly one base mode"):
        CompilationConfig().is_custom_op_enabled("rms_norm")


def test_unknown_key_names_closest():
    with pytest.raises(ValueError, match="compilation_config.cudagraph_mod'.*cudagraph_mode"):
        CompilationConfig.from_dict({"cudagraph_mod": "FULL"})
    with pytest.raises(ValueError, match="pass_config.fuse_norm_qaunt.*fuse_norm_quant"):
        CompilationConfig.from_dict({"pass_config": {"fuse_norm_qaunt": True}})


def test_bad_values():
    with pytest.raises(ValueError, match="pass_config.fuse_norm_quant must be true or false"):
        CompilationConfig.from_dict({"pass_config": {"fuse_norm_quant": "yes"}})
    # Every on/off switch of the compilation config, not only the passes' (a string from a
    # command line would be truthy).
    for name in ("use_inductor_graph_partition", "freezing", "prepack_linear_weights",
                 "max_autotune", "coordinate_descent_tuning", "cpp_wrapper"):
        with pytest.raises(ValueError,
                           match=f"compilation_config.{name} must be true or false, got 'maybe'"):
            CompilationConfig.from_dict({name: "maybe"})
        assert getattr(CompilationConfig.from_dict({name: False}), name) is False
    with pytest.raises(ValueError, match="Invalid backend for piecewise compilation"):
        CompilationConfig(mode=3, backend="cudagraphs")
    with pytest.raises(ValueError, match="cudagraph_capture_sizes must hold positive"):
        CompilationConfig(cudagraph_capture_sizes=[0, 8])
    with pytest.raises(ValueError, match="compile_sizes"):
        CompilationConfig(compile_sizes=["all"])
    # A bare string is not iterated letter by letter ("unknown entry 'c'").
    with pytest.raises(ValueError, match=r"compile_sizes must be a list.*got 'cudagraph_capt"):
        CompilationConfig(compile_sizes="cudagraph_capture_sizes")
    with pytest.raises(ValueError, match="cudagraph_capture_sizes must be a list.*got 4"):
        CompilationConfig(cudagraph_capture_sizes=4)
    # Were a TypeError from deep inside (iterating an int) before.
    with pytest.raises(ValueError, match="splitting_ops must be a list of op names.*got 5"):
        CompilationConfig.from_dict({"splitting_ops": 5})
    with pytest.raises(ValueError, match=r"splitting_ops must be a list of op names.*got \[1\]"):
        CompilationConfig(splitting_ops=[1])
    assert CompilationConfig(splitting_ops=[]).splitting_ops == []  # [] = no splitting
    with pytest.raises(ValueError, match="inductor_compile_config must map Inductor option"):
        CompilationConfig.from_dict({"inductor_compile_config": 5})


def test_backend_checked_once_the_level_set_the_mode():
    """The level sets the mode after CompilationConfig is built: the backend is checked at
    config resolution (not after the weights are loaded)."""
    with pytest.raises(ValueError, match="'bogus'.*must be 'inductor' or 'eager'"):
        VllmConfig(model_config=model_configs.dense(), optimization_level=2,
                   compilation_config={"backend": "bogus"})
    with pytest.raises(ValueError, match="'bogus' is not a torch.compile backend.*aot_eager"):
        VllmConfig(model_config=model_configs.dense(), optimization_level=2,
                   compilation_config={"backend": "bogus", "mode": 1})
    ok = VllmConfig(model_config=model_configs.dense(), optimization_level=2,
                    compilation_config={"backend": "aot_eager", "mode": 1})
    assert ok.compilation_config.backend == "aot_eager"
    # -O0 compiles nothing: the backend is not used.
    VllmConfig(model_config=model_configs.dense(), optimization_level=0,
               compilation_config={"backend": "bogus"})


def _hash(**kwargs) -> str:
    cc = kwargs.pop("compilation_config", None) or {}
    return VllmConfig(model_config=model_configs.dense(), compilation_config=cc,
                      **kwargs).compute_hash()


@pytest.mark.parametrize("platform", ["cuda"], indirect=True)
def test_cuda_graph_capture_sizes_are_not_in_the_hash(platform):
    """They follow max_num_seqs and change what is captured, not what is compiled."""
    base = VllmConfig(model_config=model_configs.dense(), optimization_level=2)
    assert base.compilation_config.cudagraph_capture_sizes  # captured on CUDA
    fewer = VllmConfig(model_config=model_configs.dense(), optimization_level=2,
                       scheduler_config=SchedulerConfig(max_num_seqs=4))
    assert fewer.compilation_config.cudagraph_capture_sizes != \
        base.compilation_config.cudagraph_capture_sizes
    assert fewer.compute_hash() == base.compute_hash()
    sized = VllmConfig(model_config=model_configs.dense(), optimization_level=2,
                       compilation_config={"compile_sizes": [4]})
    assert sized.compute_hash() != base.compute_hash()


def test_hash_covers_graph_relevant_fields_only(tmp_path):
    base = _hash()
    assert base == _hash()
    # Not in the hash: memory sizing, the dump path, the level itself.
    assert _hash(cache_config=CacheConfig(kv_cache_memory="1GiB")) == base
    assert _hash(cache_config=CacheConfig(gpu_memory_utilization=0.5)) == base
    assert _hash(compilation_config={"debug_dump_path": str(tmp_path / "dump")}) == base
    assert _hash(scheduler_config=SchedulerConfig(max_num_seqs=7)) == base
    assert _hash(optimization_level=2) == base
    # In the hash: anything that changes the compiled graph.
    assert _hash(compilation_config={"pass_config": {"eliminate_noops": False}}) != base
    assert _hash(compilation_config={"backend": "eager"}) != base
    assert _hash(optimization_level=1) != base
    assert _hash(scheduler_config=SchedulerConfig(max_num_batched_tokens=512)) != base
    assert _hash(cache_config=CacheConfig(block_size=32)) != base
    other_dtype = model_configs.dense()
    other_dtype.dtype = "bfloat16"
    assert VllmConfig(model_config=other_dtype).compute_hash() != base


def test_deprecated_level_key_reads_as_mode(caplog):
    """Upstream's old `compilation_config={"level": N}` (same numbers as mode): accepted with a
    deprecation warning; an explicit mode wins."""
    import logging

    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert CompilationConfig.from_dict({"level": 0}).mode == CompilationMode.NONE
        assert CompilationConfig.from_dict({"level": 0, "mode": 3}).mode == \
            CompilationMode.VLLM_COMPILE
    assert "compilation_config.level is deprecated" in caplog.text
