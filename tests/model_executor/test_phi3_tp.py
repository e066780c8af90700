"""Phi-3 under tensor parallelism on the CPU (gloo, 2 processes): the fused qkv_proj and
gate_up_proj checkpoint tensors are split per rank (q/k/v and gate/up each sliced), with
2 KV heads (one per rank) and 1 (replicated); the TP=2 logits are the TP=1 ones. And the
forward traces into one Dynamo graph with one attention op per layer."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.model_executor.hf_checkpoints import make_phi3
from tests.model_executor.test_tp_and_tracing import _tp_worker, build, free_port, run_steps
from vllm.model_executor.model_loader import get_model

LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.15 * i for i in range(8)],
            "long_factor": [1.5 + 0.9 * i for i in range(8)],
            "original_max_position_embeddings": 8}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3-tp")
    return {
        # A window shorter than the prompts; LongRoPE (run_steps reaches position 9 > 8).
        "phi3": make_phi3(root / "phi3", tokenizer=False, sliding_window=4,
                          original_max_position_embeddings=8, rope_parameters=LONGROPE),
        # One KV head for two ranks (replicated); partial rotary.
        "phi3-kv1": make_phi3(root / "phi3-kv1", tokenizer=False, num_key_value_heads=1,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.5}),
    }


@pytest.mark.slow
def test_phi3_tensor_parallel_2_matches_tp_1(paths, tmp_path, cpu_platform):
    mp.start_processes(_tp_worker, args=(2, free_port(), paths, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    torch.set_num_threads(1)
    for name, path in paths.items():
        config = build(path)
        expected = run_steps(get_model(config), config)
        got = torch.load(tmp_path / f"{name}.pt")
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=name)


def test_phi3_forward_traces_as_one_graph(paths):
    torch.set_num_threads(1)
    config = build(paths["phi3"])
    model = get_model(config)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=True)
    expected = run_steps(model, config)
    model.forward = compiled
    try:
        got = run_steps(model, config)
    finally:
        del model.forward
        torch._dynamo.reset()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert len(graphs) == 1, "a shape or value change caused a recompile"
    op = torch.ops.vllm.unified_attention_with_output
    attention_calls = [node for node in graphs[0].graph.nodes
                       if node.target in (op, op.default)]
    assert len(attention_calls) == config.model_config.get_num_layers() == 2
