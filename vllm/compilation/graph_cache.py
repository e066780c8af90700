"""Warm starts without Dynamo: the traced graph saved in the compile cache next to the pieces.

After the first forward of a compile with the cache on, `runner_after_trace` saves the
traced-graph record with `CompileCache.store_graph` (`graph.pkl` in the entry directory,
checksummed in its manifest like the pieces):
  split_module   the split GraphModule with its splitting submodules (pickled as FX code)
                 and a placeholder for each compiled piece
  piece_modules  each compiled piece's graph, pickled apart (FX re-traces a graph it
                 unpickles: a warm start does so only to compile a size at run time); the
                 compiled runnables are not in them, they are the piece entries
  sources        per input of Dynamo's graph, the Python expression Dynamo read it from:
                 "L['input_ids']", "L['input_ids'].size()[0]" (a dynamic size),
                 "L['self']._modules['norm']._parameters['weight']" ...
  args           per forward argument: dtype and dim of a tensor, or the constant it was
  output         how the forward's return value is made of the graph's outputs
  stable_meta    dtype, shape and device of each weight and buffer the graph takes
  pieces         per compiled piece: where the token count is, its compile ranges and their
                 cache keys, the digest of its graph (for static compile sizes)
and the compile cache files the traced files in its index (the only part of the entry's key
a start cannot compute before tracing: `CompileCache.find_saved_graph`).

A later start with the same key (`load_graph`, on the first forward) rebuilds the runnable
from that, with no torch.compile at all: the compiled pieces come from the cache through the
backend's one piece path (`VllmBackend.compile_piece`, load only), and a `CachedGraphRunner`
(graph_runner.py) computes the graph's inputs from the forward's arguments on every call and
checks what Dynamo's guards would have (a call it does not serve falls back to Dynamo, with
a warning). Anything missing, damaged or not evaluable
is logged in one line and the start traces with Dynamo as before (its compiles still come
from the cache, and the graph is saved again). Side effects a forward has beyond its return
value (setting attributes) are not replayed: forwards must not have any.

Why not torch's own mechanism: torch 2.13's AOT compile (`torch.compiler.
load_compiled_function`) saves Dynamo's output with its guards, but loading it imports Dynamo
(and its compiled pieces Inductor): 1.4-3.4 s that a warm start skips (see
benchmarks/results/warm_start_fold.md); the saved graph is plain data and FX pickles instead.
"""
from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm.compilation.cache import GRAPH_ENTRY, CompileCache, cache_disabled_reason
from vllm.compilation.counter import compilation_counter
from vllm.compilation.graph_runner import (  # noqa: F401 (re-exported)
    CachedGraphRunner,
    GraphCacheMiss,
    GuardMismatch,
    tensor_meta,
)
from vllm.compilation.piecewise_backend import PiecewiseBackend
from vllm.compilation.split import SplitItem
from vllm.config.utils import Range
from vllm.logger import init_logger
from vllm.utils.progress import waiting
from vllm.utils.startup_timer import CPU_KERNEL_BUILD, get_startup_timer

if TYPE_CHECKING:
    from vllm.compilation.backends import VllmBackend

logger = init_logger(__name__)

__all__ = ["GRAPH_ENTRY", "CachedGraphRunner", "GraphCacheMiss", "GraphCapture",
           "GuardMismatch", "capture_graph", "load_graph", "runner_after_trace"]

_FORMAT = 2  # 2: the compiled pieces' graphs pickled apart


# ---- saving ------------------------------------------------------------------------------
class GraphCapture:
    """Taken at split time, for serving calls without Dynamo and saving the traced graph:
    the Dynamo graph's input sources and kinds, the split module pickled before its pieces
    replace the submodules (`split_pickle`, when it is to be saved), and the graph outputs of
    the first call (for mapping the forward's return value onto them)."""

    def __init__(self, sources: list[str], kinds: list[str],
                 split_pickle: dict[str, Any] | None) -> None:
        self.sources, self.kinds, self.split_pickle = sources, kinds, split_pickle
        self.forward: Callable | None = None
        self.outputs: Any = None
        self._recording = False

    def record_first_outputs(self, forward: Callable) -> Callable:
        """What Dynamo calls: `forward` (the split module), keeping its first outputs."""
        self.forward, self._recording = forward, True

        def call(*args: Any) -> Any:
            out = forward(*args)
            if self._recording:
                self.outputs, self._recording = out, False
            return out

        return call


def capture_graph(gm: torch.fx.GraphModule, split_gm: torch.fx.GraphModule,
                  items: list[SplitItem], save: bool) -> GraphCapture | None:
    """At split time (before the pieces replace the submodules): the Dynamo graph's input
    sources and kinds, and, when the graph is to be saved (`save`: the compile cache is on),
    the split module pickled. None when not possible (then Dynamo serves every call)."""
    sources, kinds = [], []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", None)
        name = name() if callable(name) else name
        if not isinstance(name, str):
            logger.info("the traced graph's input %s has no source: calls keep going through "
                        "Dynamo and the graph is not saved", node.name)
            return None
        sources.append(name)
        value = node.meta.get("example_value")
        kinds.append("tensor" if isinstance(value, torch.Tensor) else "int")
    split_pickle = None
    if save:
        try:
            split_pickle = _pickle_split_module(split_gm, items)
        except Exception as e:
            logger.info("compile cache: the traced graph will not be saved (the split module "
                        "does not pickle: %s: %s)", type(e).__name__, e)
    return GraphCapture(sources, kinds, split_pickle)


