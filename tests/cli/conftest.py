"""Fixtures shared by the CLI tests."""
from __future__ import annotations

import pytest
from transformers import LlamaConfig


@pytest.fixture(autouse=True)
def _cpu_tables(cpu_platform):
    """The CLI tests read the CPU's resolved tables and errors (CUDA's differ: CUDA graphs)."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny Llama checkpoint folder (config.json is all config resolution reads)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         max_position_embeddings=256)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    return str(path)
