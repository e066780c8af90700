"""EngineArgs: flags <-> dataclass <-> the resolved VllmConfig."""
from __future__ import annotations

import dataclasses
import warnings

import pytest

from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode, OptimizationLevel
from vllm.config.vllm import ConfigSource
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import reset_current_platform
from vllm.utils.argparse_utils import FlexibleArgumentParser


@pytest.fixture
def cuda(monkeypatch):
    """CUDA with TRITON_ATTN, whose decode batches run inside full CUDA graphs (the default
    where Triton is installed), so the levels' FULL_AND_PIECEWISE stays."""
    monkeypatch.setenv("VLLM_PLATFORM", "cuda")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TRITON_ATTN")
    reset_current_platform()
    yield
    reset_current_platform()


def from_argv(*argv: str) -> EngineArgs:
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm test"))
    return EngineArgs.from_cli_args(parser.parse_args(list(argv)))


def test_parser_defaults_equal_dataclass_defaults():
    assert from_argv() == EngineArgs()


def test_every_field_has_a_flag():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    namespace = vars(parser.parse_args([]))
    assert {f.name for f in dataclasses.fields(EngineArgs)} <= set(namespace)


def test_from_cli_args(tiny):
    args = from_argv("--model", tiny, "-O1", "--max-num-seqs", "8", "--no-enable-prefix-caching",
                     "-tp", "1", "--block-size", "32", "-cc.backend=eager", "--seed", "7",
                     "--dtype", "float32", "--max_model_len", "128")
    assert args.model == tiny and args.optimization_level == "1"  # as given, as upstream
    assert args.max_num_seqs == 8 and args.enable_prefix_caching is False
    assert args.compilation_config == CompilationConfig(backend="eager")
    config = args.create_engine_config()
    assert config.optimization_level == OptimizationLevel.O1
    assert config.scheduler_config.max_num_seqs == 8
    assert config.provenance["scheduler_config.max_num_seqs"].label == "user"
    assert config.cache_config.block_size == 32
    assert config.cache_config.enable_prefix_caching is False
    assert config.compilation_config.backend == "eager"
    assert config.provenance["compilation_config.backend"].label == "user"
    assert config.model_config.seed == 7
    assert config.model_config.max_model_len == 128
    assert config.scheduler_config.max_model_len == 128


@pytest.mark.parametrize("level", [OptimizationLevel.O1, 1, "1", "O1"])
def test_level_forms(tiny, level):
    config = EngineArgs(model=tiny, optimization_level=level).create_engine_config()
    assert config.optimization_level == OptimizationLevel.O1
    assert config.compilation_config.mode == CompilationMode.VLLM_COMPILE
    assert config.provenance["optimization_level"].label == "user"


def test_default_level_is_O2(tiny):
    config = EngineArgs(model=tiny).create_engine_config()
    assert config.optimization_level == OptimizationLevel.O2
    assert config.provenance["optimization_level"].label == "default"


def test_bad_level_in_python(tiny):
    with pytest.raises(ValueError, match="Invalid optimization level 5"):
        EngineArgs(model=tiny, optimization_level=5).create_engine_config()


