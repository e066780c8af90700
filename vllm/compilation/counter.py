"""Process-wide counts of what the compile stack did; tests assert on their deltas."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass
class CompilationCounter:
    """Counters bumped by the decorator, the backend, the cache and the graph wrappers."""

    num_models_seen: int = 0
    """Models built with compilation on (one per `@support_torch_compile` instance)."""
    num_graphs_seen: int = 0
    """Dynamo graphs handed to a backend (one per model unless it recompiles)."""
    num_graphs_loaded: int = 0
    """Traced graphs loaded from the compile cache instead (a warm start: Dynamo not run)."""
    num_graphs_saved: int = 0
    """Traced graphs saved into the compile cache (for warm starts without Dynamo)."""
    num_piecewise_graphs_seen: int = 0
    """Pieces after splitting, splitting-op pieces included."""
    num_piecewise_capturable_graphs_seen: int = 0
    """Pieces that are compiled (and could be captured as CUDA graphs)."""
    num_backend_compilations: int = 0
    """Piece compiles: one per piece per compile range, plus one per piece per compile size."""
    num_inductor_compiles: int = 0
    """Times Inductor actually ran (a cache hit does not count)."""
    num_shared_piece_compiles: int = 0
    """Piece compiles served by an identical piece's compiled code (same graph and shapes)."""
    num_eager_compiles: int = 0
    """Pieces prepared with the "eager" backend (traced to ATen and passed through the passes)."""
    num_light_loads: int = 0
    """Compiled pieces loaded from the compile cache without importing Inductor (their
    light entries: inductor_light.py)."""
    num_cache_hits: int = 0
    num_cache_misses: int = 0
    num_cache_corrupt: int = 0
    """Cache entries found damaged (checksum mismatch, truncated, unreadable) and recompiled."""
    num_cache_saves: int = 0
    stock_torch_compile_count: int = 0
    """Graphs compiled by torch's own backend (modes STOCK_TORCH_COMPILE, DYNAMO_TRACE_ONCE)."""
    num_recompiles: int = 0
    """Dynamo traces after the first successful one (a guard failed)."""
    num_gpu_runner_capture_triggers: int = 0
    """CUDA-graph captures the model runner asked for (one per dispatcher key)."""
    num_cudagraph_captured: int = 0
    num_cudagraph_replayed: int = 0

    def clone(self) -> CompilationCounter:
        return copy.deepcopy(self)

    def __getattr__(self, name: str) -> int:
        # Upstream's names for the counters this engine keeps under its own names.
        if name in UPSTREAM_ALIASES:
            return getattr(self, UPSTREAM_ALIASES[name])
        raise AttributeError(f"{type(self).__name__!r} has no counter {name!r}")

    @contextlib.contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        """Assert that each named counter grows by exactly the given amount inside the block.

        >>> with compilation_counter.expect(num_graphs_seen=1, num_recompiles=0):
        ...     model(x)
        """
        known = {f.name for f in dataclasses.fields(self)} | set(UPSTREAM_ALIASES)
        unknown = sorted(set(deltas) - known)
        if unknown:
            raise ValueError(f"Unknown compilation counter(s) {unknown}; known: {sorted(known)}")
        before = self.clone()
        yield
        wrong = []
        for name, expected in deltas.items():
            actual = getattr(self, name) - getattr(before, name)
            if actual != expected:
                wrong.append(f"{name}: expected +{expected}, got +{actual}")
        assert not wrong, "compilation_counter mismatch: " + "; ".join(wrong)


# upstream counter name -> ours (same events: a piece saved to / loaded from the compile
# cache, the traced graph saved / loaded for a start without Dynamo)
UPSTREAM_ALIASES = {
    "num_cache_entries_updated": "num_cache_saves",
    "num_compiled_artifacts_saved": "num_cache_saves",
    "num_compiled_artifacts_loaded": "num_cache_hits",
    "num_aot_artifacts_saved": "num_graphs_saved",
    "num_aot_artifacts_loaded": "num_graphs_loaded",
}

compilation_counter = CompilationCounter()
