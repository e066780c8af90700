"""The graph-pass interface (`InductorPass`, `CallableInductorPass`), the base class of our
own passes (`VllmInductorPass`), and the per-compile pass context.

A pass rewrites a functional ATen-level `torch.fx.Graph` in place (Inductor's post-grad IR, or
the same IR produced by AOTAutograd for the "eager" backend). Its `uuid()` identifies it in the
compile caches' keys: by default a hash of its source, so editing a pass invalidates compiled
artifacts that went through it. Compile ranges (`Range`) live in `vllm.config.utils`.

Unlike upstream's, `InductorPass` does not derive from Inductor's `CustomGraphPass`: importing
Inductor costs ~1.4 s, and a warm start that loads every piece runs without it. The pass
manager is wrapped into a `CustomGraphPass` only when Inductor compiles
(`PostGradPassManager.as_inductor_pass`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import os
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch.fx as fx

from vllm.config.utils import Range, compile_ranges
from vllm.logger import init_logger

__all__ = ["CallableInductorPass", "InductorPass", "PassContext", "Range", "VllmInductorPass",
           "compile_ranges", "get_pass_context", "pass_context", "source_hash"]

logger = init_logger(__name__)


@dataclasses.dataclass
class PassContext:
    """What a pass may know about the compile it runs in."""

    compile_range: Range | None = None
    piece_index: int | None = None
    dump_dir: str | None = None
    """Where the pass manager writes before/after graphs (debug_dump_path), if anywhere."""


_pass_context: ContextVar[PassContext | None] = ContextVar("vllm_pass_context", default=None)


@contextlib.contextmanager
def pass_context(compile_range: Range | None = None, **fields: Any) -> Iterator[PassContext]:
    """Make a `PassContext` (the compile range, and optionally `piece_index`, `dump_dir`)
    what `get_pass_context()` returns inside the block."""
    ctx = PassContext(compile_range=compile_range, **fields)
    token = _pass_context.set(ctx)
    try:
        yield ctx
    finally:
        _pass_context.reset(token)


def get_pass_context() -> PassContext:
    return _pass_context.get() or PassContext()


def _source_of(obj: Any) -> bytes:
    """The text a pass is identified by: a file's contents for a path to a file, the text
    itself for another string, else the source file defining `obj` (seen through decorators
    such as `functools.cache`), or its qualified name if it has none. Never a repr: a repr may
    hold a memory address, which would make the hash differ between processes."""
    if isinstance(obj, str):
        if os.path.isfile(obj):
            with open(obj, "rb") as f:
                return f.read()
        return obj.encode()
    obj = inspect.unwrap(obj)
    try:
        with open(inspect.getsourcefile(obj) or "", "rb") as f:
            return f.read()
    except (OSError, TypeError):
        name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
        return f"{getattr(obj, '__module__', '')}.{name}".encode()


def source_hash(*objs: Any) -> str:
    """sha256 over the source files defining the given classes/functions (whole files, so a
    helper edited next to a pass changes the hash too), or over files named by path."""
    h = hashlib.sha256()
    for obj in objs:
        h.update(_source_of(obj))
    return h.hexdigest()


class InductorPass:
    """A graph pass: `__call__(graph)` rewrites a `torch.fx.Graph` in place.

    `uuid()` identifies the pass in compile-cache keys; the default hashes the source file of
    the pass's class, so a pass whose behaviour depends on state must override it (e.g. with
    `hash_dict` of that state). `is_applicable_for_range` lets a pass skip compile ranges it
    does not apply to."""

    def __call__(self, graph: fx.Graph) -> None:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return type(self).__name__

    def uuid(self) -> str:
        return self.hash_source(type(self))

    def is_applicable_for_range(self, compile_range: Range | None) -> bool:
        return True

    @staticmethod
    def hash_source(*srcs: Any) -> str:
        """sha256 over the sources of classes, functions or files (a path string) given."""
        return source_hash(*srcs)

    @staticmethod
    def hash_dict(dict_: dict[Any, Any]) -> str:
        """sha256 of a JSON-encodable dict, independent of key order."""
        text = json.dumps(dict_, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()


class CallableInductorPass(InductorPass):
    """Any callable `fn(graph)` as a pass. Its uuid is `uuid` when given, else the hash of the
    callable's source file."""

    def __init__(self, callable: Callable[[fx.Graph], Any], uuid: str | None = None) -> None:
        self.callable = callable
        self._uuid = uuid if uuid is not None else self.hash_source(callable)

    @property
    def name(self) -> str:
        return getattr(self.callable, "__name__", type(self.callable).__name__)

    def __call__(self, graph: fx.Graph) -> None:
        self.callable(graph)

    def uuid(self) -> str:
        return self._uuid


class VllmInductorPass(InductorPass):
    """A graph pass of ours: `__call__(graph)` rewrites in place and bumps `matched_count`.

    Subclasses implement `apply(graph)` returning the number of rewrites, and may override
    `is_applicable_for_range` (e.g. a fusion only valid for small batches) and `uuid_extra`
    (state beyond the source, such as a threshold taken from the config).
    """

    def __init__(self, vllm_config: Any = None) -> None:
        # Upstream's passes are built as `Pass(vllm_config)`; ours take it too.
        self.compilation_config = getattr(vllm_config, "compilation_config", None)
        self.matched_count = 0
        """Rewrites done by the most recent call."""
        self.total_matched = 0
        """Rewrites done over all calls in this process."""

    def apply(self, graph: fx.Graph) -> int:
        raise NotImplementedError

    def __call__(self, graph: fx.Graph) -> None:
        start = time.perf_counter()
        self.matched_count = int(self.apply(graph) or 0)
        self.total_matched += self.matched_count
        logger.debug("%s: replaced %d patterns in %.1f ms", self.name, self.matched_count,
                     (time.perf_counter() - start) * 1e3)

    def uuid_extra(self) -> str:
        return ""

    def uuid(self) -> str:
        return hashlib.sha256(
            (source_hash(type(self)) + self.uuid_extra()).encode()).hexdigest()
