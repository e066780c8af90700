"""Warm starts without Dynamo: the traced graph saved in the compile cache next to the pieces.

After the first forward of a compile with the cache on, `save_graph` writes `graph.pkl` into
the compile-cache entry directory (checksummed in its manifest like the pieces):
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
and, under `<cache root>/graph_index/`, the files Dynamo traced, filed under the key made
without them (the only part of the entry's key a start cannot compute before tracing).

A later start with the same key (`load_graph`, on the first forward) rebuilds the runnable
from that, with no torch.compile at all: the compiled pieces come from the cache as on the
Dynamo path, and a `CachedGraphRunner` (graph_runner.py) computes the graph's inputs from the
forward's arguments on every call and checks what Dynamo's guards would have (a call it does
not serve falls back to Dynamo, with a warning). Anything missing, damaged or not evaluable
is logged in one line and the start traces with Dynamo as before (its compiles still come
from the cache, and the graph is saved again). Side effects a forward has beyond its return
value (setting attributes) are not replayed: forwards must not have any.
"""
from __future__ import annotations

import json
import os
import pickle
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm.compilation.cache import (
    CompileCache,
    _files_hash,
    cache_disabled_reason,
    cache_root,
    compute_cache_factors,
    compute_cache_key,
)
from vllm.compilation.counter import compilation_counter
from vllm.compilation.graph_runner import (  # noqa: F401 (re-exported)
    CachedGraphRunner,
    GraphCacheMiss,
    GuardMismatch,
    tensor_meta,
)
from vllm.compilation.monitor import CPU_KERNEL_BUILD, get_startup_timer
from vllm.compilation.piecewise_backend import PiecewiseBackend
from vllm.compilation.split import SplitItem
from vllm.config.utils import Range
from vllm.logger import init_logger
from vllm.utils.progress import waiting

if TYPE_CHECKING:
    from vllm.compilation.backends import VllmBackend

logger = init_logger(__name__)

GRAPH_ENTRY = "graph.pkl"
GRAPH_TAG = "traced-graph"  # the entry's "graph_hash" in the manifest
_FORMAT = 2  # 2: the compiled pieces' graphs pickled apart


# ---- saving ------------------------------------------------------------------------------
class FirstOutputRecorder:
    """What Dynamo calls: the split module, keeping the graph outputs of the first call (for
    mapping the forward's return value onto them when the traced graph is saved)."""

    def __init__(self, forward: Callable) -> None:
        self.forward = forward
        self.outputs: Any = None
        self.recording = True

    def __call__(self, *args: Any) -> Any:
        out = self.forward(*args)
        if self.recording:
            self.outputs, self.recording = out, False
        return out


def capture_graph(backend: VllmBackend, gm: torch.fx.GraphModule,
                  split_gm: torch.fx.GraphModule) -> None:
    """At split time (before the pieces replace the submodules): the Dynamo graph's input
    sources and kinds, and, with the compile cache on, the split module pickled. Leaves the
    sources unset when not possible (then Dynamo serves every call)."""
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
            return
        sources.append(name)
        value = node.meta.get("example_value")
        kinds.append("tensor" if isinstance(value, torch.Tensor) else "int")
    backend.graph_sources, backend.graph_kinds = sources, kinds
    if backend.cache is None:
        return
    try:
        backend.split_pickle = _pickle_split_module(split_gm, backend.pieces)
    except Exception as e:
        logger.info("compile cache: the traced graph will not be saved (the split module "
                    "does not pickle: %s: %s)", type(e).__name__, e)


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
    recorder = backend.output_recorder
    if recorder is None:
        return None
    graph_outputs, recorder.outputs = recorder.outputs, None
    try:
        record = _make_record(backend, model, signature, bound, output, graph_outputs)
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
    runner.forward = recorder.forward
    if backend.cache is not None and backend.split_pickle is not None:
        try:  # FX re-traces their code: they must load back
            pickle.loads(backend.split_pickle["split_module"])
            for data in backend.split_pickle["piece_modules"].values():
                pickle.loads(data)
        except Exception as e:
            logger.info("compile cache: the traced graph is not saved (the split module does "
                        "not load back: %s: %s); warm starts will trace with Dynamo",
                        type(e).__name__, e)
        else:
            _save(backend, record)
    return runner


def _save(backend: VllmBackend, record: dict[str, Any]) -> None:
    data = pickle.dumps(record)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    assert backend.cache is not None
    try:
        backend.cache.store(GRAPH_ENTRY, GRAPH_TAG, write)
        _write_index(backend, backend.traced_files)
    except Exception as e:
        logger.warning("compile cache: could not save %s: %s", GRAPH_ENTRY, e)
        return
    compilation_counter.num_graphs_saved += 1


def _make_record(backend: VllmBackend, model: Any, signature: Any, bound: Any, output: Any,
                 graph_outputs: Any) -> dict[str, Any]:
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
            "args": args, "sources": backend.graph_sources, "kinds": backend.graph_kinds,
            "output": _output_spec(output, graph_outputs), "items": items,
            **(backend.split_pickle or {})}


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


