"""Fixtures for the serving tests: one tiny random-weight Llama checkpoint per session."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory) -> str:
    try:
        from tests.model_executor.hf_checkpoints import make_llama
    except ImportError:  # tests/ itself on sys.path (plain `pytest`)
        from model_executor.hf_checkpoints import make_llama
    return make_llama(tmp_path_factory.mktemp("serving") / "llama")
