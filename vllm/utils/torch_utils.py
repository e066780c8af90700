"""torch version checks (upstream's `vllm.utils.torch_utils`).

A version with a pre-release or local part compares by its release numbers first; a target
ending in ".dev" ("2.8.0.dev") is met by every build of that release, nightlies
("2.8.0.dev20250624+cu128") and source builds ("2.8.0a0+gitc82a174") included.
"""
from __future__ import annotations

from packaging.version import Version


def _is_torch_equal_or_newer(torch_version: str, target: str) -> bool:
    """Whether `torch_version` is `target` or newer (see the module docstring)."""
    have, want = Version(torch_version), Version(target)
    if want.is_devrelease:  # "2.8.0.dev": any 2.8.0 build counts
        return have.release >= want.release
    return have >= want


def is_torch_equal_or_newer(target: str) -> bool:
    """Whether the installed torch is `target` or newer."""
    import torch

    return _is_torch_equal_or_newer(str(torch.__version__), target)


def is_torch_equal(target: str) -> bool:
    """Whether the installed torch is exactly release `target` (a local part such as
    "+cpu" ignored)."""
    import torch

    return Version(str(torch.__version__)).base_version == Version(target).base_version
