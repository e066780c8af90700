"""Gemma 2 and Gemma 3 under tensor parallelism on the CPU (gloo, 2 processes) give the TP=1
logits: heads split over the ranks with the soft-caps, the window of 8 and Gemma 3's per-head
q/k norms, the tied vocabulary-parallel head gathered before the final soft-cap."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.model_executor.hf_checkpoints import make_gemma2, make_gemma3
from tests.model_executor.paged_runner import PagedRunner
from tests.model_executor.test_gemma_vs_hf import randomize_norm_weights
from vllm.config import ModelConfig, ParallelConfig, VllmConfig
from vllm.model_executor.model_loader import get_model

# "a" is longer than the window of 8 on the sliding layers.
PROMPTS = {"a": [5, 9, 17, 33, 65, 129, 200, 7, 8, 90, 91, 92, 300, 301, 17, 3, 44, 45],
           "b": [300, 4, 4, 4, 12]}


def run_steps(model, config):
    runner = PagedRunner(model, config, block_size=4)
    first = runner.step(list(PROMPTS.items()), num_padding=1)
    second = runner.step([("a", [11]), ("b", [13])])
    third = runner.step([("b", [14]), ("a", [12])])
    return torch.cat([first["a"], first["b"], second["a"], second["b"], third["a"],
                      third["b"]])


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
            model = get_model(config)
            heads = model.model.layers[0].self_attn.attn.num_heads
            assert heads == 4 // world, f"{name}: {heads} heads on rank {rank}"
            logits = run_steps(model, config)
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
    root = tmp_path_factory.mktemp("gemma_tp")
    made = {"gemma2": make_gemma2(root / "gemma2", tokenizer=False),
            "gemma3": make_gemma3(root / "gemma3", tokenizer=False)}
    for path in made.values():
        randomize_norm_weights(path)
    return made


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
