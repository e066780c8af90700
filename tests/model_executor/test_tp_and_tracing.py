"""Tensor parallelism on the CPU (gloo, 2 processes) gives the TP=1 logits, and the model's
forward traces into one Dynamo graph (no graph breaks, no host syncs) with one attention op
per layer: the split points of piecewise compilation."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.model_executor.hf_checkpoints import make_llama, make_mixtral
from tests.model_executor.paged_runner import PagedRunner
from vllm.config import ModelConfig, ParallelConfig, VllmConfig
from vllm.model_executor.model_loader import get_model

PROMPTS = {"a": [5, 9, 17, 33, 65, 129, 200, 7, 8], "b": [300, 4, 4, 4, 12]}


def run_steps(model, config):
    runner = PagedRunner(model, config, block_size=4)
    first = runner.step(list(PROMPTS.items()), num_padding=1)
    second = runner.step([("a", [11]), ("b", [13])])
    return torch.cat([first["a"], first["b"], second["a"], second["b"]])


def build(path, tp=1):
    return VllmConfig(model_config=ModelConfig(model=path, dtype="float32"),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp),
                      optimization_level=0)


def _tp_worker(rank, world, port, paths, out_dir):
    from vllm.distributed import (
        destroy_distributed_environment,
        init_distributed_environment,
        initialize_model_parallel,
    )

    torch.set_num_threads(1)
    init_distributed_environment(world, rank, "gloo", f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(world)
    try:
        for name, path in paths.items():
            config = build(path, tp=world)
            logits = run_steps(get_model(config), config)
            if rank == 0:
                torch.save(logits, os.path.join(out_dir, f"{name}.pt"))
    finally:
        destroy_distributed_environment()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {"llama": make_llama(root / "llama", tokenizer=False),
            "mixtral": make_mixtral(root / "mixtral", tokenizer=False)}


@pytest.mark.slow
def test_tensor_parallel_2_matches_tp_1(paths, tmp_path, cpu_platform):
    # The spawned ranks inherit VLLM_PLATFORM=cpu: gloo on the CPU even on a GPU machine.
    mp.start_processes(_tp_worker, args=(2, free_port(), paths, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    torch.set_num_threads(1)
    for name, path in paths.items():
        config = build(path)
        expected = run_steps(get_model(config), config)
        got = torch.load(tmp_path / f"{name}.pt")
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=name)


def test_tensor_parallel_size_without_group_is_an_error(paths):
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        get_model(build(paths["llama"], tp=2))


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_forward_traces_as_one_graph(paths, name):
    torch.set_num_threads(1)
    config = build(paths[name])
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
    assert len(attention_calls) == config.model_config.get_num_layers()
