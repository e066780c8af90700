"""Undo `auto_functionalized` wrappers around in-place custom ops.

Functionalization turns an in-place custom op `op(x, out)` (mutating `out`) into
`r = auto_functionalized(op, x=x, out=out)` whose result holds fresh copies of the mutated
arguments, which costs a copy per call. When no later node reads the old value of a mutated
argument, calling the op in place is equivalent: the users of the copy are rewired to the
argument itself. Runs last (no dead-code elimination may follow: the in-place call returns
nothing anybody uses).
"""
from __future__ import annotations

import operator

import torch.fx as fx

from vllm.compilation.passes.inductor_pass import VllmInductorPass

try:
    from torch._higher_order_ops.auto_functionalize import auto_functionalized
except ImportError:  # pragma: no cover - very old torch
    auto_functionalized = None


class FixFunctionalizationPass(VllmInductorPass):
    def apply(self, graph: fx.Graph) -> int:
        if auto_functionalized is None:
            return 0
        order = {node: i for i, node in enumerate(graph.nodes)}
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not auto_functionalized:
                continue
            if self._defunctionalize(graph, node, order):
                count += 1
        return count

    def _defunctionalize(self, graph: fx.Graph, node: fx.Node, order: dict) -> bool:
        op = node.args[0]
        schema = op._schema
        mutated = [a.name for a in schema.arguments
                   if a.alias_info is not None and a.alias_info.is_write]
        kwargs = dict(node.kwargs)
        # A mutated argument must not be read after this node (it would see the new value).
        for name in mutated:
            arg = kwargs.get(name)
            if not isinstance(arg, fx.Node):
                return False
            if any(order.get(user, -1) > order[node] for user in arg.users if user is not node):
                return False
        num_returns = len(schema.returns)
        # The wrapper's result is (op result(s), *mutated): an op returning nothing still
        # takes slot 0 (None), so mutated arguments start at max(num_returns, 1).
        offset = max(num_returns, 1)
        getitems = [u for u in node.users
                    if u.op == "call_function" and u.target is operator.getitem]
        if len(getitems) != len(node.users):
            return False
        with graph.inserting_before(node):
            call = graph.call_function(op, kwargs=kwargs)
            call.meta = dict(node.meta)
            eager = call.meta.pop("eager_input_vals", None)
            if eager is not None:  # recorded for the wrapper's (op, **kwargs): re-key for op
                names = {a.name for a in schema.arguments}
                call.meta["eager_input_vals"] = (
                    (), {k: v for k, v in eager[1].items() if k in names})
        for user in getitems:
            index = user.args[1]
            if index < num_returns:
                if num_returns == 1:
                    replacement = call
                else:
                    with graph.inserting_after(call):
                        replacement = graph.call_function(operator.getitem, (call, index))
            else:
                replacement = kwargs[mutated[index - offset]]
            user.replace_all_uses_with(replacement)
            graph.erase_node(user)
        graph.erase_node(node)
        return True



