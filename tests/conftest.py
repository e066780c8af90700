"""Shared fixtures: every test starts with the detected platform and no forced env."""
from __future__ import annotations

import os

import pytest

# Tests must never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The references are transformers' own modeling code: no Hub kernels (recent transformers
# swaps them in by default on a GPU, and without the `kernels` package refuses to load).
os.environ.setdefault("USE_HUB_KERNELS", "0")


@pytest.fixture(autouse=True)
def _fresh_platform(monkeypatch):
    """Forget the cached platform before and after each test (tests may force VLLM_PLATFORM)."""
    from vllm.platforms import reset_current_platform

    monkeypatch.delenv("VLLM_PLATFORM", raising=False)
    monkeypatch.delenv("VLLM_DEBUG_DUMP_PATH", raising=False)
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    reset_current_platform()
    yield
    reset_current_platform()


@pytest.fixture
def cpu_platform(monkeypatch):
    """The CPU platform even on a GPU machine, for tests of the CPU's defaults and kernels."""
    from vllm.platforms import get_current_platform, reset_current_platform

    monkeypatch.setenv("VLLM_PLATFORM", "cpu")
    reset_current_platform()
    return get_current_platform()


@pytest.fixture(autouse=True, scope="session")
def _share_the_gpu():
    """On a CUDA machine the test workers share one GPU: an engine whose test gives no KV cache
    size gets 1 GiB instead of gpu_memory_utilization of the whole device (which the other
    workers' engines hold part of). Session-wide, so module-scoped engines get it too."""
    import torch

    with pytest.MonkeyPatch.context() as patch:
        if torch.cuda.is_available():
            patch.setattr("vllm.engine.worker.Worker._cuda_available_kv_bytes",
                          lambda self: 1 << 30)
        yield


@pytest.fixture
def platform(monkeypatch, request):
    """Force a platform by name: use with `@pytest.mark.parametrize("platform", [...],
    indirect=True)`."""
    from vllm.platforms import get_current_platform, reset_current_platform

    monkeypatch.setenv("VLLM_PLATFORM", request.param)
    reset_current_platform()
    return get_current_platform()
