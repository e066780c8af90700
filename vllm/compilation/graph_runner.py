"""Calling the split module loaded from the compile cache in place of Dynamo's compiled code
(graph_cache.py saves and loads it).

Dynamo's compiled code reads each input of the traced graph from the frame (its "source":
"L['input_ids']", "L['input_ids'].size()[0]", "L['self']._modules['norm']._parameters[
'weight']"), checks its guards, calls the graph and builds the return value from the graph's
outputs. `CachedGraphRunner` does the same from the saved sources: weights and buffers
(sources under `self`) resolved once, with a check per call that they are still the same
objects (resolved again, and their shapes checked, when one was replaced); the others
evaluated per call by one generated function; dtype and dim of the tensor arguments (and the
value of the others) checked in place of the guards.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from vllm.compilation.cache import GraphCacheMiss
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["CachedGraphRunner", "GraphCacheMiss", "GuardMismatch", "tensor_meta"]


class GuardMismatch(Exception):
    """A call the loaded graph does not serve (another dtype or rank): trace with Dynamo."""


def tensor_meta(value: Any) -> list[Any] | None:
    if not isinstance(value, torch.Tensor):
        return None
    return [str(value.dtype).split(".")[-1], list(value.shape), value.device.type]


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
        self.defaults = {name: p.default for name, p in signature.parameters.items()
                         if p.default is not p.empty}
        self.args = record["args"]
        self.sources: list[str] = record["sources"]
        self.kinds: list[str] = record["kinds"]
        self.stable_meta: list[Any] | None = record.get("stable_meta")
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
        if self.stable_meta is not None:
            for (source, _), value, saved in zip(self.stable_sources, stable, self.stable_meta):
                if tensor_meta(value) != saved:
                    raise GraphCacheMiss(f"{source} is {tensor_meta(value)}, the saved graph "
                                         f"was compiled for {saved}")
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
        # Positional arguments, the rest by name or left to their defaults (the model runner's
        # calls): no binding (inspect's bind and apply_defaults cost ~9 us a step).
        if len(args) <= len(self.arg_names):
            locals_ = dict(zip(self.arg_names, args))
            rest = self.arg_names[len(args):]
            if all(name in kwargs or name in self.defaults for name in rest) and all(
                    name in rest for name in kwargs):
                for name in rest:
                    locals_[name] = kwargs[name] if name in kwargs else self.defaults[name]
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
