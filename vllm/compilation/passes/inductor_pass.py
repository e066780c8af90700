"""Base class of our graph passes, compile ranges, and the per-compile pass context.

A pass rewrites a functional ATen-level `torch.fx.Graph` in place (Inductor's post-grad IR, or
the same IR produced by AOTAutograd for the "eager" backend). Its `uuid()` hashes its source, so
editing a pass invalidates compiled artifacts that went through it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch.fx as fx

from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclasses.dataclass(frozen=True)
class Range:
    """Inclusive range of token counts [start, end] a graph is compiled for."""

    start: int
    end: int

    def __contains__(self, n: object) -> bool:
        return isinstance(n, int) and self.start <= n <= self.end

    @property
    def is_single_size(self) -> bool:
        return self.start == self.end

    def __str__(self) -> str:
        return f"[{self.start}, {self.end}]"

    @property
    def tag(self) -> str:
        """Short name used in file names: "size_16" or "range_1_2048"."""
        if self.is_single_size:
            return f"size_{self.start}"
        return f"range_{self.start}_{self.end}"


def compile_ranges(endpoints: list[int] | None, max_num_batched_tokens: int) -> list[Range]:
    """[1, e0], [e0+1, e1], ..., [e_last+1, max_num_batched_tokens] for user endpoints strictly
    between 1 and max_num_batched_tokens (others are ignored)."""
    points = sorted({e for e in (endpoints or []) if 1 < e < max_num_batched_tokens})
    ranges, start = [], 1
    for end in [*points, max_num_batched_tokens]:
        ranges.append(Range(start, end))
        start = end + 1
    return ranges


@dataclasses.dataclass
class PassContext:
    """What a pass may know about the compile it runs in."""

    compile_range: Range | None = None
    piece_index: int | None = None
    dump_dir: str | None = None
    """Where the pass manager writes before/after graphs (debug_dump_path), if anywhere."""


_pass_context: ContextVar[PassContext | None] = ContextVar("vllm_pass_context", default=None)


@contextlib.contextmanager
def pass_context(**fields: Any) -> Iterator[PassContext]:
    ctx = PassContext(**fields)
    token = _pass_context.set(ctx)
    try:
        yield ctx
    finally:
        _pass_context.reset(token)


def get_pass_context() -> PassContext:
    return _pass_context.get() or PassContext()


def source_hash(*objs: Any) -> str:
    """sha256 over the source files defining the given classes/functions (whole files, so a
    helper edited next to a pass changes the hash too)."""
    h = hashlib.sha256()
    for obj in objs:
        try:
            with open(inspect.getsourcefile(obj) or "", "rb") as f:
                h.update(f.read())
        except (OSError, TypeError):
            h.update(repr(obj).encode())
    return h.hexdigest()


class VllmInductorPass:
    """A graph pass: `__call__(graph)` rewrites in place and bumps `matched_count`.

    Subclasses implement `apply(graph)` returning the number of rewrites, and may override
    `is_applicable_for_range` (e.g. a fusion only valid for small batches) and `uuid_extra`
    (state beyond the source, such as a threshold taken from the config).
    """

    def __init__(self) -> None:
        self.matched_count = 0
        """Rewrites done by the most recent call."""
        self.total_matched = 0
        """Rewrites done over all calls in this process."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def apply(self, graph: fx.Graph) -> int:
        raise NotImplementedError

    def __call__(self, graph: fx.Graph) -> None:
        start = time.perf_counter()
        self.matched_count = int(self.apply(graph) or 0)
        self.total_matched += self.matched_count
        logger.debug("%s: replaced %d patterns in %.1f ms", self.name, self.matched_count,
                     (time.perf_counter() - start) * 1e3)

    def is_applicable_for_range(self, compile_range: Range | None) -> bool:
        return True

    def uuid_extra(self) -> str:
        return ""

    def uuid(self) -> str:
        return hashlib.sha256(
            (source_hash(type(self)) + self.uuid_extra()).encode()).hexdigest()
