"""CustomOp: a layer with a plain-torch form and optional per-platform kernels.

A subclass registers a name (`@CustomOp.register("rms_norm")`) and implements
`forward_native` (plain torch: what Inductor sees and fuses) and, optionally, `forward_cpu`,
`forward_cuda` (ROCm uses `forward_hip`, which defaults to `forward_cuda`). Each instance picks
its forward once, at construction, from the current config:
`compilation_config.is_custom_op_enabled(name)` -> the platform method, else `forward_native`.
With no current config the op uses `forward_native`.
"""
from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn


class CustomOp(nn.Module):
    name: str = ""
    op_registry: dict[str, type[CustomOp]] = {}

    def __init__(self) -> None:
        super().__init__()
        self._forward_method = self.dispatch_forward()

    def forward(self, *args, **kwargs):
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_hip(self, *args, **kwargs):
        return self.forward_cuda(*args, **kwargs)

    @classmethod
    def enabled(cls) -> bool:
        """Whether this op's platform kernel is used under the current config."""
        from vllm.config import get_current_vllm_config

        config = get_current_vllm_config()
        if config is None or not cls.name:
            return False
        return config.compilation_config.is_custom_op_enabled(cls.name)

    def dispatch_forward(self) -> Callable:
        if not self.enabled():
            return self.forward_native
        from vllm.platforms import current_platform

        if current_platform.is_rocm():
            return self.forward_hip
        if current_platform.is_cuda():
            return self.forward_cuda
        return self.forward_cpu

    @classmethod
    def register(cls, name: str) -> Callable[[type[CustomOp]], type[CustomOp]]:
        """Class decorator: give the op its name (the key of `custom_ops` "+name"/"-name")."""

        def decorator(op_cls: type[CustomOp]) -> type[CustomOp]:
            existing = cls.op_registry.get(name)
            if existing is not None and existing.__qualname__ != op_cls.__qualname__:
                raise ValueError(f"custom op name {name!r} is already registered by "
                                 f"{existing.__qualname__}")
            op_cls.name = name
            cls.op_registry[name] = op_cls
            return op_cls

        return decorator


def warn_unused_custom_ops(model: nn.Module, custom_ops: list[str]) -> list[str]:
    """Warn (once per name) about each "+op"/"-op" of `custom_ops` that no layer of `model`
    uses, as upstream does: a misspelt or foreign name would otherwise do nothing silently.
    Returns the unused names."""
    from vllm.logger import init_logger

    used = {m.name for m in model.modules() if isinstance(m, CustomOp) and m.name}
    unused = []
    for op in custom_ops:
        if op[:1] in "+-" and op[1:] not in used:
            unused.append(op[1:])
            known = ", ".join(sorted(CustomOp.op_registry)) or "none"
            init_logger(__name__).warning_once(
                "custom op %r is not present in the model, so %r has no effect (custom ops "
                "this engine knows: %s)", op[1:], op, known)
    return unused

