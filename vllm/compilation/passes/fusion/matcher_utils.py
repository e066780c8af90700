"""Building blocks of the FP8 fusion passes: the forms an op takes in a graph, pattern
registration, and the process-wide match counts.

A fusion must match whatever the model's graph holds, with or without `custom_ops`. So each
op contributes every form its layer can emit, traced from the layer's own code (a change
there changes the patterns with it):
  RMSNorm (plain and with residual):  "native" = RMSNorm.forward_native,
                                      "cpu"    = RMSNorm.forward_cpu (ATen's rms_norm);
  SiluAndMul:                         "native" = SiluAndMul.forward_native,
                                      "cpu"    = SiluAndMul.forward_cpu (in place, traced
                                                 functionalized, as AOTAutograd sees it);
  QuantFP8 (static / per-token / per-group): "native" = QuantFP8.forward_native (plain torch),
                                      "custom" = the torch.ops.vllm quant op.
A pattern is the composition of one form of each op; every combination is registered.

Patterns are traced the way the graph the pass runs on was produced: with Inductor's
decompositions for the Inductor backend (its post-grad graph), without for the "eager"
backend (the AOTAutograd graph). They are traced at the model's dtype, with example inputs of
that dtype, and per epsilon (1e-5, 1e-6 and the model's own), because the pattern matcher
checks dtypes and constants exactly: a pattern never fuses across a dtype change, and the
fused kernel is given the epsilon it matched.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.quantization.input_quant_fp8 import GroupShape

logger = init_logger(__name__)

EPSILONS = (1e-5, 1e-6)
DEFAULT_GROUP_SIZE = 128

fusion_match_counter: collections.Counter[str] = collections.Counter()
"""Replacements per pass name over this process (tests read deltas)."""


# ---- quantization schemes --------------------------------------------------------------------
@dataclass(frozen=True)
class QuantScheme:
    """How the activation after the fused op is quantized."""

    static: bool
    group_size: int | None = None
    """None: per-tensor (static) or per-token (dynamic); an int: dynamic per group."""

    @property
    def group_shape(self) -> GroupShape:
        from vllm.model_executor.layers.quantization.input_quant_fp8 import GroupShape

        if self.static:
            return GroupShape.PER_TENSOR
        return GroupShape(1, self.group_size) if self.group_size else GroupShape.PER_TOKEN

    @property
    def op_group_size(self) -> int:
        """The `group_size` argument of the fused ops (-1: per token)."""
        return self.group_size or -1

    def __str__(self) -> str:
        if self.static:
            return "static"
        return f"group{self.group_size}" if self.group_size else "per-token"


STATIC = QuantScheme(True)
PER_TOKEN = QuantScheme(False)


def schemes_for(vllm_config: VllmConfig | None) -> list[QuantScheme]:
    """The schemes the model's FP8 linear layers use (all of them without a model)."""
    from vllm.model_executor.layers.quantization import get_quantization_config

    model_config = getattr(vllm_config, "model_config", None)
    try:
        quant_config = get_quantization_config(model_config)
    except ValueError:
        quant_config = None
    if quant_config is None:
        return [STATIC, PER_TOKEN, QuantScheme(False, DEFAULT_GROUP_SIZE)]
    static, group_size = quant_config.activation_quant()
    return [QuantScheme(static, group_size)]


def dtypes_for(vllm_config: VllmConfig | None) -> list[torch.dtype]:
    dtype = getattr(getattr(vllm_config, "model_config", None), "torch_dtype", None)
    return [dtype] if dtype is not None else [torch.float32, torch.bfloat16]


def epsilons_for(vllm_config: VllmConfig | None) -> list[float]:
    eps = list(EPSILONS)
    model_config = getattr(vllm_config, "model_config", None)
    text = getattr(model_config, "text_config", None) if model_config is not None else None
    model_eps = getattr(text, "rms_norm_eps", None)
    if isinstance(model_eps, float) and model_eps not in eps:
        eps.append(model_eps)
    return eps


def decompositions_for(vllm_config: VllmConfig | None) -> list[bool]:
    """[True] for Inductor graphs, [False] for the eager backend, both when unknown."""
    backend = getattr(getattr(vllm_config, "compilation_config", None), "backend", "")
    if backend == "eager":
        return [False]
    if backend == "inductor":
        return [True]
    return [True, False]


# ---- the forms of each op --------------------------------------------------------------------
def _rms_self(weight: torch.Tensor, eps: float, hidden: int) -> Any:
    return SimpleNamespace(weight=weight, variance_epsilon=eps, hidden_size=hidden)


