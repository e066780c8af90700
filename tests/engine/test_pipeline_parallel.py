"""Pipeline parallelism: the layer split rule (and VLLM_PP_LAYER_PARTITION), config
validation, the micro-batch split, each stage's own module tree and compile-cache key, and end
to end with the mp executor: PP=2 (and TP=2 x PP=2) greedy tokens equal transformers' (the
prefill of three prompts runs as two micro-batches)."""
from __future__ import annotations

import pytest
import torch
from engine_test_utils import MAX_TOKENS, PROMPTS

from vllm.config import ParallelConfig
from vllm.distributed import parallel_state
from vllm.distributed.parallel_state import GroupCoordinator
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.pipeline import (
    PP_PARTITION_ENV,
    PPMissingLayer,
    get_pp_indices,
    is_pp_missing_parameter,
    pp_partition,
)


@pytest.fixture
def no_partition(monkeypatch):
    monkeypatch.delenv(PP_PARTITION_ENV, raising=False)


def test_default_split_gives_the_remainder_to_the_stages_before_the_last(no_partition):
    assert [get_pp_indices(10, r, 4) for r in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert pp_partition(24, 2) == [(0, 12), (12, 24)]
    assert pp_partition(5, 3) == [(0, 2), (2, 4), (4, 5)]  # the last stage gets fewer
    assert pp_partition(3, 1) == [(0, 3)]
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is more than the model's 2"):
        pp_partition(2, 3)


def test_layer_partition_env(monkeypatch):
    monkeypatch.setenv(PP_PARTITION_ENV, "1,3")
    assert pp_partition(4, 2) == [(0, 1), (1, 4)]
    for value, match in [("2,3", "sums to 5 layers; the model has 4"),
                         ("4", "names 1 stages; pipeline_parallel_size is 2"),
                         ("4,0", "at least one layer"), ("2,x", "comma-separated")]:
        monkeypatch.setenv(PP_PARTITION_ENV, value)
        with pytest.raises(ValueError, match=match):
            pp_partition(4, 2)


def test_engine_config_validates_pipeline_parallel(llama_path, monkeypatch):
    monkeypatch.setenv(PP_PARTITION_ENV, "1,2")
    with pytest.raises(ValueError, match=r"VLLM_PP_LAYER_PARTITION='1,2' sums to 3 layers; "
                                         "the model has 2"):
        EngineArgs(model=llama_path, pipeline_parallel_size=2,
                   distributed_executor_backend="mp").create_engine_config()
    monkeypatch.delenv(PP_PARTITION_ENV)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is more than"):
        EngineArgs(model=llama_path, pipeline_parallel_size=3,
                   distributed_executor_backend="mp").create_engine_config()
    # (GPT-2 and OPT refuse it: tests/model_executor/test_pp_families.py)
    config = EngineArgs(model=llama_path, pipeline_parallel_size=2, tensor_parallel_size=2,
                        distributed_executor_backend="mp").create_engine_config()
    assert config.parallel_config.world_size == 4


def test_parallel_config_backends(monkeypatch):
    assert ParallelConfig(tensor_parallel_size=2,
                          distributed_executor_backend="ray").distributed_executor_backend == "ray"
    with pytest.raises(ValueError, match="'uni', 'mp', 'ray', got 'slurm'"):
        ParallelConfig(distributed_executor_backend="slurm")
    from vllm.config import parallel

    monkeypatch.setattr(parallel, "local_device_count", lambda: 2)
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    # More ranks than this machine holds: Ray where it is installed, else local processes.
    import importlib.util

    real_find_spec = importlib.util.find_spec
    for ray_installed, backend in ((True, "ray"), (False, "mp")):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, _r=ray_installed:
                            (object() if _r else None) if name == "ray"
                            else real_find_spec(name, *a))
        assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2
                              ).distributed_executor_backend == backend
    assert ParallelConfig().distributed_executor_backend == "uni"


def test_micro_batches_split_the_requests_by_tokens(monkeypatch):
    from vllm.engine.sched_output import SchedulerOutput
    from vllm.model_executor.models.pipeline import split_micro_batches

    monkeypatch.delenv("VLLM_PP_MICRO_BATCHES", raising=False)

    def split(tokens: dict[str, int], pp: int, micro: int | None = None) -> list[dict[str, int]]:
        monkeypatch.setenv("VLLM_PP_MICRO_BATCHES", str(micro or pp))  # one per stage
        so = SchedulerOutput([], [], tokens, sum(tokens.values()))
        parts = split_micro_batches(so, pp)
        assert all(p.total_num_scheduled_tokens == sum(p.num_scheduled_tokens.values())
                   for p in parts)
        return [p.num_scheduled_tokens for p in parts]

    assert split({"a": 1, "b": 1, "c": 1, "d": 1}, 2) == [{"a": 1, "b": 1}, {"c": 1, "d": 1}]
    assert split({"a": 10, "b": 1, "c": 1}, 2) == [{"a": 10}, {"b": 1, "c": 1}]
    assert split({"a": 1, "b": 1, "c": 10}, 3) == [{"a": 1}, {"b": 1}, {"c": 10}]
    assert split({"a": 5}, 2) == [{"a": 5}]
    assert split({"a": 1, "b": 1}, 1) == [{"a": 1, "b": 1}]
    assert split({"a": 1, "b": 1}, 2, micro=1) == [{"a": 1, "b": 1}]
    # Unset: the whole batch stage by stage (measured faster, see num_micro_batches).
    monkeypatch.delenv("VLLM_PP_MICRO_BATCHES")
    so = SchedulerOutput([], [], {"a": 1, "b": 1, "c": 1}, 3)
    assert [p.num_scheduled_tokens for p in split_micro_batches(so, 3)] == [
        {"a": 1, "b": 1, "c": 1}]
    monkeypatch.setenv("VLLM_PP_MICRO_BATCHES", "0")
    with pytest.raises(ValueError, match="VLLM_PP_MICRO_BATCHES='0' must be a positive"):
        split_micro_batches(SchedulerOutput([], [], {"a": 1, "b": 1}, 2), 2)