def test_enforce_eager_alone_means_O0(tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        config = EngineArgs(model=tiny, enforce_eager=True).create_engine_config()
        assert config.optimization_level == OptimizationLevel.O0
        assert config.compilation_config.mode == CompilationMode.NONE
        config = EngineArgs(model=tiny, enforce_eager=True,
                            optimization_level=0).create_engine_config()
        assert config.optimization_level == OptimizationLevel.O0


def test_enforce_eager_with_explicit_O2_is_an_error(tiny):
    with pytest.raises(ValueError, match="enforce_eager.*-O2"):
        EngineArgs(model=tiny, enforce_eager=True, optimization_level=2).create_engine_config()
    with pytest.raises(ValueError, match="enforce_eager"):
        from_argv("--model", tiny, "--enforce-eager", "-O2").create_engine_config()


@pytest.mark.parametrize("cc", [
    {"mode": "none", "pass_config": {"eliminate_noops": True}},
    '{"mode": 0, "pass_config": {"eliminate_noops": true}}',
    CompilationConfig(mode=CompilationMode.NONE, pass_config={"eliminate_noops": True}),
])
def test_compilation_config_forms_are_user_values(tiny, cc):
    config = EngineArgs(model=tiny, compilation_config=cc).create_engine_config()
    assert config.optimization_level == OptimizationLevel.O2
    assert config.compilation_config.mode == CompilationMode.NONE
    assert config.provenance["compilation_config.mode"].label == "user"
    assert config.compilation_config.pass_config.eliminate_noops is True
    assert config.provenance["compilation_config.pass_config.eliminate_noops"].label == "user"
    # (on the CPU its level table restates the level's predicate with its measurement)
    assert config.provenance["compilation_config.pass_config.fuse_norm_quant"].source in (
        ConfigSource.LEVEL, ConfigSource.PLATFORM)


@pytest.mark.parametrize("cc", [0, "0", 3, "3"])
def test_compilation_config_as_a_mode_number(tiny, cc):
    """As upstream, compilation_config=N (Python) and -cc N (command line) set the mode only:
    the level fills in the rest."""
    for args in (EngineArgs(model=tiny, compilation_config=cc),
                 from_argv("--model", tiny, "-cc", str(cc))):
        config = args.create_engine_config()
        assert config.compilation_config.mode == CompilationMode(int(cc))
        assert config.provenance["compilation_config.mode"].label == "user"
        assert config.provenance["compilation_config.pass_config.eliminate_noops"].label \
            == "level O2"
    with pytest.raises(ValueError, match="a CompilationConfig or a mode number, got bool"):
        EngineArgs(model=tiny, compilation_config=True).create_engine_config()


def test_callers_compilation_config_is_not_mutated(tiny):
    cc = CompilationConfig(backend="eager")
    data = {"pass_config": {"fuse_norm_quant": False}}
    EngineArgs(model=tiny, compilation_config=cc).create_engine_config()
    EngineArgs(model=tiny, compilation_config=data,
               cudagraph_capture_sizes=[1, 2]).create_engine_config()
    assert cc.mode is None and cc.cudagraph_mode is None and cc.custom_ops == []
    assert data == {"pass_config": {"fuse_norm_quant": False}}


def test_compilation_config_errors(tiny):
    with pytest.raises(ValueError, match=r"line 1 column 2 \(char 1\)"):
        EngineArgs(model=tiny, compilation_config="{mode: 3}").create_engine_config()
    with pytest.raises(ValueError, match="did you mean 'mode'"):
        EngineArgs(model=tiny, compilation_config={"mdoe": 3}).create_engine_config()
    with pytest.raises(ValueError, match="Valid modes are"):
        EngineArgs(model=tiny, compilation_config={"mode": "fast"}).create_engine_config()
    with pytest.raises(ValueError, match="compilation_config must be"):
        EngineArgs(model=tiny, compilation_config=3.0).create_engine_config()
    with pytest.raises(ValueError, match="Valid modes are"):
        EngineArgs(model=tiny, compilation_config=7).create_engine_config()


@pytest.mark.parametrize("name, value", [("cudagraph_capture_sizes", [1, 2]),
                                         ("max_cudagraph_capture_size", 8)])
@pytest.mark.parametrize("form", ["dict", "json", "object"])
def test_capture_size_flags_exclusive_with_cc(tiny, name, value, form):
    cc = {name: value}
    if form == "json":
        import json

        cc = json.dumps(cc)
    elif form == "object":
        cc = CompilationConfig(**cc)
    args = EngineArgs(model=tiny, compilation_config=cc, **{name: value})
    with pytest.raises(ValueError, match="are mutually exclusive"):
        args.create_engine_config()


def test_capture_size_flags_reach_compilation_config(tiny, cuda):
    config = from_argv("--model", tiny, "--cudagraph-capture-sizes", "1", "2", "4",
                       "-cc.backend=eager").create_engine_config()
    cc = config.compilation_config
    assert cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert cc.cudagraph_capture_sizes == [1, 2, 4] and cc.max_cudagraph_capture_size == 4
    assert config.provenance["compilation_config.cudagraph_capture_sizes"].label == "user"
    config = EngineArgs(model=tiny, max_cudagraph_capture_size=16,
                        compilation_config=CompilationConfig()).create_engine_config()
    assert config.compilation_config.max_cudagraph_capture_size == 16
    assert config.compilation_config.cudagraph_capture_sizes == [1, 2, 4, 8, 16]


def test_kv_cache_memory(tiny, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert EngineArgs(model=tiny).create_engine_config().cache_config.kv_cache_memory is None
    config = EngineArgs(model=tiny, kv_cache_memory="512MiB").create_engine_config()
    assert config.cache_config.kv_cache_memory == 512 * 1024**2
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert EngineArgs(model=tiny).create_engine_config().cache_config.kv_cache_memory == 2 * 1024**3
    config = EngineArgs(model=tiny, kv_cache_memory=1024).create_engine_config()
    assert config.cache_config.kv_cache_memory == 1024
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
        EngineArgs(model=tiny).create_engine_config()


@pytest.mark.parametrize("platform", ["cuda"], indirect=True)
def test_cpu_kv_cache_space_is_the_cpus_only(tiny, monkeypatch, platform):
    """On CUDA the cache follows gpu_memory_utilization unless --kv-cache-memory is given."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert EngineArgs(model=tiny).create_engine_config().cache_config.kv_cache_memory is None
    config = EngineArgs(model=tiny, kv_cache_memory="512MiB").create_engine_config()
    assert config.cache_config.kv_cache_memory == 512 * 1024**2


def test_sub_configs(tiny):
    config = EngineArgs(model=tiny, tokenizer=tiny, served_model_name="m", max_num_seqs=4,
                        max_num_batched_tokens=512, enable_chunked_prefill=False,
                        max_model_len=256, num_gpu_blocks_override=10,
                        gpu_memory_utilization=0.5,
                        distributed_executor_backend="uni").create_engine_config()
    assert config.model_config.served_model_name == "m"
    assert config.model_config.tokenizer == tiny
    assert config.scheduler_config.max_num_batched_tokens == 512
    assert config.scheduler_config.enable_chunked_prefill is False
    assert config.cache_config.num_gpu_blocks_override == 10
    assert config.cache_config.gpu_memory_utilization == 0.5
    assert config.parallel_config.distributed_executor_backend == "uni"


def test_upstream_model_and_parallel_flags(tiny):
    """Flags upstream's scripts pass: they parse and reach the configs (or are refused by
    name where this engine cannot do it)."""
    config = from_argv("--model", tiny, "-pp", "1", "-dp", "1", "--disable-custom-all-reduce",
                       "--tokenizer-mode", "slow", "--generation-config", "vllm",
                       "--override-generation-config", '{"temperature": 0.5}',
                       ).create_engine_config()
    mc = config.model_config
    assert (mc.tokenizer_mode, mc.generation_config) == ("slow", "vllm")
    assert mc.override_generation_config == {"temperature": 0.5}
    assert config.parallel_config.pipeline_parallel_size == 1
    assert from_argv("--model", tiny, "-pp", "2", "--distributed-executor-backend", "mp"
                     ).create_engine_config().parallel_config.pipeline_parallel_size == 2
    with pytest.raises(ValueError, match="data_parallel_size > 1 is not supported"):
        from_argv("--model", tiny, "--data-parallel-size", "2").create_engine_config()


def test_upstream_compat_args_accepted_off_or_refused_by_name(tiny, caplog):
    """Scripts pass upstream's arguments explicitly (quantization=args.quantization, seed=None,
    revision=..., swap_space=...): accepted where they change nothing here (a warning for the
    ignored ones), refused by name where they ask for a missing feature."""
    import logging

    with caplog.at_level(logging.WARNING, logger="vllm"):
        config = EngineArgs(model=tiny, quantization=None, seed=None, revision="main",
                            download_dir="/tmp", swap_space=8, cpu_offload_gb=0,
                            enable_lora=False, async_scheduling=False,
                            model_impl="auto", calculate_kv_scales=False,
                            kv_cache_dtype="fp8").create_engine_config()
    assert config.model_config.seed == 0
    assert "revision='main' is ignored" in caplog.text and "swap_space is ignored" in caplog.text
    for kwargs, match in [({"quantization": "fp8"}, "no online quantization"),
                          ({"enable_lora": True}, "enable_lora=True .* no LoRA"),
                          ({"cpu_offload_gb": 4}, "cpu_offload_gb=4"),
                          ({"model_impl": "transformers"}, "model_impl='transformers'"),
                          ({"calculate_kv_scales": True},
                           "calculate_kv_scales=True .* from the checkpoint, else 1.0")]:
        with pytest.raises(ValueError, match=match):
            EngineArgs(model=tiny, **kwargs).create_engine_config()
    args = from_argv("--model", tiny, "--revision", "main", "--swap-space", "2",
                     "--hf-overrides", '{"rope_theta": 1234.0}', "--no-async-scheduling",
                     "--kv-cache-dtype", "fp8_e5m2")
    assert (args.revision, args.swap_space, args.async_scheduling) == ("main", 2.0, False)
    assert args.kv_cache_dtype == "fp8_e5m2" and args.calculate_kv_scales is False
    with pytest.raises(ValueError, match="calculate_kv_scales=True is not supported"):
        from_argv("--model", tiny, "--calculate-kv-scales").create_engine_config()
    overridden = args.create_engine_config()
    assert overridden.model_config.hf_config.rope_theta == 1234.0
    assert overridden.model_config.compute_hash() != config.model_config.compute_hash()


def test_several_served_model_names(tiny):
    """`--served-model-name a b` (nargs=+ as upstream): all accepted, the first reported."""
    config = from_argv("--model", tiny, "--served-model-name", "main",
                       "alias").create_engine_config()
    assert config.model_config.served_model_names == ["main", "alias"]
    one = from_argv("--model", tiny, "--served-model-name", "m").create_engine_config()
    assert one.model_config.served_model_names == ["m"]
    default = EngineArgs(model=tiny).create_engine_config().model_config
    assert default.served_model_names == [tiny]


@pytest.mark.parametrize("shape, tp, match", [
    ({}, 3, r"attention heads \(4\) must be divisible by tensor_parallel_size \(3\)"),
    ({"num_attention_heads": 6, "num_key_value_heads": 4, "hidden_size": 96}, 3,
     r"KV heads \(4\) and tensor_parallel_size \(3\)"),
    ({"intermediate_size": 130}, 4, r"intermediate_size \(130\)"),
])
def test_tp_size_must_split_the_model(tmp_path, shape, tp, match):
    """Checked when the config is resolved, before any worker process starts, naming the
    dimension; fewer KV heads than ranks is fine (they are replicated)."""
    from transformers import LlamaConfig

    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                "architectures": ["LlamaForCausalLM"]}
    LlamaConfig(**{**base, **shape}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(tmp_path), tensor_parallel_size=tp).create_engine_config()
    LlamaConfig(**base).save_pretrained(tmp_path)
    config = EngineArgs(model=str(tmp_path), tensor_parallel_size=4).create_engine_config()
    assert config.parallel_config.tensor_parallel_size == 4


@pytest.mark.parametrize("kwargs, match", [
    ({"served_model_name": []}, "served_model_name"),
    ({"served_model_name": ["a", ""]}, "served_model_name"),
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"block_size": 0}, "block_size"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"), ({"max_model_len": -1}, "max_model_len"),
    ({"dtype": "int3"}, "dtype"), ({"model": "/nonexistent/model"}, "not a local folder"),
])
def test_invalid_values_raise_value_error(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**{"model": tiny, **kwargs}).create_engine_config()