def _pickle_split_module(split_gm: torch.fx.GraphModule, items: list[SplitItem]
                         ) -> dict[str, Any]:
    """The split module pickled with a placeholder for each compiled piece, and each piece
    pickled apart: unpickling a GraphModule re-traces its code with FX, and a warm start
    needs the pieces' graphs only to compile a size at run time (25 pieces of the
    Qwen2.5-0.5B shape: ~0.15 s of its start)."""
    pieces = [item.name for item in items if not item.is_splitting]
    modules = split_gm._modules
    graphs = {name: modules[name] for name in pieces}
    try:
        for name in pieces:
            modules[name] = torch.nn.Module()
        top = pickle.dumps(split_gm)
    finally:
        modules.update(graphs)
    return {"split_module": top,
            "piece_modules": {name: pickle.dumps(graph) for name, graph in graphs.items()}}


def runner_after_trace(backend: VllmBackend, model: Any, signature: Any, forward: Callable,
                       bound: Any, output: Any) -> CachedGraphRunner | None:
    """After the first forward through Dynamo: the runner that serves the later calls in its
    place, and the graph entry written to the compile cache when it is on.

    Dynamo checks its guards on every call: one per weight and input, ~130 us a step on the
    demo model (a fifth of a batch-1 decode step on the CPU). The runner checks what a call
    can change (argument dtypes and dims, constants, weights still in place; graph_runner.py),
    as on a warm start. None (logged) when the graph's inputs cannot be computed without
    Dynamo: then Dynamo keeps serving."""
    capture = backend.capture
    if capture is None or capture.forward is None:
        return None
    graph_outputs, capture.outputs = capture.outputs, None
    try:
        record = _make_record(backend, capture, model, signature, bound, output,
                              graph_outputs)
        # The sources must evaluate now as they will at load (the weights' shapes, dtypes and
        # devices are kept, to be checked there).
        runner = CachedGraphRunner(model, signature, record, forward.__globals__)
        locals_ = dict(bound.arguments)
        runner.resolve(locals_)
        runner.build(locals_)
        record["stable_meta"] = [tensor_meta(v) for v in runner.stable]
    except Exception as e:
        logger.info("the traced graph's inputs cannot be computed without Dynamo (%s): calls "
                    "keep going through Dynamo and warm starts trace again", e)
        return None
    runner.forward = capture.forward
    if backend.cache is not None and capture.split_pickle is not None:
        try:  # FX re-traces their code: they must load back
            pickle.loads(capture.split_pickle["split_module"])
            for data in capture.split_pickle["piece_modules"].values():
                pickle.loads(data)
        except Exception as e:
            logger.info("compile cache: the traced graph is not saved (the split module does "
                        "not load back: %s: %s); warm starts will trace with Dynamo",
                        type(e).__name__, e)
        else:
            backend.cache.store_graph(record)
    return runner


