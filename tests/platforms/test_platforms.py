"""Platform detection, VLLM_PLATFORM forcing, and refusing to run on absent hardware."""
from __future__ import annotations

import pytest

from vllm.platforms import get_current_platform, reset_current_platform

try:
    from tests.fresh_python import run_fresh
except ImportError:  # tests/ itself on sys.path
    from fresh_python import run_fresh


def test_detects_cpu_without_gpu():
    import torch

    platform = get_current_platform()
    expected = "cpu" if not torch.cuda.is_available() else platform.device_name
    assert platform.device_name == expected
    assert not platform.forced


@pytest.mark.parametrize("name", ["cpu", "cuda", "rocm"])
def test_forced_platform(monkeypatch, name):
    monkeypatch.setenv("VLLM_PLATFORM", name)
    reset_current_platform()
    platform = get_current_platform()
    assert platform.device_name == name and platform.forced
    from vllm.platforms import current_platform

    assert current_platform is platform


def test_unknown_platform_is_clear_error(monkeypatch):
    monkeypatch.setenv("VLLM_PLATFORM", "tpu")
    reset_current_platform()
    with pytest.raises(ValueError, match="VLLM_PLATFORM='tpu'.*cpu, cuda, rocm"):
        get_current_platform()


def test_forced_platform_without_hardware_refuses_to_run(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.setenv("VLLM_PLATFORM", "cuda")
    reset_current_platform()
    platform = get_current_platform()
    assert platform.support_static_graph_mode()
    with pytest.raises(RuntimeError, match="models cannot run"):
        platform.verify_can_run()
    get_current_platform.__globals__["_current"] = None
    monkeypatch.setenv("VLLM_PLATFORM", "cpu")
    get_current_platform().verify_can_run()  # the CPU is always there


def test_import_vllm_does_not_import_cuda_only_packages(tmp_path):
    code = ("import sys, vllm, vllm.config, vllm.platforms; "
            "bad = [m for m in ('triton', 'flashinfer') if m in sys.modules]; "
            "assert not bad, bad; print('ok')")
    assert run_fresh(code, tmp_path).strip() == "ok"
