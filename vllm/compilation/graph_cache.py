"""Warm starts without Dynamo: the traced graph saved in the compile cache next to the pieces.

After the first forward of a compile with the cache on, `save_graph` writes `graph.pkl` into
the compile-cache entry directory (checksummed in its manifest like the pieces):
  split_module   the split GraphModule with its piece submodules (pickled as FX code; the
                 compiled runnables are not in it, they are the piece entries)
  sources        per input of Dynamo's graph, the Python expression Dynamo read it from:
                 "L['input_ids']", "L['input_ids'].size()[0]" (a dynamic size),
                 "L['self']._modules['norm']._parameters['weight']" ...
  args           per forward argument: dtype and dim of a tensor, or the constant it was
  output         how the forward's return value is made of the graph's outputs
  pieces         per compiled piece: where the token count is, its compile ranges and their
                 cache keys, the digest of its graph (for static compile sizes)
and, under `<cache root>/graph_index/`, the files Dynamo traced, filed under the key made
without them (the only part of the entry's key a start cannot compute before tracing).

A later start with the same key (`load_graph`, on the first forward) rebuilds the runnable
from that: it evaluates the sources against {"L": the forward's arguments, self included},
loads the compiled pieces from the cache and calls the split module directly on every
forward, with no torch.compile at all. Weights and buffers (sources under L['self']) are
resolved once; each call checks that they are still the same objects (re-resolving them
otherwise), evaluates the per-call sources, and checks dtype and dim of the tensor arguments
in place of Dynamo's guards (a mismatch falls back to Dynamo, with a warning). Anything
missing, damaged or not evaluable is logged in one line and the start traces with Dynamo as
before (whose compiles still come from the cache). Side effects a forward has beyond its
return value (setting attributes) are not replayed: forwards must not have any.
"""
from __future__ import annotations

import json
import os
import pickle
import re
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
from vllm.compilation.monitor import get_startup_timer
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.compilation.backends import VllmBackend

logger = init_logger(__name__)

GRAPH_ENTRY = "graph.pkl"
GRAPH_TAG = "traced-graph"  # the entry's "graph_hash" in the manifest
_FORMAT = 1


class GraphCacheMiss(Exception):
    """The saved graph cannot be used; the message says why."""


class GuardMismatch(Exception):
    """A call the loaded graph does not serve (another dtype or rank): trace with Dynamo."""


# ---- saving ------------------------------------------------------------------------------
def capture_graph(backend: VllmBackend, gm: torch.fx.GraphModule,
                  split_gm: torch.fx.GraphModule) -> None:
    """At split time (before the pieces replace the submodules): the Dynamo graph's input
    sources and kinds, and the split module pickled. Leaves them unset when not possible."""
    sources, kinds = [], []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", None)
        name = name() if callable(name) else name
        if not isinstance(name, str):
            logger.info("compile cache: the traced graph will not be saved (input %s has no "
                        "source)", node.name)
            return
        sources.append(name)
        value = node.meta.get("example_value")
        kinds.append("tensor" if isinstance(value, torch.Tensor) else "int")
    try:
        data = pickle.dumps(split_gm)
    except Exception as e:
        logger.info("compile cache: the traced graph will not be saved (the split module "
                    "does not pickle: %s: %s)", type(e).__name__, e)
        return
    backend.graph_sources, backend.graph_kinds, backend.split_pickle = sources, kinds, data


