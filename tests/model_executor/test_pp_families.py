"""Per family: pipeline parallelism on the CPU (2 stages over gloo, 2 processes) gives the
PP=1 logits: each stage builds only its layers, loads only their weights, and the last stage's
logits after the hand-over equal the whole model's. The families that cannot split (GPT-2,
OPT) refuse by name."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.model_executor.test_tp_families import CASES, _unused_port, logits_of_steps
from vllm.config import ModelConfig, ParallelConfig, VllmConfig
from vllm.model_executor.model_loader import get_model

PP_CASES = ["llama", "mixtral", "gemma2", "gemma3", "phi3-longrope", "qwen2_moe"]


def pp_config(path: str, pp: int = 1) -> VllmConfig:
    return VllmConfig(model_config=ModelConfig(model=path, dtype="float32"),
                      parallel_config=ParallelConfig(pipeline_parallel_size=pp,
                                                     distributed_executor_backend="mp"),
                      optimization_level=0)


def _stage_main(rank: int, port: int, paths: dict[str, str], out_dir: str) -> None:
    from vllm.distributed import (
        destroy_distributed_environment,
        init_distributed_environment,
        initialize_model_parallel,
    )

    torch.set_num_threads(1)
    os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
    init_distributed_environment(2, rank, "gloo", f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 2)
    try:
        for case, path in paths.items():
            config = pp_config(path, pp=2)
            model = get_model(config)
            layers = [i for i, layer in enumerate(model.model.layers)
                      if type(layer).__name__ != "PPMissingLayer"]
            if rank == 0:  # no LM head here: stand-in logits for the harness
                assert model.compute_logits(torch.zeros(1, 1)) is None
                model.compute_logits = lambda h: torch.zeros(h.shape[0], 1)
            logits = logits_of_steps(model, config)
            torch.save((layers, logits), os.path.join(out_dir, f"{case}.rank{rank}.pt"))
    finally:
        destroy_distributed_environment()


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    return lambda case: checkpoints(CASES[case][0], **CASES[case][1])


@pytest.fixture(scope="module")
def pp2_results(checkpoint, tmp_path_factory):
    """Every case at PP=2, in one pair of processes: case -> [(layers, logits) per stage]."""
    paths = {case: checkpoint(case) for case in PP_CASES}
    out_dir = tmp_path_factory.mktemp("pp2_out")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_PLATFORM", "cpu")
        mp.start_processes(_stage_main, args=(_unused_port(), paths, str(out_dir)),
                           nprocs=2, start_method="spawn")
    return {case: [torch.load(out_dir / f"{case}.rank{rank}.pt") for rank in range(2)]
            for case in PP_CASES}


@pytest.mark.slow
@pytest.mark.parametrize("case", PP_CASES)
def test_pipeline_parallel_2_matches_pp_1(case, checkpoint, pp2_results, cpu_platform):
    torch.set_num_threads(1)
    config = pp_config(checkpoint(case))
    expected = logits_of_steps(get_model(config), config)
    (first_layers, _), (last_layers, got) = pp2_results[case]
    num_layers = config.model_config.get_num_layers()
    assert first_layers + last_layers == list(range(num_layers))
    assert first_layers and last_layers
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_families_without_pipeline_parallelism_refuse_it(family, checkpoints):
    from vllm.engine.arg_utils import EngineArgs

    path = checkpoints(family)
    with pytest.raises(ValueError, match="does not support pipeline parallelism"):
        EngineArgs(model=path, pipeline_parallel_size=2,
                   distributed_executor_backend="mp").create_engine_config()
