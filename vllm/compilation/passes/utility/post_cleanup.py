"""Stable topological sort and dead-code elimination after the custom passes."""
from __future__ import annotations

import torch.fx as fx

from vllm.compilation.passes.inductor_pass import VllmInductorPass


class PostCleanupPass(VllmInductorPass):
    """Passes may insert nodes out of order or leave dead ones behind; this puts every node after
    its inputs (keeping the original order where possible) and removes unused pure nodes."""

    def apply(self, graph: fx.Graph) -> int:
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(graph)
        before = len(graph.nodes)
        graph.eliminate_dead_code()
        return before - len(graph.nodes)