def rms_forms(eps: float) -> dict[str, Callable]:
    """name -> f(x, weight, residual=None): RMSNorm's forwards as written in the layer."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    def form(method: Callable) -> Callable:
        def f(x, weight, residual=None):
            return method(_rms_self(weight, eps, x.shape[-1]), x, residual)
        return f

    return {"native": form(RMSNorm.forward_native), "cpu": form(RMSNorm.forward_cpu)}


def silu_forms() -> dict[str, Callable]:
    from vllm.model_executor.layers.activation import SiluAndMul

    return {"native": lambda x: SiluAndMul.forward_native(None, x),
            "cpu": lambda x: SiluAndMul.forward_cpu(None, x)}


def quant_forms(scheme: QuantScheme) -> dict[str, Callable]:
    """name -> f(y, scale=None) -> (q, scale): QuantFP8's forwards."""
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8

    quant_self = SimpleNamespace(static=scheme.static, group_shape=scheme.group_shape)
    return {"native": lambda y, scale=None: QuantFP8.forward_native(quant_self, y, scale),
            "custom": lambda y, scale=None: QuantFP8.forward_cuda(quant_self, y, scale)}


# ---- tracing and registration ------------------------------------------------------------------
def _decomps(decompose: bool) -> Callable[[], dict]:
    if decompose:
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table
    return dict


def make_trace_fn(decompose: bool) -> Callable:
    """A pattern-matcher trace function giving the IR our passes see: functionalized ATen,
    with Inductor's decompositions (and its no-op removal) or without."""
    from torch._inductor.pattern_matcher import enable_python_dispatcher, make_fx
    from torch.fx.traceback import preserve_node_meta

    @torch.no_grad()
    def trace(fn: Callable, args: Any, *, run_functional_passes: bool = True,
              get_decomp_fn: Callable[[], dict] | None = None) -> fx.GraphModule:
        # The table is this function's own: torch >= 2.12's pattern matcher passes its default
        # (Inductor's table) for search and replacement alike, and older ones pass none.
        del get_decomp_fn
        table = _decomps(decompose)()
        functional = torch.func.functionalize(fn, remove="mutations")
        with enable_python_dispatcher(), preserve_node_meta():
            gm = make_fx(functional, table, tracing_mode="real")(*args)
        _functional_inplace_on_temporaries(gm.graph)
        if run_functional_passes:
            if decompose:
                from torch._inductor.fx_passes.post_grad import remove_noop_ops

                remove_noop_ops(gm.graph)
            gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm

    return trace


def _functional_inplace_on_temporaries(graph: fx.Graph) -> None:
    """`aten.add_(t, ...)` on a temporary nothing else reads -> `aten.add(t, ...)`.

    torch.func.functionalize does not see in-place ops that a C++ composite kernel issues
    below it (ATen's rms_norm adds eps in place); AOTAutograd's functionalization does, so
    the model's graph holds the out-of-place op and the pattern must too."""
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        name = target._schema.name.split("::")[-1]
        if not name.endswith("_") or name.startswith("_"):
            continue
        first = node.args[0] if node.args else None
        if not isinstance(first, fx.Node) or first.op == "placeholder" or len(first.users) != 1:
            continue
        packet = getattr(torch.ops.aten, name[:-1], None)
        functional = getattr(packet, target._overloadname, None) if packet else None
        if functional is not None:
            node.target = functional


def example(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype).uniform_(-1, 1)


def scale_example() -> torch.Tensor:
    return torch.tensor([0.5], dtype=torch.float32)


_registration_lock = threading.Lock()


class FusionPatterns:
    """A PatternMatcherPass plus bookkeeping: what was registered, for the uuid and logs.

    `register` only records a pattern; the patterns are traced and handed to Inductor's
    pattern matcher when the matcher is first needed (`patterns`, `registered`, `apply`).
    So building a pass and asking for its uuid (the compile-cache key, on every start)
    neither imports Inductor nor traces anything: a warm start that loads every compiled
    piece from the cache never does."""

    def __init__(self, pass_name: str,
                 tracing_context: Callable[[], Any] = contextlib.nullcontext) -> None:
        self.pass_name = pass_name
        self.tracing_context = tracing_context  # entered while the patterns are traced
        self.planned: list[str] = []  # every pattern asked for, in order (for the uuid)
        self._pending: list[tuple] = []
        self._matcher: Any = None
        self._registered: list[str] = []

    def register(self, name: str, search: Callable, replace: Callable,
                 inputs: list[Any], decompose: bool,
                 extra_check: Callable[[Any], bool] | None = None) -> None:
        self.planned.append(name)
        self._pending.append((name, search, replace, inputs, decompose, extra_check))

    @property
    def patterns(self) -> Any:
        """Inductor's PatternMatcherPass with every recorded pattern registered."""
        if self._matcher is None:
            from torch._inductor.pattern_matcher import PatternMatcherPass

            self._matcher = PatternMatcherPass(pass_name=self.pass_name)
        if self._pending:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            # First use is usually inside a compile (its fake-tensor mode active): the
            # patterns are traced on real example tensors, outside that mode.
            with unset_fake_temporarily(), self.tracing_context():
                while self._pending:
                    self._register_now(*self._pending.pop(0))
        return self._matcher

    @property
    def registered(self) -> list[str]:
        """The patterns the matcher holds (a duplicate of an earlier one is skipped)."""
        self.patterns  # noqa: B018  (registers what is pending)
        return self._registered

    def _register_now(self, name: str, search: Callable, replace: Callable,
                      inputs: list[Any], decompose: bool,
                      extra_check: Callable[[Any], bool] | None) -> None:
        from torch._inductor.pattern_matcher import register_replacement

        from vllm.model_executor.kernels.cpu_loader import cpu_kernels_held_back
        from vllm.platforms import get_current_platform

        # The patterns are traced on CPU tensors; only a CPU model wants the CPU kernels.
        held_back = (contextlib.nullcontext() if get_current_platform().is_cpu()
                     else cpu_kernels_held_back())
        with _registration_lock, held_back:
            added = register_replacement(
                search, replace, inputs, make_trace_fn(decompose), self._matcher,
                extra_check=extra_check or (lambda match: True), skip_duplicates=True)
        if added is not False:
            self._registered.append(name)

    def apply(self, graph: fx.Graph) -> int:
        copies = split_shared_converts(graph)
        try:
            count = int(self.patterns.apply(graph) or 0)
        finally:
            merge_converts(graph, copies)
        if count:
            fusion_match_counter[self.pass_name] += count
        return count

    def describe(self) -> str:
        """What the patterns depend on, for the pass's uuid: the registered patterns and the
        source of the code they are traced from."""
        return ";".join(self.planned) + "|" + dependency_hash()