def _make_record(backend: VllmBackend, capture: GraphCapture, model: Any, signature: Any,
                 bound: Any, output: Any, graph_outputs: Any) -> dict[str, Any]:
    params = list(signature.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise ValueError("the forward takes *args or **kwargs")
    bound.apply_defaults()
    args = []
    for p in params[1:]:
        value = bound.arguments[p.name]
        if isinstance(value, torch.Tensor):
            args.append([p.name, "tensor", str(value.dtype).split(".")[-1], value.dim()])
        elif value is None or isinstance(value, (bool, int, float, str)):
            args.append([p.name, "const", value])
        else:
            raise ValueError(f"forward argument {p.name!r} is a {type(value).__name__}")
    if not isinstance(graph_outputs, (tuple, list)):
        graph_outputs = (graph_outputs,)
    pieces = {piece.piece_index: piece.saved_info() for piece in backend.piece_backends}
    items = [{"index": item.index, "name": item.name, "splitting": item.is_splitting,
              **({} if item.is_splitting else {"piece": pieces[item.index]})}
             for item in backend.pieces]
    return {"format": _FORMAT, "model": _class_name(model), "self": params[0].name,
            "args": args, "sources": capture.sources, "kinds": capture.kinds,
            "output": _output_spec(output, graph_outputs), "items": items,
            **(capture.split_pickle or {})}


def _output_spec(value: Any, graph_outputs: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        for i, out in enumerate(graph_outputs):
            if out is value:
                return ["graph", i]
        raise ValueError("the forward returns a tensor that is not one of the graph's outputs")
    if value is None:
        return ["none"]
    if type(value) in (tuple, list):
        return [type(value).__name__, [_output_spec(v, graph_outputs) for v in value]]
    raise ValueError(f"the forward returns a {type(value).__name__}")


def _class_name(model: Any) -> str:
    return f"{type(model).__module__}.{type(model).__qualname__}"


# ---- loading -----------------------------------------------------------------------------
def load_graph(backend: VllmBackend, model: Any, signature: Any, forward: Callable,
               bound: Any) -> CachedGraphRunner | None:
    """The runnable rebuilt from the saved graph, or None (logged) to trace with Dynamo."""
    if cache_disabled_reason(backend.vllm_config) is not None or backend.frozen:
        return None  # the Dynamo path logs why the cache is off
    timer = get_startup_timer()
    start = time.perf_counter()
    nested = ("inductor compilation", CPU_KERNEL_BUILD)  # rows of their own
    nested_before = timer.total(nested)
    try:
        # Seconds when Inductor loads the pieces the full way (no light entries yet).
        with waiting(logger, f"Loading the traced graph of {type(model).__name__} and its "
                     "compiled pieces from the compile cache", announce=False):
            runner = _load(backend, model, signature, forward, bound)
    except GraphCacheMiss as e:
        reason = str(e)
    except Exception as e:  # a damaged entry, a pickle from other code: never trusted
        reason = f"{type(e).__name__}: {e}"
    else:
        seconds = time.perf_counter() - start
        timer.record("graph loading", seconds - (timer.total(nested) - nested_before),
                     model=type(model).__name__, source="compile cache, Dynamo not run")
        compilation_counter.num_graphs_loaded += 1
        logger.info("Loaded the traced graph of %s and its %d compiled pieces from the "
                    "compile cache in %.2f s (Dynamo not run)", type(model).__name__,
                    len(backend.piece_backends), seconds)
        return runner
    # The pieces tried before the attempt failed are their own "inductor compilation" rows.
    timer.record("graph loading", time.perf_counter() - start
                 - (timer.total(nested) - nested_before), uncounted=True,
                 result="not used")
    logger.info("compile cache: traced graph not used (%s); tracing with Dynamo", reason)
    return None


def _load(backend: VllmBackend, model: Any, signature: Any, forward: Callable,
          bound: Any) -> CachedGraphRunner:
    cache = CompileCache.find_saved_graph(backend.vllm_config, backend.model_source_files,
                                          backend.pass_manager.uuid(), backend.rank)
    record = cache.load_graph()
    if record.get("format") != _FORMAT or record.get("model") != _class_name(model):
        raise GraphCacheMiss(f"{GRAPH_ENTRY} was saved for another format or model class")
    names = [p.name for p in signature.parameters.values()]
    if names != [record["self"], *(a[0] for a in record["args"])]:
        raise GraphCacheMiss(f"the forward's arguments changed: {names}")
    runner = CachedGraphRunner(model, signature, record, forward.__globals__)
    bound.apply_defaults()
    locals_ = dict(bound.arguments)
    if not runner.guard(locals_):
        raise GraphCacheMiss("the forward's arguments differ from the saved graph's: "
                             + runner.explain(locals_))
    runner.resolve(locals_)  # raises GraphCacheMiss when a source does not evaluate
    # Check every piece entry before loading any (a missing one: trace, compile it alone).
    first_of_key: dict[str, tuple[int, Range]] = {}
    for item in record["items"]:
        for start, end, key in ([] if item["splitting"] else item["piece"]["ranges"]):
            first_of_key.setdefault(key, (item["index"], Range(start, end)))
    for key, (index, compile_range) in first_of_key.items():
        name = cache.piece_entry(index, compile_range.tag)
        if cache.lookup(name, key) is None:
            raise GraphCacheMiss(f"compiled piece {name} is missing or damaged")
    split_gm = pickle.loads(record["split_module"])
    backend.use_cache(cache)
    runner.forward = _restore(backend, split_gm, record["items"], record["piece_modules"])
    runner.build(locals_)  # the per-call sources evaluate too
    cache.graph_loaded = True
    backend.report_when_done()
    return runner


def _restore(backend: VllmBackend, split_gm: torch.fx.GraphModule,
             saved_items: list[dict[str, Any]], piece_modules: dict[str, bytes]) -> Callable:
    """The runnable from the split module and its pieces' saved info: each compiled piece
    loaded through the backend's piece path (its graph unpickled from `piece_modules` when a
    size is compiled at run time)."""
    items = [SplitItem(i["index"], i["name"], i["splitting"], getattr(split_gm, i["name"]))
             for i in saved_items]
    info = {i["index"]: i.get("piece") for i in saved_items}

    def make_piece(item: SplitItem) -> PiecewiseBackend:
        saved = info[item.index]
        loaded = {Range(s, e): backend.compile_piece(None, [], item.index, Range(s, e),
                                                     saved["digest"], key=key)
                  for s, e, key in saved["ranges"]}
        data = piece_modules[item.name]
        return PiecewiseBackend.restore(lambda: pickle.loads(data), saved, backend, loaded)

    backend.install_pieces(split_gm, items, make_piece)
    return split_gm.forward
