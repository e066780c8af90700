"""Small helpers shared across the package (argument parsing lives in `argparse_utils`).

`random_uuid` and, for upstream's older import path, `FlexibleArgumentParser` are here too."""
from __future__ import annotations

import uuid
from typing import Any


def random_uuid() -> str:
    """A random 32-character hex id (request ids)."""
    return uuid.uuid4().hex


def __getattr__(name: str) -> Any:
    if name == "FlexibleArgumentParser":  # (its module imports logging and config helpers)
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        return FlexibleArgumentParser
    raise AttributeError(f"module 'vllm.utils' has no attribute {name!r}")
