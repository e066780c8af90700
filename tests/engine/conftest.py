"""Fixtures for the engine's end-to-end tests: a tiny random-weight Llama checkpoint and
transformers' greedy outputs for it."""
from __future__ import annotations

import pytest
import torch

try:
    from tests.model_executor.hf_checkpoints import make_llama
except ImportError:  # tests/ itself on sys.path (plain `pytest`)
    from model_executor.hf_checkpoints import make_llama

from engine_test_utils import MAX_TOKENS


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory) -> str:
    return make_llama(tmp_path_factory.mktemp("engine") / "llama")


@pytest.fixture(scope="session")
def hf_model(llama_path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_path)


@pytest.fixture(scope="session")
def hf_greedy(hf_model, tokenizer):
    """prompt -> transformers' greedy output ids (exactly MAX_TOKENS: EOS suppressed)."""
    cache: dict[str, list[int]] = {}

    def run(prompt: str, max_tokens: int = MAX_TOKENS) -> list[int]:
        key = (prompt, max_tokens)
        if key not in cache:
            ids = torch.tensor([tokenizer.encode(prompt)])
            with torch.no_grad():
                out = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                        do_sample=False, max_new_tokens=max_tokens,
                                        min_new_tokens=max_tokens, pad_token_id=0)
            cache[key] = out[0, ids.shape[1]:].tolist()
        return cache[key]

    return run


@pytest.fixture(scope="session")
def llm(llama_path):
    """One shared engine with the default settings (prefix caching on, chunked prefill)."""
    from vllm import LLM

    return LLM(model=llama_path, optimization_level=0, max_model_len=256)