@pytest.fixture
def stage(monkeypatch):
    """stage(rank, size): pretend this process is pipeline stage `rank` of `size`."""
    def set_stage(rank: int, size: int) -> None:
        monkeypatch.setattr(parallel_state, "_PP", GroupCoordinator(
            group=None, rank_in_group=rank, world_size=size, ranks=list(range(size))))
    return set_stage


def _build(path: str, pp: int):
    from vllm.config import ModelConfig, VllmConfig
    from vllm.model_executor.model_loader import get_model

    config = VllmConfig(model_config=ModelConfig(model=path, dtype="float32"),
                        parallel_config=ParallelConfig(pipeline_parallel_size=pp,
                                                       distributed_executor_backend="mp"),
                        optimization_level=0)
    return get_model(config)


def test_each_stage_holds_its_layers_and_loads_only_their_weights(llama_path, stage,
                                                                  no_partition):
    stage(0, 2)
    first = _build(llama_path, 2)
    stage(1, 2)
    last = _build(llama_path, 2)
    assert not isinstance(first.model.layers[0], PPMissingLayer)
    assert isinstance(first.model.layers[1], PPMissingLayer)
    assert isinstance(first.model.norm, PPMissingLayer)
    assert isinstance(first.lm_head, PPMissingLayer)
    assert first.compute_logits(torch.zeros(1, 64)) is None
    assert list(first.attention_layers) == ["model.layers.0.self_attn.attn"]
    assert isinstance(last.model.layers[0], PPMissingLayer)
    assert isinstance(last.model.embed_tokens, PPMissingLayer)  # (not tied)
    assert list(last.attention_layers) == ["model.layers.1.self_attn.attn"]
    assert is_pp_missing_parameter("model.layers.0.mlp.down_proj.weight", last)
    assert is_pp_missing_parameter("model.embed_tokens.weight", last)
    assert not is_pp_missing_parameter("model.layers.1.mlp.down_proj.weight", last)
    assert not is_pp_missing_parameter("lm_head.weight", last)
    # Stage by stage in one process equals the whole model (the weights each loaded).
    stage(0, 1)
    whole = _build(llama_path, 1)
    torch.testing.assert_close(last.model.norm.weight, whole.model.norm.weight)
    torch.testing.assert_close(first.model.layers[0].mlp.down_proj.weight,
                               whole.model.layers[0].mlp.down_proj.weight)


def test_compile_cache_key_includes_the_stage(llama_path, stage):
    from vllm.compilation.cache_key import compute_cache_factors, compute_cache_key
    from vllm.config import ModelConfig, VllmConfig

    config = VllmConfig(model_config=ModelConfig(model=llama_path, dtype="float32"),
                        parallel_config=ParallelConfig(pipeline_parallel_size=2,
                                                       distributed_executor_backend="mp"))
    keys = []
    for rank in range(2):
        stage(rank, 2)
        factors = compute_cache_factors(config, [], "p")
        assert factors["pipeline_stage"] == f"{rank}/2"
        keys.append(compute_cache_key(factors))
    assert keys[0] != keys[1]


@pytest.mark.slow
@pytest.mark.parametrize("tp,level", [(1, 2), (2, 0)])
def test_pp2_mp_greedy_equals_transformers(llama_path, hf_greedy, tp, level, no_partition):
    """PP=2 over local processes (each stage compiles its own graph at -O2), and TP=2 inside
    each of 2 stages (world 4): transformers' greedy tokens."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=llama_path, optimization_level=level, max_model_len=128,
              kv_cache_memory="16MiB", pipeline_parallel_size=2, tensor_parallel_size=tp,
              distributed_executor_backend="mp", disable_log_stats=True)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(PROMPTS[:3], params)
        for prompt, out in zip(PROMPTS[:3], outputs):
            assert list(out.outputs[0].token_ids) == hf_greedy(prompt), prompt
    finally:
        llm.llm_engine.shutdown()
