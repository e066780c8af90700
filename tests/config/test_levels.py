"""Every level x {no model, dense, FP8, MoE} x {cpu, cuda (simulated)} resolves to the level
table of DESIGN.md §3, with the right provenance. The expected values are written out here
independently of vllm/config/levels.py."""
from __future__ import annotations

import pytest

from tests.config import model_configs
from vllm.config import CompilationMode, CUDAGraphMode, OptimizationLevel, VllmConfig
from vllm.config.capture_sizes import default_capture_sizes
from vllm.config.vllm import ATTENTION_OPS, ConfigSource

LEVELS = [0, 1, 2, 3]
CPU_NARROWED_AT_O3 = ("compilation_config.max_autotune",
                      "compilation_config.coordinate_descent_tuning",
                      "compilation_config.compile_sizes")
MODELS = ["none", "dense", "fp8", "moe"]
PLATFORMS = ["cpu", "cuda"]


def expected(level: int, model: str, platform: str) -> dict:
    """(With the TORCH_SDPA attention backend, which runs no batch inside a full CUDA graph.)"""
    fp8 = model == "fp8"  # the fp8 helper uses static activation scales
    cuda = platform == "cuda"
    # The levels' FULL_AND_PIECEWISE keeps only its pieces: TORCH_SDPA cannot run inside a
    # full graph (TRITON_ATTN keeps it: test_cudagraph_rules.py).
    graphs = {0: CUDAGraphMode.NONE, 1: CUDAGraphMode.PIECEWISE,
              2: CUDAGraphMode.PIECEWISE, 3: CUDAGraphMode.PIECEWISE}[level]
    # CUDA turns the levels' attention fusion off: with TORCH_SDPA it would cost every CUDA
    # graph (attention inside one compiled graph, which only full graphs could capture).
    attn_fusion = fp8 and level >= 2 and not cuda
    if level == 0:
        splitting = []
    elif attn_fusion:
        splitting = []
    elif level == 3 and not cuda:  # CPU O3: one whole-graph compile, no pieces
        splitting = []
    else:
        splitting = ATTENTION_OPS
    return {
        "compilation_config.mode": CompilationMode.NONE if level == 0
        else CompilationMode.VLLM_COMPILE,
        "compilation_config.cudagraph_mode": graphs if cuda else CUDAGraphMode.NONE,
        "compilation_config.use_inductor_graph_partition": False,
        # CPU: Inductor freezing off at every level (prepacked linears instead: as fast and
        # cacheable); the O3 tuning switches measured no faster than O2, so the CPU narrows
        # them off (platform provenance).
        "compilation_config.freezing": False,
        "compilation_config.prepack_linear_weights": level >= 2 and not cuda,
        "compilation_config.max_autotune": level == 3 and cuda,
        "compilation_config.coordinate_descent_tuning": level == 3 and cuda,
        "compilation_config.compile_sizes": [1, 2, 4, 8, 16] if level == 3 and cuda else [],
        # CPU O2/O3: C++ host code (Inductor's C++ wrapper; measured faster on the CPU only).
        "compilation_config.cpp_wrapper": level >= 2 and not cuda,
        "compilation_config.pass_config.eliminate_noops": level >= 1,
        "compilation_config.pass_config.fuse_norm_quant": fp8 and level >= 1,
        "compilation_config.pass_config.fuse_act_quant": fp8 and level >= 1,
        "compilation_config.pass_config.fuse_attn_quant": attn_fusion,
        "compilation_config.pass_config.fuse_allreduce_rms": False,
        "compilation_config.splitting_ops": splitting,
        "compilation_config.custom_ops": ["all"] if level == 0 else ["none"],
    }


@pytest.mark.parametrize("platform", PLATFORMS, indirect=True)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("level", LEVELS)
def test_level_table(level, model, platform, monkeypatch):
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TORCH_SDPA")
    config = VllmConfig(model_config=model_configs.MODELS[model](), optimization_level=level)
    assert config.optimization_level == OptimizationLevel(level)
    for path, value in expected(level, model, platform.device_name).items():
        assert config.get_path(path) == value, path
    # Provenance: the level filled every leaf of its table, except what the platform's own
    # table sets (each with its reason) and the derived CUDA-graph rule.
    split_source = config.provenance["compilation_config.splitting_ops"]
    if platform.is_cpu() and level == 3:
        assert split_source.label == "platform cpu"
        assert "whole-graph" in split_source.reason and " x1." in split_source.reason
    else:
        assert split_source.source is ConfigSource.DERIVED
    for path in expected(level, model, platform.device_name):
        if path in ("compilation_config.splitting_ops", "compilation_config.custom_ops"):
            continue
        source = config.provenance[path].label
        name = path.rsplit(".", 1)[-1]
        if platform.is_cpu() and (
                name == "cudagraph_mode"
                or (name in ("fuse_norm_quant", "fuse_act_quant") and level >= 1)
                or (name in ("fuse_attn_quant", "prepack_linear_weights", "cpp_wrapper",
                             "fuse_allreduce_rms") and level >= 2)):
            assert source == "platform cpu", path
            assert config.provenance[path].reason, path
        elif name == "fuse_attn_quant" and platform.is_cuda() and level >= 2:
            assert source == "platform cuda", path
        elif name == "cudagraph_mode" and platform.is_cuda() and level >= 2:
            assert source == "derived: downgrade from FULL_AND_PIECEWISE", path
            assert "TORCH_SDPA attention backend" in config.provenance[path].reason
        elif path in CPU_NARROWED_AT_O3 and platform.is_cpu() and level == 3:
            assert source == "platform cpu", path
            reason = config.provenance[path].reason
            assert reason.startswith("not faster than O2 on the CPU (") and " x1." in reason
        else:
            assert source == f"level O{level}", path