def save_graph(backend: VllmBackend, model: Any, signature: Any, bound: Any,
               output: Any) -> None:
    """After the first forward through Dynamo: write the graph entry and the index."""
    recorder = backend.output_recorder
    if recorder is None or backend.cache is None or backend.split_pickle is None:
        return
    graph_outputs, recorder.outputs = recorder.outputs, None
    try:
        record = _make_record(backend, model, signature, bound, output, graph_outputs)
        pickle.loads(backend.split_pickle)  # it must load back (FX re-traces its code)
    except Exception as e:
        logger.info("compile cache: the traced graph is not saved (%s); warm starts will "
                    "trace with Dynamo", e)
        return
    data = pickle.dumps(record)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

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
            "split_module": backend.split_pickle}


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
    loads_before = timer.seconds("inductor compilation")
    try:
        runner = _load(backend, model, signature, forward, bound)
    except GraphCacheMiss as e:
        reason = str(e)
    except Exception as e:  # a damaged entry, a pickle from other code: never trusted
        reason = f"{type(e).__name__}: {e}"
    else:
        seconds = time.perf_counter() - start
        timer.record("graph loading", seconds - (timer.seconds("inductor compilation")
                                                 - loads_before),
                     model=type(model).__name__, source="compile cache, Dynamo not run")
        compilation_counter.num_graphs_loaded += 1
        logger.info("Loaded the traced graph of %s and its %d compiled pieces from the "
                    "compile cache in %.2f s (Dynamo not run)", type(model).__name__,
                    len(backend.piece_backends), seconds)
        return runner
    timer.record("graph loading", time.perf_counter() - start, uncounted=True,
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
    from vllm.compilation.inductor_pass import Range

    for key, (index, (start, end)) in first_of_key.items():
        name = backend.piece_entry(index, Range(start, end))
        if cache.lookup(name, key) is None:
            raise GraphCacheMiss(f"compiled piece {name} is missing or damaged")
    split_gm = pickle.loads(record["split_module"])
    backend.cache, backend.traced_files = cache, traced
    logger.info("compile cache: using %s", directory)
    runner.forward = backend.restore(split_gm, record["items"])
    runner.build(locals_)  # the per-call sources evaluate too
    cache.graph_loaded = True
    backend.report_when_done()
    return runner


_LAST = re.compile(r"^(?P<parent>.+)(?:\[(?P<key>'(?:[^'\\]|\\.)*'|\d+)\]|"
                   r"\.(?P<attr>[A-Za-z_]\w*))$")


class CachedGraphRunner:
    """Calls the split module loaded from the cache with the graph inputs computed from the
    forward's arguments (see the module docstring). Raises GuardMismatch for a call the
    graph does not serve."""

    def __init__(self, model: Any, signature: Any, record: dict[str, Any],
                 globals_: dict[str, Any]) -> None:
        self.model = model
        self.signature = signature
        self.globals = globals_
        self.self_name = record["self"]
        self.arg_names = [a[0] for a in record["args"]]
        self.args = record["args"]
        self.sources: list[str] = record["sources"]
        self.kinds: list[str] = record["kinds"]
        self.forward: Callable = lambda *a: None
        self.unflatten = _unflattener(record["output"])
        self.guard = self._compile_guard()
        # Sources under `self` are resolved once (weights, buffers); each call checks that
        # the objects are still in place (`parent[key] is value` / `parent.attr is value`).
        stable, checks, parts = [], [], []
        prefix = f"L[{self.self_name!r}]"
        for source in self.sources:
            match = _LAST.match(source) if source.startswith(prefix) else None
            if match is None:
                parts.append(f"({source})")
                continue
            i = len(stable)
            stable.append((source, match["parent"]))
            last = f"[{match['key']}]" if match["key"] is not None else f".{match['attr']}"
            checks.append(f"C[{i}]{last} is not S[{i}]")
            parts.append(f"S[{i}]")
        self.stable_sources = stable
        self.stable: list[Any] = []
        self.parents: list[Any] = []
        self._build = _function("L, S, G", "return (" + "".join(p + ", " for p in parts) + ")")
        self._stale = _function("C, S", "return " + (" or ".join(checks) or "False"))

    def _compile_guard(self) -> Callable[[dict[str, Any]], bool]:
        terms, dtypes, consts = [], [], []
        for name, kind, *rest in self.args:
            value = f"L[{name!r}]"
            if kind == "tensor":
                dtypes.append(getattr(torch, rest[0]))
                terms.append(f"isinstance({value}, Tensor) and {value}.dtype is "
                             f"D[{len(dtypes) - 1}] and {value}.dim() == {int(rest[1])}")
            elif rest[0] is None:
                terms.append(f"{value} is None")
            else:
                consts.append(rest[0])
                i = len(consts) - 1
                terms.append(f"type({value}) is type(K[{i}]) and {value} == K[{i}]")
        return _function("L", "return " + " and ".join(f"({t})" for t in terms or ["True"]),
                         Tensor=torch.Tensor, D=dtypes, K=consts)

    def explain(self, locals_: dict[str, Any]) -> str:
        wrong = []
        for name, kind, *rest in self.args:
            value = locals_.get(name)
            if kind == "tensor":
                have = (f"{str(value.dtype).split('.')[-1]} dim {value.dim()}"
                        if isinstance(value, torch.Tensor) else type(value).__name__)
                if have != f"{rest[0]} dim {rest[1]}":
                    wrong.append(f"{name}: {have}, saved {rest[0]} dim {rest[1]}")
            elif value != rest[0] or type(value) is not type(rest[0]):
                wrong.append(f"{name}: {value!r}, saved {rest[0]!r}")
        return "; ".join(wrong) or "?"

    def resolve(self, locals_: dict[str, Any]) -> None:
        """Evaluate the sources under `self` (again after a weight was replaced)."""
        namespace = {"L": locals_, "G": self.globals}
        stable, parents = [], []
        for source, parent in self.stable_sources:
            try:
                stable.append(eval(source, namespace))
                parents.append(eval(parent, namespace))
            except Exception as e:
                raise GraphCacheMiss(f"source {source} does not evaluate "
                                     f"({type(e).__name__}: {e})") from None
        self.stable, self.parents = stable, parents

    def build(self, locals_: dict[str, Any]) -> tuple:
        try:
            graph_args = self._build(locals_, self.stable, self.globals)
        except Exception as e:
            raise GraphCacheMiss(f"an input source does not evaluate ({type(e).__name__}: "
                                 f"{e})") from None
        for source, kind, value in zip(self.sources, self.kinds, graph_args):
            if (kind == "tensor") != isinstance(value, torch.Tensor):
                raise GraphCacheMiss(f"source {source} gives a {type(value).__name__}, the "
                                     f"graph takes a {kind}")
        return graph_args

    def locals_for(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        if not kwargs and len(args) == len(self.arg_names):
            locals_ = dict(zip(self.arg_names, args))
            locals_[self.self_name] = self.model
            return locals_
        bound = self.signature.bind(self.model, *args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        locals_ = self.locals_for(args, kwargs)
        if not self.guard(locals_):
            raise GuardMismatch(self.explain(locals_))
        if self._stale(self.parents, self.stable):
            try:
                self.resolve(locals_)
            except GraphCacheMiss as e:
                raise GuardMismatch(str(e)) from None
            logger.info("A weight of %s was replaced: the loaded graph's inputs were resolved "
                        "again", type(self.model).__name__)
        return self.unflatten(self.forward(*self._build(locals_, self.stable, self.globals)))


def _function(params: str, body: str, **namespace: Any) -> Callable:
    """A function compiled from generated code (the sources come from our own cache entry)."""
    code = f"def _generated({params}):\n    {body}\n"
    exec(compile(code, "<vllm graph cache>", "exec"), namespace)
    return namespace["_generated"]


def _unflattener(spec: list[Any]) -> Callable[[Any], Any]:
    kind = spec[0]
    if kind == "graph":
        i = spec[1]
        return lambda out: out[i]
    if kind == "none":
        return lambda out: None
    parts = [_unflattener(s) for s in spec[1]]
    container = tuple if kind == "tuple" else list
    return lambda out: container(p(out) for p in parts)
