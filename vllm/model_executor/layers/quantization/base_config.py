"""The interface every quantization config implements."""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any

# Packed layers and the checkpoint modules they are built from: an ignore list names the
# checkpoint modules (q_proj), our layers are the packed ones (qkv_proj).
PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                  "gate_up_proj": ["gate_proj", "up_proj"]}


class QuantizationConfig(ABC):
    """A checkpoint's quantization scheme; hands out per-layer quant methods."""

    name: str = ""

    def __init__(self, ignore: list[str] | None = None) -> None:
        self.ignore = list(ignore or [])

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Parse the `quantization_config` dict of config.json; ValueError when unsupported."""

    @abstractmethod
    def get_quant_method(self, layer: Any, prefix: str) -> Any:
        """The LinearMethodBase for `layer` (named `prefix`), or None to leave it as it is."""

    @property
    def is_fp8(self) -> bool:
        return False

    def activation_quant(self) -> tuple[bool, int | None]:
        """How the quantized layers quantize their input: (static, group size), the group
        size None for per-tensor (static) or per-token (dynamic) scales."""
        raise NotImplementedError

    @property
    def has_static_activation_scales(self) -> bool:
        return False

    def is_layer_skipped(self, prefix: str) -> bool:
        """Whether the checkpoint keeps layer `prefix` unquantized: named (or matched by a
        "re:" pattern) in the ignore list; a packed layer is skipped when all its parts are
        (some but not all is an error). Routers (`*.gate`) are never quantized."""
        if prefix.endswith(".gate"):
            return True
        parent, _, last = prefix.rpartition(".")
        parts = PACKED_MODULES.get(last)
        if not parts:
            return self._ignored(prefix)
        skipped = [self._ignored(f"{parent}.{part}" if parent else part) for part in parts]
        if any(skipped) and not all(skipped):
            raise ValueError(f"the checkpoint quantizes only some parts of {prefix} "
                             f"({', '.join(parts)}); all or none must be quantized")
        return all(skipped)

    def _ignored(self, name: str) -> bool:
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], name) or re.search(entry[3:] + "$", name):
                    return True
            elif name == entry or name.endswith("." + entry):
                return True
        return False
