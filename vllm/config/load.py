"""How weights are loaded: from the folder's safetensors, or random ("dummy") for benchmarks."""
from __future__ import annotations

from dataclasses import dataclass

_FORMATS = ("auto", "safetensors", "dummy")


@dataclass
class LoadConfig:
    load_format: str = "auto"
    """auto / safetensors: the folder's *.safetensors; dummy: random weights of the right shape."""

    def __post_init__(self) -> None:
        if self.load_format not in _FORMATS:
            raise ValueError(f"load_format {self.load_format!r} is not supported; choose one of "
                             + ", ".join(_FORMATS))
