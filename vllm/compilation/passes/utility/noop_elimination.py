"""Remove reshapes and slices that do nothing.

Such ops are harmless for Inductor's code but hide fusion patterns (an FP8 linear inserts 2-D
reshapes between a norm and its quantization). Shapes may be symbolic: a rewrite is done only
when equality is statically known for every value of the symbols.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from vllm.compilation.passes.inductor_pass import VllmInductorPass

aten = torch.ops.aten

_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
_INT64_MAX = 2**63 - 1


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _erase_dead(graph: fx.Graph, candidates: list[fx.Node]) -> None:
    """Erase the candidates a rewrite left without users, and then their inputs in turn, so
    that the pass leaves no dead nodes of its own (side-effecting ops are kept)."""
    work = list(candidates)
    while work:
        node = work.pop()
        if (getattr(node, "_erased", False) or node.graph is not graph
                or node.op != "call_function" or node.users or node.is_impure()):
            continue
        work.extend(node.all_input_nodes)
        graph.erase_node(node)


def _same(a: Any, b: Any) -> bool:
    """a == b for ints and SymInts, when statically known."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def _same_shape(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _covers_full_extent(size: Any, start: Any, end: Any, step: Any) -> bool:
    if step not in (None, 1) or start not in (None, 0):
        return False
    if end is None or (isinstance(end, int) and end >= _INT64_MAX):
        return True
    if isinstance(end, int) and end < 0:
        return False  # x[:-1] drops the last element: never a no-op
    if isinstance(end, int) and isinstance(size, int):
        return end >= size
    end_val = _val(end) if isinstance(end, fx.Node) else end
    return end_val is not None and _same(end_val, size)


class NoOpEliminationPass(VllmInductorPass):
    """Removes: reshapes whose output shape equals their input's; chains of reshapes (all but
    the last); slices covering the full extent (`end=-1` is not one); full-extent
    slice_scatter (replaced by its source)."""

    def apply(self, graph: fx.Graph) -> int:
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            # (inputs first: a rewrite may leave them without users)
            inputs = list(node.all_input_nodes)
            if node.target in _RESHAPES:
                done = self._reshape(graph, node)
            elif node.target == aten.slice.Tensor:
                done = self._slice(node)
            elif node.target == aten.slice_scatter.default:
                done = self._slice_scatter(node)
            else:
                continue
            if done:
                count += done
                _erase_dead(graph, inputs)
        return count

    def _reshape(self, graph: fx.Graph, node: fx.Node) -> int:
        src = node.args[0]
        if not isinstance(src, fx.Node):
            return 0
        count = 0
        # reshape(reshape(x, s1), s2) == reshape(x, s2): bypass the inner one (removed by DCE
        # when nothing else uses it). Views only when the base is contiguous, where any view
        # of the intermediate is also a view of the base.
        while (isinstance(src, fx.Node) and src.op == "call_function" and src.target in _RESHAPES
               and self._may_skip_inner(node, src)):
            node.update_arg(0, src.args[0])
            src = src.args[0]
            count += 1
        in_val, out_val = _val(src), _val(node)
        if in_val is not None and out_val is not None and _same_shape(in_val.shape, out_val.shape):
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            count += 1
        return count

    @staticmethod
    def _may_skip_inner(node: fx.Node, inner: fx.Node) -> bool:
        if node.target == aten.view.default or inner.target == aten.view.default:
            base = _val(inner.args[0])
            return base is not None and base.is_contiguous()
        return True

    def _slice(self, node: fx.Node) -> int:
        src, dim = _arg(node, 0, "self"), _arg(node, 1, "dim", 0)
        start, end, step = _arg(node, 2, "start"), _arg(node, 3, "end"), _arg(node, 4, "step", 1)
        src_val = _val(src)
        if src_val is None:
            return 0
        dim = dim % src_val.dim() if src_val.dim() else 0
        if not _covers_full_extent(src_val.shape[dim], start, end, step):
            return 0
        node.replace_all_uses_with(src)
        node.graph.erase_node(node)
        return 1

    def _slice_scatter(self, node: fx.Node) -> int:
        base, src, dim = _arg(node, 0, "self"), _arg(node, 1, "src"), _arg(node, 2, "dim", 0)
        start, end, step = _arg(node, 3, "start"), _arg(node, 4, "end"), _arg(node, 5, "step", 1)
        base_val, src_val = _val(base), _val(src)
        if base_val is None or src_val is None or not _same_shape(base_val.shape, src_val.shape):
            return 0
        dim = dim % base_val.dim() if base_val.dim() else 0
        if not _covers_full_extent(base_val.shape[dim], start, end, step):
            return 0
        if src_val.dtype != base_val.dtype:
            return 0
        node.replace_all_uses_with(src)
        node.graph.erase_node(node)
        return 1
