"""Which graph nodes the compiled graph is split at (upstream's module and function names).

An entry of `compilation_config.splitting_ops` names an op as "namespace::op" (every overload)
or "namespace::op.overload" (that overload only). A call of an op overload packet
(`torch.ops.ns.op`) matches "ns::op" and each of its overloads' names.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx


def op_names(target: Any) -> set[str]:
    """Names a splitting_ops entry may use for a call target: "ns::op" and "ns::op.overload"
    (a Python function: "module.qualname")."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        base = target._qualified_op_name
        return {base} | {f"{base}.{overload}" for overload in target.overloads()}
    if isinstance(target, torch._ops.OpOverload):
        base = target._schema.name
        return {base, f"{base}.{target._overloadname}"}
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    module = getattr(target, "__module__", None)
    return {f"{module}.{name}"} if name and module else set()


def matching_ops(node: fx.Node, splitting_ops: Iterable[str]) -> set[str]:
    """The `splitting_ops` entries that name the op `node` calls (empty: not a split point)."""
    if node.op != "call_function":
        return set()
    return op_names(node.target) & set(splitting_ops)


def should_split(node: fx.Node, splitting_ops: Iterable[str]) -> bool:
    """Whether the graph is split at `node`: it calls an op named in `splitting_ops`."""
    return bool(matching_ops(node, splitting_ops))
