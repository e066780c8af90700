"""Splitting the traced graph at the splitting ops (attention): one piece per stretch between
them, and one per splitting-op call (which runs eagerly)."""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from vllm.compilation.partition_rules import matching_ops
from vllm.config.compilation import ATTENTION_OP_NAME
from vllm.logger import init_logger

logger = init_logger(__name__)


_EAGER_IMPLS: dict[str, Callable[..., Any]] = {}


def register_eager_impl(op_name: str, fn: Callable[..., Any]) -> None:
    """`fn`, the Python implementation of the op `op_name` ("ns::op", its default overload),
    is what a splitting piece calls in its place (`eager_runnable`)."""
    _EAGER_IMPLS[op_name] = fn


def eager_runnable(graph: fx.GraphModule) -> Callable[..., Any]:
    """A splitting piece's runnable: its graph's code, with each call of an op registered by
    `register_eager_impl` made to the Python implementation directly. The piece runs eagerly
    anyway; the dispatcher's round trip into Python cost ~3 us a call (the attention op, once
    per layer per step). Rewrites `graph` in place."""
    changed = False
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverloadPacket):
            name = target._qualified_op_name
        elif isinstance(target, torch._ops.OpOverload) and target._overloadname == "default":
            name = target._schema.name
        else:
            continue
        fn = _EAGER_IMPLS.get(name)
        if fn is not None:
            node.target, changed = fn, True
    if changed:
        graph.recompile()
    return graph.forward


@dataclasses.dataclass
class SplitItem:
    index: int
    name: str
    """Attribute name of the submodule in the split module ("submod_<id>")."""
    is_splitting: bool
    graph: fx.GraphModule


def split_graph(gm: fx.GraphModule, splitting_ops: Sequence[str]
                ) -> tuple[fx.GraphModule, list[SplitItem]]:
    """Split at every call of a splitting op; each such call gets a submodule of its own."""
    wanted = set(splitting_ops)
    matched: set[str] = set()
    subgraph_of: dict[fx.Node, int] = {}
    splitting_ids: set[int] = set()
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is operator.getitem and \
                isinstance(node.args[0], fx.Node) and node.args[0] in subgraph_of and \
                subgraph_of[node.args[0]] in splitting_ids:
            subgraph_of[node] = subgraph_of[node.args[0]]  # stays with its op's outputs
            continue
        hit = matching_ops(node, wanted)
        if hit:
            matched |= hit
            current += 1
            subgraph_of[node] = current
            splitting_ids.add(current)
            current += 1
        else:
            subgraph_of[node] = current
    unmatched = sorted(wanted - matched)
    if unmatched:
        logger.warning("splitting_ops %s match no call in the traced graph (a misspelt op "
                       "name?); names are 'namespace::op' or 'namespace::op.overload', e.g. "
                       "'%s'", unmatched, ATTENTION_OP_NAME)
    split_gm = torch.fx.passes.split_module.split_module(
        gm, None, lambda node: subgraph_of[node], keep_original_order=True)
    items = []
    names = [n.target for n in split_gm.graph.nodes if n.op == "call_module"]
    for i, name in enumerate(names):
        sub_id = int(name.rsplit("_", 1)[1])
        items.append(SplitItem(i, name, sub_id in splitting_ids, getattr(split_gm, name)))
    return split_gm, items
