"""CUDA-graph mode resolution and capture sizes (DESIGN.md §3; upstream-levels.md §5)."""
from __future__ import annotations

import logging

import pytest

from tests.config import model_configs
from vllm.config import CompilationMode, CUDAGraphMode, SchedulerConfig, VllmConfig
from vllm.config.vllm import ATTENTION_OPS, ConfigSource

cuda = pytest.mark.parametrize("platform", ["cuda"], indirect=True)
cpu = pytest.mark.parametrize("platform", ["cpu"], indirect=True)


@pytest.fixture(autouse=True)
def _triton_attn(monkeypatch):
    """CUDA's default backend where Triton is installed (uniform decode batches inside full
    CUDA graphs); a test that needs another sets VLLM_ATTENTION_BACKEND itself."""
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TRITON_ATTN")


def test_mode_helpers():
    m = CUDAGraphMode
    assert m.FULL_AND_PIECEWISE.decode_mode() == m.FULL
    assert m.FULL_AND_PIECEWISE.mixed_mode() == m.PIECEWISE
    assert m.FULL_DECODE_ONLY.mixed_mode() == m.NONE
    assert m.PIECEWISE.without_piecewise() == m.NONE
    assert m.FULL_AND_PIECEWISE.without_piecewise() == m.FULL_DECODE_ONLY
    assert m.FULL.requires_piecewise_compilation() is False
    assert m.FULL_AND_PIECEWISE.has_full_cudagraphs() and not m.PIECEWISE.has_full_cudagraphs()
    assert not m.NONE and m.FULL
    assert str(m.FULL_DECODE_ONLY) == "FULL_DECODE_ONLY"
    assert m.parse("full_and_piecewise") == m.FULL_AND_PIECEWISE
    with pytest.raises(ValueError, match="Valid modes are: NONE, PIECEWISE"):
        m.parse("fast")


@cuda
@pytest.mark.parametrize("level,stock,expected", [
    (1, CompilationMode.STOCK_TORCH_COMPILE, CUDAGraphMode.NONE),
    (2, CompilationMode.STOCK_TORCH_COMPILE, CUDAGraphMode.FULL_DECODE_ONLY),
    (2, CompilationMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY),
])
def test_piecewise_needs_vllm_compile(level, stock, expected, platform, caplog):
    with caplog.at_level(logging.INFO, logger="vllm"):
        config = VllmConfig(model_config=model_configs.dense(), optimization_level=level,
                            compilation_config={"mode": stock})
    assert config.compilation_config.cudagraph_mode == expected
    prov = config.provenance["compilation_config.cudagraph_mode"]
    assert prov.source is ConfigSource.DERIVED and prov.name.startswith("downgrade from ")
    assert "VLLM_COMPILE" in prov.reason
    assert "CUDA graph mode" in caplog.text


@cuda
@pytest.mark.parametrize("level,expected", [(1, CUDAGraphMode.NONE),
                                            (2, CUDAGraphMode.FULL_DECODE_ONLY)])
def test_empty_splitting_ops_downgrade(level, expected, platform):
    """No pieces: O2's FULL_AND_PIECEWISE keeps its full part (FULL), which TRITON_ATTN runs
    for uniform decode batches only (FULL_DECODE_ONLY); both steps are in the reason."""
    config = VllmConfig(model_config=model_configs.dense(), optimization_level=level,
                        compilation_config={"splitting_ops": [],
                                            "use_inductor_graph_partition": False})
    assert config.compilation_config.cudagraph_mode == expected
    prov = config.provenance["compilation_config.cudagraph_mode"]
    assert "splitting_ops is empty" in prov.reason
    assert prov.label == f"derived: downgrade from {['PIECEWISE', 'FULL_AND_PIECEWISE'][level - 1]}"
    if level == 2:
        assert "; then FULL -> FULL_DECODE_ONLY: the TRITON_ATTN attention backend runs only " \
            "uniform single token decode batches" in prov.reason


@cuda
def test_explicit_piecewise_that_cannot_be_honoured_is_error(platform):
    with pytest.raises(ValueError, match="cudagraph_mode=PIECEWISE cannot be honoured"):
        VllmConfig(model_config=model_configs.dense(),
                   compilation_config={"cudagraph_mode": "PIECEWISE", "splitting_ops": [],
                                       "use_inductor_graph_partition": False})
    with pytest.raises(ValueError, match="VLLM_COMPILE"):
        VllmConfig(model_config=model_configs.dense(), optimization_level=0,
                   compilation_config={"cudagraph_mode": "PIECEWISE"})


@cpu
def test_cpu_has_no_graphs_and_refuses_explicit_ones(platform):
    config = VllmConfig(model_config=model_configs.dense(), optimization_level=2)
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert config.compilation_config.cudagraph_capture_sizes == []
    with pytest.raises(ValueError, match="cudagraph_mode=FULL cannot be honoured on the "
                       "cpu.*unset or set it to NONE"):
        VllmConfig(model_config=model_configs.dense(),
                   compilation_config={"cudagraph_mode": "FULL"})
    with pytest.raises(ValueError, match="use_inductor_graph_partition"):
        VllmConfig(compilation_config={"use_inductor_graph_partition": True})


