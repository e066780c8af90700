"""The config that runs is the config resolved (issue 20): nothing changes the resolved config
after `VllmConfig.__post_init__`, and the engine runs what `vllm config` prints (compile mode,
CUDA-graph mode, passes)."""
from __future__ import annotations

import pytest
import torch

try:
    from tests.model_executor.hf_checkpoints import lazy_checkpoints
except ImportError:  # tests/ itself on sys.path
    from model_executor.hf_checkpoints import lazy_checkpoints

from vllm import LLM, SamplingParams
from vllm.config import CompilationMode, CUDAGraphMode
from vllm.config.vllm import ConfigSource, cudagraph_mode_for_backend
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import reset_current_platform

ENGINE = {"max_model_len": 64, "max_num_batched_tokens": 16, "max_num_seqs": 4,
          "kv_cache_memory": "8MiB", "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return lazy_checkpoints(tmp_path_factory.mktemp("resolved"))


def compile_states(model: torch.nn.Module) -> list:
    """The compile state of each compiled module (vllm/compilation/decorators.py; none at
    -O0, where the decorator is a no-op)."""
    return [m.__dict__["_vllm_compile_state"] for m in model.modules()
            if m.__dict__.get("_vllm_compile_state") is not None]


@pytest.mark.parametrize("level", [0, 2])
def test_engine_runs_the_printed_config(checkpoints, level, cpu_platform):
    """-O0 and the default -O2 on the CPU (the eager compile backend runs our passes without
    codegen): the resolution `vllm config` prints equals the engine's config after start-up
    and after serving, and the compiled model was built from that very config."""
    path = checkpoints("llama")
    kwargs = {"optimization_level": level, "compilation_config": {"backend": "eager"}, **ENGINE}
    printed = EngineArgs(model=path, **kwargs).create_engine_config()
    table = printed.explain_json()

    llm = LLM(model=path, **kwargs)
    engine_config = llm.llm_engine.vllm_config
    assert engine_config.explain_json() == table
    assert engine_config.compilation_config.compute_hash() == \
        printed.compilation_config.compute_hash()
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4,
                                                                       ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert engine_config.explain_json() == table  # serving changed nothing either

    cc = engine_config.compilation_config
    runner = llm.llm_engine.executor.worker.model_runner
    # CUDA graphs: what was resolved (NONE on the CPU), and nothing captured.
    assert runner._resolved_cudagraph_mode() == cc.cudagraph_mode == CUDAGraphMode.NONE
    assert runner.cudagraph_dispatcher is None
    states = compile_states(runner.model)
    if cc.mode == CompilationMode.NONE:
        assert level == 0 and states == []
    else:
        # Compiled from the engine's config object itself, in the resolved mode, with the
        # resolved passes.
        assert states and all(s.vllm_config is engine_config and s.mode == cc.mode
                              for s in states)
        backends = [s.vllm_backend for s in states if s.vllm_backend is not None]
        assert backends  # traced and compiled at start-up (no compile cache with "eager")
        enabled = cc.pass_config.enabled_passes()
        assert "eliminate_noops" in enabled
        for backend in backends:
            manager = backend.pass_manager
            assert manager.pass_config_hash == cc.pass_config.compute_hash()
            assert len(manager.passes) == len(enabled)
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("level", [1, 2, 3])
def test_cuda_resolution_shows_the_mode_the_runner_runs(level, monkeypatch, checkpoints):
    """CUDA simulated, TORCH_SDPA (no batch inside a full CUDA graph): the resolved config
    already shows the narrowed mode, with its reason, and it is one the runner accepts for
    that backend (the runner no longer narrows it after resolution)."""
    from vllm.attention.selector import default_backend

    monkeypatch.setenv("VLLM_PLATFORM", "cuda")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TORCH_SDPA")
    reset_current_platform()
    config = EngineArgs(model=checkpoints("llama"), optimization_level=level,
                        **ENGINE).create_engine_config()
    cc = config.compilation_config
    assert cc.cudagraph_mode == CUDAGraphMode.PIECEWISE
    prov = config.provenance["compilation_config.cudagraph_mode"]
    if level >= 2:
        assert prov.source is ConfigSource.DERIVED
        assert prov.name == "downgrade from FULL_AND_PIECEWISE"
        assert "TORCH_SDPA attention backend cannot run inside a full CUDA graph" in prov.reason
    else:
        assert prov.source is ConfigSource.LEVEL
    assert f"CUDA graphs {cc.cudagraph_mode}" in config.summary_line()
    support = default_backend().cudagraph_support
    assert cudagraph_mode_for_backend(cc.cudagraph_mode, support,
                                      config.piecewise_compiled) == cc.cudagraph_mode
    # Capture sizes follow the resolved mode (piecewise graphs are captured).
    assert cc.cudagraph_capture_sizes and cc.max_cudagraph_capture_size > 0