def _is_convert(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is torch.ops.prims.convert_element_type.default:
        return True
    return (node.target is torch.ops.aten._to_copy.default
            and set(node.kwargs) <= {"dtype"} and len(node.args) == 1)


def split_shared_converts(graph: fx.Graph, depth: int = 8) -> list[fx.Node]:
    """Give each group of readers of a dtype conversion its own copy; returns the copies.

    CSE merges identical conversions: the float32 upcast of the embedding output is shared
    by the first layer's RMSNorm and the residual add of the next one, and a pattern whose
    inner node has readers outside it cannot match. Readers are grouped when one reaches
    another within `depth` ops (the pow and the mul of one RMSNorm, the neg and the div of
    one silu stay on one copy, as their pattern needs). The copies left after matching are
    merged back (merge_converts), so the graph only changes where a pattern matched."""
    copies: list[fx.Node] = []
    for node in list(graph.nodes):
        if not _is_convert(node) or len(node.users) < 2:
            continue
        groups = _group_readers(list(node.users), depth)
        for group in groups[1:]:
            with graph.inserting_after(node):
                copy = graph.call_function(node.target, node.args, dict(node.kwargs))
            copy.meta = dict(node.meta)
            for user in group:
                user.replace_input_with(node, copy)
            copies.append(copy)
    return copies


def _group_readers(users: list[fx.Node], depth: int) -> list[list[fx.Node]]:
    parent = {u: u for u in users}

    def find(u: fx.Node) -> fx.Node:
        while parent[u] is not u:
            parent[u] = parent[parent[u]]
            u = parent[u]
        return u

    for u in users:
        frontier, seen = [u], {u}
        for _ in range(depth):
            frontier = [n for f in frontier for n in f.users if n not in seen]
            seen.update(frontier)
            if not frontier:
                break
        for other in users:
            if other is not u and other in seen:
                parent[find(other)] = find(u)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for u in users:
        groups.setdefault(find(u), []).append(u)
    return list(groups.values())


def merge_converts(graph: fx.Graph, copies: list[fx.Node]) -> None:
    """Undo split_shared_converts for the copies that survived (still in the graph)."""
    alive = {node for node in graph.nodes if node.op == "call_function"}
    first: dict[tuple, fx.Node] = {}
    for node in graph.nodes:
        if _is_convert(node):
            first.setdefault((node.target, node.args, tuple(sorted(node.kwargs.items()))), node)
    for copy in copies:
        if copy not in alive:
            continue
        original = first.get((copy.target, copy.args, tuple(sorted(copy.kwargs.items()))))
        if original is not None and original is not copy:
            copy.replace_all_uses_with(original)
            graph.erase_node(copy)


@functools.lru_cache(maxsize=None)
def dependency_hash() -> str:
    """Hash of the sources the patterns and replacements come from (this module, the layers
    whose forwards are traced, the quant op definitions)."""
    from vllm.compilation.passes.inductor_pass import source_hash
    from vllm.model_executor.kernels import fp8_ops
    from vllm.model_executor.layers import activation, layernorm
    from vllm.model_executor.layers.quantization import input_quant_fp8

    return source_hash(dependency_hash, fp8_ops.ref_static_quant,
                       activation.SiluAndMul, layernorm.RMSNorm, input_quant_fp8.QuantFP8)


def same_dtype_check(dtype: torch.dtype, names: Iterable[str]) -> Callable[[Any], bool]:
    """extra_check: the matched inputs `names` all have `dtype` (the fused kernels read every
    input in the activation dtype)."""
    names = tuple(names)

    def check(match: Any) -> bool:
        for name in names:
            node = match.kwargs.get(name)
            val = node.meta.get("val") if isinstance(node, fx.Node) else None
            if val is None or getattr(val, "dtype", None) != dtype:
                return False
        return True

    return check


def combinations(*options: Iterable[Any]) -> Iterable[tuple]:
    return itertools.product(*options)