@cuda
def test_attn_fusion_needs_attention_inside_the_graph(platform):
    """Asked for explicitly, the fusion takes attention into one compiled graph: no pieces,
    full CUDA graphs only; splitting at attention as well is a clear error."""
    fused = {"pass_config": {"fuse_attn_quant": True}}
    config = VllmConfig(model_config=model_configs.fp8(), optimization_level=2,
                        compilation_config=fused)
    cc = config.compilation_config
    assert cc.pass_config.fuse_attn_quant is True
    # FULL (no pieces), which TRITON_ATTN runs for uniform decode batches only
    assert cc.splitting_ops == [] and cc.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    with pytest.raises(ValueError, match="fuse_attn_quant"):
        VllmConfig(model_config=model_configs.fp8(), optimization_level=2,
                   compilation_config={**fused,
                                       "splitting_ops": ["vllm::unified_attention_with_output"]})


@cuda
@pytest.mark.parametrize("backend, why", [
    ("TORCH_SDPA", "cannot run inside a full CUDA graph"),
    ("TRITON_ATTN", "runs only uniform single token decode batches inside full CUDA graphs")])
@pytest.mark.parametrize("level", [2, 3])
def test_level_attn_fusion_gives_way_to_piecewise_graphs(level, backend, why, platform,
                                                         monkeypatch):
    """The levels' fusion would leave the batches an attention backend cannot run inside a
    full CUDA graph (TORCH_SDPA: all; TRITON_ATTN: all but uniform decode) with no CUDA graph
    at all: the CUDA platform turns it off and keeps the pieces."""
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", backend)
    config = VllmConfig(model_config=model_configs.fp8(), optimization_level=level)
    cc = config.compilation_config
    assert cc.pass_config.fuse_attn_quant is False
    prov = config.provenance["compilation_config.pass_config.fuse_attn_quant"]
    assert prov.label == "platform cuda"
    assert "the attention backend runs every batch inside full CUDA graphs" in prov.reason
    assert ": no; " in prov.reason
    assert cc.splitting_ops == ATTENTION_OPS
    # The pieces are kept; what runs in full graphs is what the backend can run there.
    graphs = config.provenance["compilation_config.cudagraph_mode"]
    if backend == "TORCH_SDPA":
        assert cc.cudagraph_mode == CUDAGraphMode.PIECEWISE
        assert f"the {backend} attention backend {why}" in graphs.reason
    else:
        assert cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
        assert graphs.label == f"level O{level}"
    # The other FP8 fusions stay on.
    assert cc.pass_config.fuse_norm_quant and cc.pass_config.fuse_act_quant
    # Without CUDA graphs nothing is lost: the level's fusion stays.
    no_graphs = VllmConfig(model_config=model_configs.fp8(), optimization_level=level,
                           compilation_config={"cudagraph_mode": "NONE"})
    assert no_graphs.compilation_config.pass_config.fuse_attn_quant is True


@cuda
@pytest.mark.parametrize("level", [1, 2, 3])
def test_inductor_graph_partition_is_off_and_refused(level, platform):
    """Our backend splits the graph itself: the flag would change nothing, so asking for it
    is an error that says so, not a silent no-op."""
    config = VllmConfig(model_config=model_configs.dense(), optimization_level=level)
    assert config.compilation_config.use_inductor_graph_partition is False
    with pytest.raises(ValueError, match="use_inductor_graph_partition=True is not supported"):
        VllmConfig(model_config=model_configs.dense(), optimization_level=level,
                   compilation_config={"use_inductor_graph_partition": True})


@cuda
@pytest.mark.parametrize("max_num_seqs,sizes,max_size,expected_max", [
    (128, None, None, 256),
    (256, None, None, 512),
    (1, None, None, 2),
    (128, None, 257, 256),
    (128, [1, 2, 100, 100, 4], None, 100),
    (128, [1, 2, 100], 100, 100),
])
def test_capture_sizes(max_num_seqs, sizes, max_size, expected_max, platform):
    cc = {}
    if sizes is not None:
        cc["cudagraph_capture_sizes"] = sizes
    if max_size is not None:
        cc["max_cudagraph_capture_size"] = max_size
    config = VllmConfig(model_config=model_configs.dense(), compilation_config=cc,
                        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs))
    result = config.compilation_config
    assert result.max_cudagraph_capture_size == expected_max
    assert result.cudagraph_capture_sizes[-1] == expected_max
    assert result.cudagraph_capture_sizes == sorted(set(result.cudagraph_capture_sizes))
    if sizes is None:
        assert max_num_seqs in result.cudagraph_capture_sizes
    if max_size is not None and max_size != expected_max:
        prov = config.provenance["compilation_config.max_cudagraph_capture_size"]
        assert "truncated" in prov.reason


@cuda
def test_inconsistent_capture_sizes_error(platform):
    with pytest.raises(ValueError, match="should be consistent"):
        VllmConfig(model_config=model_configs.dense(),
                   compilation_config={"cudagraph_capture_sizes": [1, 2, 4],
                                       "max_cudagraph_capture_size": 8})


@cuda
def test_compile_sizes_expand_capture_sizes(platform):
    config = VllmConfig(model_config=model_configs.dense(),
                        compilation_config={"compile_sizes": ["cudagraph_capture_sizes", 16],
                                            "cudagraph_capture_sizes": [1, 2, 4]})
    assert config.compilation_config.compile_sizes == [1, 2, 4, 16]
    # 3 tokens run padded to the captured 4: a static compile for 3 would never run.
    with pytest.raises(ValueError, match="entry 3 would be padded to 4"):
        VllmConfig(model_config=model_configs.dense(),
                   compilation_config={"compile_sizes": ["cudagraph_capture_sizes", 3],
                                       "cudagraph_capture_sizes": [1, 2, 4]})
