"""Per family: tensor parallelism on the CPU (gloo, 2 processes) gives the TP=1 logits, and
the forward traces into one Dynamo graph with one attention op per layer (the split points of
piecewise compilation). A case is a `MAKERS` family with config overrides chosen to exercise
what TP must split or replicate: GPT-2's fused Conv1D q|k|v, OPT's project_in/out with
post-LN, Gemma 2/3's soft-caps, windows shorter than prompt "a" and per-head q/k norms with
random norm weights, Phi-3's fused qkv/gate_up with LongRoPE or one replicated KV head, the
MoE families' experts with a dense middle layer; Llama and Mixtral as they are. Add a case to
`CASES` to cover a family. Without a process group, TP > 1 is a clear error."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.model_executor.paged_runner import PagedRunner
from vllm.config import ModelConfig, ParallelConfig, VllmConfig
from vllm.model_executor.model_loader import get_model

_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
             "short_factor": [1.0 + 0.15 * i for i in range(8)],
             "long_factor": [1.5 + 0.9 * i for i in range(8)],
             "original_max_position_embeddings": 8}
# case -> (MAKERS family, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "mixtral": ("mixtral", {}),
    "gpt2": ("gpt2", {}),
    "opt-proj-postln": ("opt", {"word_embed_proj_dim": 32, "do_layer_norm_before": False}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    # LongRoPE past its original 8 positions, a window shorter than the prompts.
    "phi3-longrope": ("phi3", {"sliding_window": 4, "original_max_position_embeddings": 8,
                               "rope_parameters": _LONGROPE}),
    # One KV head for two ranks (replicated); partial rotary.
    "phi3-kv1": ("phi3", {"num_key_value_heads": 1,
                          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5}}),
    # Three layers with the middle one dense: the MoE families' dense MLP is sharded too.
    "qwen2_moe": ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "qwen3_moe": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
}
# "a" (18 tokens) is longer than every window above.
PROMPTS = {"a": [5, 9, 17, 33, 65, 129, 200, 7, 8, 90, 91, 92, 300, 301, 17, 3, 44, 45],
           "b": [300, 4, 4, 4, 12]}


def vllm_config(path: str, tp: int = 1) -> VllmConfig:
    return VllmConfig(model_config=ModelConfig(model=path, dtype="float32"),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp),
                      optimization_level=0)


def logits_of_steps(model, config) -> torch.Tensor:
    """A prefill of two prompts with a padding lane, then two decode steps (reordered); all
    logits."""
    runner = PagedRunner(model, config, block_size=4)
    prefill = runner.step(list(PROMPTS.items()), num_padding=1)
    first = runner.step([("b", [13]), ("a", [11])])
    second = runner.step([("a", [12]), ("b", [14])])
    return torch.cat([prefill["a"], prefill["b"], first["a"], first["b"], second["a"],
                      second["b"]])


def _rank_main(rank: int, world: int, port: int, paths: dict[str, str], out_dir: str) -> None:
    from vllm.distributed import (
        destroy_distributed_environment,
        init_distributed_environment,
        initialize_model_parallel,
    )

    torch.set_num_threads(1)
    init_distributed_environment(world, rank, "gloo", f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(world)
    try:
        for family, path in paths.items():
            config = vllm_config(path, tp=world)
            logits = logits_of_steps(get_model(config), config)
            torch.save(logits, os.path.join(out_dir, f"{family}.rank{rank}.pt"))
    finally:
        destroy_distributed_environment()


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    """case -> its checkpoint folder (made on first use)."""
    return lambda case: checkpoints(CASES[case][0], **CASES[case][1])


@pytest.fixture(scope="module")
def tp2_logits(checkpoint, tmp_path_factory):
    """Every case at TP=2, in one pair of processes: case -> [rank 0, rank 1] logits."""
    paths = {case: checkpoint(case) for case in CASES}
    out_dir = tmp_path_factory.mktemp("tp2_out")
    with pytest.MonkeyPatch.context() as patch:
        # The spawned ranks inherit VLLM_PLATFORM=cpu: gloo on the CPU even on a GPU machine.
        patch.setenv("VLLM_PLATFORM", "cpu")
        mp.start_processes(_rank_main, args=(2, _unused_port(), paths, str(out_dir)),
                           nprocs=2, start_method="spawn")
    return {family: [torch.load(out_dir / f"{family}.rank{rank}.pt") for rank in range(2)]
            for family in CASES}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CASES))
def test_tensor_parallel_2_matches_tp_1(family, checkpoint, tp2_logits, cpu_platform):
    torch.set_num_threads(1)
    config = vllm_config(checkpoint(family))
    expected = logits_of_steps(get_model(config), config)
    for rank, got in enumerate(tp2_logits[family]):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0,
                                   msg=lambda m, r=rank: f"{family} rank {r}: {m}")


@pytest.mark.parametrize("family", list(CASES))
def test_forward_is_one_graph_with_one_attention_op_per_layer(family, checkpoint):
    torch.set_num_threads(1)
    config = vllm_config(checkpoint(family))
    model = get_model(config)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    expected = logits_of_steps(model, config)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=record, fullgraph=True, dynamic=True)
    try:
        got = logits_of_steps(model, config)
    finally:
        del model.forward
        torch._dynamo.reset()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert len(graphs) == 1, f"{len(graphs)} graphs: a shape or value change recompiled"
    attention = torch.ops.vllm.unified_attention_with_output
    calls = [node for node in graphs[0].graph.nodes
             if node.target in (attention, attention.default)]
    assert len(calls) == config.model_config.get_num_layers() == \
        CASES[family][1].get("num_hidden_layers", 2)


def test_tensor_parallel_size_without_group_is_an_error(checkpoint):
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        get_model(vllm_config(checkpoint("llama"), tp=2))
