"""`current_platform`: detected lazily on first use, or forced with VLLM_PLATFORM."""
from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    current_platform: Platform

_PLATFORMS = {"cpu": "CpuPlatform", "cuda": "CudaPlatform", "rocm": "RocmPlatform"}
_current: Platform | None = None


def _make(name: str, forced: bool) -> Platform:
    import importlib

    module = importlib.import_module(f"vllm.platforms.{name}")
    return getattr(module, _PLATFORMS[name])(forced=forced)


def detect_platform() -> Platform:
    """VLLM_PLATFORM if set, else CUDA/ROCm when torch sees a GPU, else the CPU."""
    from vllm import envs

    forced = envs.VLLM_PLATFORM
    if forced is not None:
        if forced not in _PLATFORMS:
            raise ValueError(f"VLLM_PLATFORM={forced!r} is not a platform; choose one of "
                             + ", ".join(_PLATFORMS))
        return _make(forced, forced=True)
    import torch

    if torch.cuda.is_available():
        return _make("rocm" if torch.version.hip is not None else "cuda", forced=False)
    return _make("cpu", forced=False)


def get_current_platform() -> Platform:
    global _current
    if _current is None:
        _current = detect_platform()
    return _current


def reset_current_platform() -> None:
    """Forget the detected platform (tests that change VLLM_PLATFORM call this)."""
    global _current
    _current = None


def __getattr__(name: str):
    if name == "current_platform":
        return get_current_platform()
    raise AttributeError(f"module 'vllm.platforms' has no attribute {name!r}")


__all__ = ["Platform", "PlatformEnum", "current_platform", "detect_platform",
           "get_current_platform", "reset_current_platform"]
