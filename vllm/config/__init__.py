"""Typed configs under one root, `VllmConfig`; the optimization levels resolve in it."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from vllm.config.cache import CacheConfig
from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode, PassConfig
from vllm.config.levels import OptimizationLevel
from vllm.config.load import LoadConfig
from vllm.config.model import ModelConfig
from vllm.config.parallel import ParallelConfig
from vllm.config.scheduler import SchedulerConfig
from vllm.config.vllm import VllmConfig

_current_vllm_config: VllmConfig | None = None


@contextlib.contextmanager
def set_current_vllm_config(config: VllmConfig) -> Iterator[None]:
    """Make `config` visible to code that builds layers (custom-op choices, attention)."""
    global _current_vllm_config
    previous = _current_vllm_config
    _current_vllm_config = config
    try:
        yield
    finally:
        _current_vllm_config = previous


def get_current_vllm_config() -> VllmConfig | None:
    return _current_vllm_config


__all__ = ["CacheConfig", "CompilationConfig", "CompilationMode", "CUDAGraphMode", "LoadConfig",
           "ModelConfig", "OptimizationLevel", "ParallelConfig", "PassConfig", "SchedulerConfig",
           "VllmConfig", "get_current_vllm_config", "set_current_vllm_config"]
