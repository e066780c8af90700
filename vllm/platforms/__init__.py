"""`current_platform`: detected lazily on first use, or forced with VLLM_PLATFORM."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from typing import TYPE_CHECKING

from vllm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    current_platform: Platform

_PLATFORMS = {"cpu": "CpuPlatform", "cuda": "CudaPlatform", "rocm": "RocmPlatform"}
_current: Platform | None = None


def _make(name: str, forced: bool) -> Platform:
    module = importlib.import_module(f"vllm.platforms.{name}")
    return getattr(module, _PLATFORMS[name])(forced=forced)


def torch_gpu_build() -> bool | None:
    """Whether the installed torch was built for CUDA or ROCm, read from its `version.py`
    without importing torch (which takes ~1.5 s of CPU, more than resolving a config); None
    when torch is already imported or that file does not say plainly (then ask torch)."""
    if "torch" in sys.modules:
        return None
    try:
        spec = importlib.util.find_spec("torch")
        locations = list(spec.submodule_search_locations or []) if spec else []
        if not locations:
            return None
        with open(os.path.join(locations[0], "version.py")) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError, ImportError):
        return None
    values: dict[str, object] = {}
    for node in tree.body:
        target = (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1
                  else node.target if isinstance(node, ast.AnnAssign) else None)
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            values[target.id] = node.value.value
    if "cuda" not in values or "hip" not in values:
        return None
    return values["cuda"] is not None or values["hip"] is not None


def detect_platform() -> Platform:
    """VLLM_PLATFORM if set, else CUDA/ROCm when torch sees a GPU, else the CPU. A torch built
    for neither cannot see a GPU, so that is answered without importing torch."""
    from vllm import envs

    forced = envs.VLLM_PLATFORM
    if forced is not None:
        if forced not in _PLATFORMS:
            raise ValueError(f"VLLM_PLATFORM={forced!r} is not a platform; choose one of "
                             + ", ".join(_PLATFORMS))
        return _make(forced, forced=True)
    if torch_gpu_build() is False:
        return _make("cpu", forced=False)
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