def _index_path(backend: VllmBackend) -> tuple[str, dict[str, str]]:
    """Where the traced-file list lives: keyed by the entry key's factors without them."""
    factors = compute_cache_factors(backend.vllm_config, backend.model_source_files,
                                    backend.pass_manager.uuid())
    key = compute_cache_key(factors)
    path = os.path.join(cache_root(backend.vllm_config), "graph_index",
                        f"{key[:16]}.rank_{backend.rank}.json")
    return path, factors


def _write_index(backend: VllmBackend, traced_files: list[str]) -> None:
    path, _ = _index_path(backend)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"traced_files": traced_files}, f)
    os.replace(tmp, path)


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
    index, factors = _index_path(backend)
    try:
        with open(index) as f:
            traced = list(json.load(f)["traced_files"])
    except FileNotFoundError:
        raise GraphCacheMiss("none saved for this model and config yet") from None
    factors = {**factors, "model_source": _files_hash(backend.model_source_files + traced)}
    directory = os.path.join(cache_root(backend.vllm_config), compute_cache_key(factors)[:10],
                             f"rank_{backend.rank}")
    if not os.path.isdir(directory):
        raise GraphCacheMiss("no cache entry for the current source of the traced files")
    cache = CompileCache(directory, factors)
    path = cache.lookup(GRAPH_ENTRY, GRAPH_TAG)
    if path is None:
        raise GraphCacheMiss(f"{GRAPH_ENTRY} is missing or damaged in {directory}")
    with open(path, "rb") as f:
        record = pickle.load(f)
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
    first_of_key: dict[str, tuple[int, Any]] = {}
    for item in record["items"]:
        for start, end, key in ([] if item["splitting"] else item["piece"]["ranges"]):
            first_of_key.setdefault(key, (item["index"], (start, end)))
    for key, (index, (start, end)) in first_of_key.items():
        name = backend.piece_entry(index, Range(start, end))
        if cache.lookup(name, key) is None:
            raise GraphCacheMiss(f"compiled piece {name} is missing or damaged")
    split_gm = pickle.loads(record["split_module"])
    backend.cache, backend.traced_files = cache, traced
    logger.info("compile cache: using %s", directory)
    runner.forward = _restore(backend, split_gm, record["items"], record["piece_modules"])
    runner.build(locals_)  # the per-call sources evaluate too
    cache.graph_loaded = True
    backend.report_when_done()
    return runner


def _restore(backend: VllmBackend, split_gm: torch.fx.GraphModule,
             saved_items: list[dict[str, Any]], piece_modules: dict[str, bytes]) -> Callable:
    """The runnable from the split module and its pieces' saved info, each compiled piece
    loaded from the compile cache (its graph unpickled from `piece_modules` when needed)."""
    items = [SplitItem(i["index"], i["name"], i["splitting"], getattr(split_gm, i["name"]))
             for i in saved_items]
    info = {i["index"]: i.get("piece") for i in saved_items}
    backend.split_gm, backend.pieces, backend.piece_backends = split_gm, items, []

    def make_piece(item: SplitItem) -> PiecewiseBackend:
        saved = info[item.index]
        loaded = {Range(s, e): _load_piece(backend, item.index, Range(s, e), key)
                  for s, e, key in saved["ranges"]}
        data = piece_modules[item.name]
        return PiecewiseBackend.restore(lambda: pickle.loads(data), saved, backend, loaded)

    backend.install_pieces(split_gm, items, make_piece)
    return split_gm.forward


def _load_piece(backend: VllmBackend, piece_index: int, compile_range: Range, key: str
                ) -> Callable:
    """One piece compile from the compile cache only (the caller checked that the entry is
    there): shared like `VllmBackend.compile_piece`, counted as a backend compilation and a
    cache hit. Raises when it cannot be loaded."""
    cache = backend.cache
    assert cache is not None
    compilation_counter.num_backend_compilations += 1
    tag = compile_range.tag
    shared = backend.shared_runnable(key, piece_index, tag)
    if shared is not None:
        return shared
    name = backend.piece_entry(piece_index, compile_range)
    what = backend.piece_label(piece_index, compile_range)
    with backend.cache_lock(what), \
            backend.timer.phase("inductor compilation", piece=piece_index, range=tag,
                                backend="inductor", cache="load failed") as details:
        path = cache.lookup(name, key)
        if path is None:
            details["cache"] = "missing"
            raise FileNotFoundError(f"{name} is missing or damaged")
        with waiting(logger, f"Loading {what} from the compile cache", announce=False,
                     done=f"Loaded {what} from the compile cache"):
            artifact, details["cache"] = backend.load_cached_piece(name, key, path)
    cache.record(name, hit=True)
    backend.share(key, piece_index, artifact)
    return artifact