@pytest.mark.parametrize("platform", ["cuda"], indirect=True)
@pytest.mark.parametrize("level", [1, 2, 3])
def test_cuda_capture_sizes(level, platform):
    config = VllmConfig(model_config=model_configs.dense(), optimization_level=level)
    cc = config.compilation_config
    # max = min(2 x max_num_seqs (256), 512, max_num_batched_tokens (8192)) = 512
    assert cc.max_cudagraph_capture_size == 512
    assert cc.cudagraph_capture_sizes[:5] == [1, 2, 4, 8, 16]
    assert cc.cudagraph_capture_sizes == default_capture_sizes(512)
    assert 256 in cc.cudagraph_capture_sizes and 264 not in cc.cudagraph_capture_sizes


@pytest.mark.parametrize("platform", PLATFORMS, indirect=True)
def test_level_not_in_hash(platform, monkeypatch):
    """The level itself is not part of the hash; only what it resolves to. (On CUDA with
    TRITON_ATTN, whose decode batches run inside full graphs: with TORCH_SDPA, O2 keeps only
    O1's piecewise graphs for this dense model, so the two resolve alike.)"""
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TRITON_ATTN")
    model = model_configs.dense()
    by_level = {lvl: VllmConfig(model_config=model, optimization_level=lvl).compute_hash()
                for lvl in LEVELS}
    # Four different resolved configs (on the CPU, O3 differs from O2 by its whole-graph
    # compile only: its tuning switches measured no faster there).
    assert len(set(by_level.values())) == 4
    explicit_o0 = VllmConfig(model_config=model, optimization_level=2,
                             compilation_config={"mode": 0, "cudagraph_mode": "NONE",
                                                 "pass_config": {"eliminate_noops": False},
                                                 "prepack_linear_weights": False,
                                                 "cpp_wrapper": False,
                                                 "use_inductor_graph_partition": False})
    assert explicit_o0.compute_hash() == by_level[0]


def test_level_enum_is_exported_at_the_top():
    """`from vllm import LLM, OptimizationLevel` (and the compilation enums), as documented."""
    import vllm

    assert vllm.OptimizationLevel is OptimizationLevel
    assert vllm.CompilationMode is CompilationMode and vllm.CUDAGraphMode is CUDAGraphMode


def test_default_level_is_o2():
    config = VllmConfig()
    assert config.optimization_level == OptimizationLevel.O2
    assert config.provenance["optimization_level"].label == "default"


@pytest.mark.parametrize("spelling", [2, "2", "O2", "o2", OptimizationLevel.O2])
def test_level_spellings(spelling):
    assert VllmConfig(optimization_level=spelling).optimization_level == OptimizationLevel.O2


@pytest.mark.parametrize("bad", [4, -1, "fast", "O5", "", 2.5, True])
def test_bad_level_is_clear_error(bad):
    with pytest.raises(ValueError, match="optimization level"):
        VllmConfig(optimization_level=bad)


def test_summary_line_names_level_mode_graphs_passes(cpu_platform):
    line = VllmConfig(model_config=model_configs.fp8(), optimization_level=1).summary_line()
    assert "O1" in line and "VLLM_COMPILE" in line and "CUDA graphs NONE" in line
    assert "fuse_norm_quant" in line and "fuse_act_quant" in line and "eliminate_noops" in line


def test_explain_has_a_row_per_level_field_with_reason():
    config = VllmConfig(model_config=model_configs.moe(), optimization_level=1)
    rows = {path: prov for path, _, prov in config.explain()}
    assert rows["compilation_config.pass_config.fuse_norm_quant"].reason.startswith(
        "model is FP8-quantized: no")
    assert rows["model_config.dtype"].label == f"platform {config.platform.device_name}"
    text = config.explain_text()
    assert "level O1" in text and "source" in text.splitlines()[0]


@pytest.mark.parametrize("platform", ["cpu"], indirect=True)
def test_cpu_fusion_defaults_carry_their_measurements(platform):
    config = VllmConfig(model_config=model_configs.fp8(), optimization_level=2)
    for name in ("fuse_norm_quant", "fuse_act_quant", "fuse_attn_quant"):
        prov = config.provenance[f"compilation_config.pass_config.{name}"]
        assert prov.label == "platform cpu" and "CPU:" in prov.reason and "x" in prov.reason
        assert prov.reason.startswith("model is FP8")
    explicit = VllmConfig(model_config=model_configs.fp8(), optimization_level=2,
                          compilation_config={"pass_config": {"fuse_norm_quant": True}})
    assert explicit.provenance["compilation_config.pass_config.fuse_norm_quant"].reason == (
        "set explicitly")
