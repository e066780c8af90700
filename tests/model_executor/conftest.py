"""Fixtures of the model tests: checkpoints of every family made once per module, and one
torch thread (the comparisons with transformers are exact enough on one, and two test
workers share two cores)."""
from __future__ import annotations

import json

import pytest
import torch

try:
    from tests.model_executor.hf_checkpoints import MAKERS, randomize_norm_weights
except ImportError:  # tests/ itself on sys.path (plain `pytest`)
    from model_executor.hf_checkpoints import MAKERS, randomize_norm_weights


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """checkpoints(family, **config overrides) -> a checkpoint folder without a tokenizer,
    made on first use in this module (`MAKERS[family]`). Gemma's norm weights are drawn at
    random: transformers initialises them to zero, which would hide the (1 + weight) form."""
    root = tmp_path_factory.mktemp("ckpt")
    made: dict[str, str] = {}

    def get(family: str, **overrides) -> str:
        key = family + json.dumps(overrides, sort_keys=True)
        if key not in made:
            path = MAKERS[family](root / f"{family}-{len(made)}", tokenizer=False, **overrides)
            if family.startswith("gemma"):
                randomize_norm_weights(path)
            made[key] = path
        return made[key]

    return get
