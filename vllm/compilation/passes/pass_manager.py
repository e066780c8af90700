"""The ordered list of graph passes chosen from PassConfig.

The passes and their order come from the registry (passes/registry.py: one `PassEntry` per
pass, flag, order and class); the class is imported only when its flag is on and is built as
`Class()` or `Class(vllm_config)`. `PostCleanupPass` and then `FixFunctionalizationPass`
always run last, in that order.

The manager is installed as Inductor's `post_grad_custom_post_pass` through `as_inductor_pass()`
(so its `uuid()` is part of Inductor's cache key) and is called directly by the "eager" backend
on the AOTAutograd graph. This module does not import Inductor (which imports Dynamo, ~1.4 s):
a warm start that loads every piece without Inductor builds the manager too.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import os
from typing import TYPE_CHECKING

import torch.fx as fx

from vllm.compilation.passes.inductor_pass import (
    InductorPass,
    VllmInductorPass,
    get_pass_context,
    source_hash,
)
from vllm.compilation.passes.registry import enabled_entries, has_pass
from vllm.compilation.passes.utility.fix_functionalization import FixFunctionalizationPass
from vllm.compilation.passes.utility.post_cleanup import PostCleanupPass
from vllm.config.compilation import POST_GRAD_PASS_KEY
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

__all__ = ["PostGradPassManager", "NotAPassError", "has_pass"]


def _build(path: str, vllm_config: VllmConfig | None) -> VllmInductorPass:
    module_name, cls_name = path.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    takes_config = len(inspect.signature(cls.__init__).parameters) > 1
    return cls(vllm_config) if takes_config else cls()


class NotAPassError(TypeError, AssertionError):
    """`PostGradPassManager.add` was given something that is not an `InductorPass` (a
    TypeError; also an AssertionError, which upstream's manager raises there)."""


def _matched(graph_pass: InductorPass) -> int:
    """Rewrites a pass did in this process (0 for passes that do not count them)."""
    return int(getattr(graph_pass, "total_matched", 0))


class PostGradPassManager:
    """Runs the configured passes in order on one graph; reports matches per pass."""

    def __init__(self) -> None:
        self.passes: list[InductorPass] = []
        self.post_cleanup = PostCleanupPass()
        self.fix_functionalization = FixFunctionalizationPass()
        self.pass_config_hash = ""
        self.fp8_model = False
        self.num_graphs = 0
        """Graphs the passes ran on (0 when everything came from the compile cache)."""

    def configure(self, vllm_config: VllmConfig) -> PostGradPassManager:
        pass_config = vllm_config.compilation_config.pass_config
        self.pass_config_hash = pass_config.compute_hash()
        self.fp8_model = bool(getattr(vllm_config.model_config, "is_fp8", False))
        wanted = enabled_entries(pass_config)
        fusions = [e.flag.removeprefix("fuse_") for e in wanted
                   if e.fusion and e.pass_class is not None]
        logger.info("Enabled fusions: %s", ", ".join(fusions) or "none")
        for entry in wanted:
            if entry.pass_class is None:
                logger.warning("pass_config.%s is on, but this engine has no pass for it yet: "
                               "nothing is fused", entry.flag)
            else:
                self.add(_build(entry.pass_class, vllm_config))
        # A user's own pass (inductor_compile_config["post_grad_custom_post_pass"]) runs after
        # ours, before the clean-up; Inductor gets this manager under that key instead.
        user_pass = vllm_config.compilation_config.inductor_compile_config.get(
            POST_GRAD_PASS_KEY)
        if user_pass is not None:
            self.add(user_pass)
        return self

    def log_match_counts(self) -> None:
        """After compiling: the rewrites per pass; a warning for an enabled fusion that matched
        nothing on an FP8 model (where every one of them should match)."""
        if not self.num_graphs:
            logger.info("Graph passes did not run (every piece was loaded from a compile "
                        "cache: ours, or Inductor's own FX-graph cache)")
            return
        counts = ", ".join(f"{p.name}={_matched(p)}" for p in self.passes)
        logger.info("Graph passes over %d graph(s): %s", self.num_graphs, counts or "none")
        for p in self.passes:
            if self.fp8_model and p.name.endswith("FusionPass") and _matched(p) == 0:
                logger.warning("%s is enabled but matched nothing on this FP8 model: the "
                               "graph does not hold the pattern it fuses (a changed layer, "
                               "dtype, epsilon or custom-op form?)", p.name)

    def add(self, graph_pass: InductorPass) -> None:
        """Append a pass (it runs after the configured ones, before the clean-up). A plain
        callable is refused: wrap it as `CallableInductorPass(fn)` so it has a uuid."""
        if not isinstance(graph_pass, InductorPass):
            raise NotAPassError(
                f"{graph_pass!r} is not an InductorPass: subclass InductorPass or wrap a "
                "callable as CallableInductorPass(fn), so that it has a uuid() for the "
                "compile caches' keys")
        self.passes.append(graph_pass)

    def all_passes(self) -> list[InductorPass]:
        return [*self.passes, self.post_cleanup, self.fix_functionalization]

    def __call__(self, graph: fx.Graph) -> None:
        from vllm.compilation.debug_dump import CompilationStageError, dump_graph

        ctx = get_pass_context()
        self.num_graphs += 1
        for i, graph_pass in enumerate(self.all_passes()):
            if not graph_pass.is_applicable_for_range(ctx.compile_range):
                logger.debug("Skipping %s with compile range %s", graph_pass.name,
                             ctx.compile_range)
                continue
            stem = f"post_grad.{i}.{graph_pass.name}"
            if ctx.dump_dir:
                dump_graph(graph, os.path.join(ctx.dump_dir, f"{stem}.before.py"))
            try:
                graph_pass(graph)
            except Exception as e:
                raise CompilationStageError(f"pass {graph_pass.name}",
                                            piece_index=ctx.piece_index) from e
            if ctx.dump_dir:
                dump_graph(graph, os.path.join(ctx.dump_dir, f"{stem}.after.py"))

    def match_counts(self) -> dict[str, int]:
        """Rewrites per pass over this process (the fusion tests read these)."""
        return {p.name: _matched(p) for p in self.all_passes()}

    def as_inductor_pass(self) -> object:
        """This manager as an Inductor `CustomGraphPass` (Inductor's FX graph cache takes its
        `uuid()` into the key only from one)."""
        return as_custom_graph_pass(self)

    def uuid(self) -> str:
        """Changes with any pass flag, any pass's source, the set of passes and the compile
        range the passes see."""
        ctx = get_pass_context()
        parts = [self.pass_config_hash, source_hash(type(self)), str(ctx.compile_range)]
        parts += [f"{p.name}:{p.uuid()}" for p in self.all_passes()]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()


def as_custom_graph_pass(graph_pass: PostGradPassManager | InductorPass) -> object:
    """A pass manager or a single pass as an Inductor `CustomGraphPass` (its `uuid()` in
    Inductor's cache key)."""
    return _inductor_pass_class()(graph_pass)


@functools.cache
def _inductor_pass_class() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class InductorPostGradPass(CustomGraphPass):
        """A `PostGradPassManager` (or one pass) as Inductor's post-grad custom pass."""

        def __init__(self, manager: PostGradPassManager | InductorPass) -> None:
            self.manager = manager

        def __call__(self, graph: fx.Graph) -> None:
            self.manager(graph)

        def uuid(self) -> str:
            return self.manager.uuid()

    return InductorPostGradPass
