"""compilation_counter.expect(): asserts exact deltas, rejects unknown names."""
from __future__ import annotations

import pytest

from vllm.compilation.counter import CompilationCounter, compilation_counter


def test_expect_passes_on_exact_deltas():
    counter = CompilationCounter()
    with counter.expect(num_graphs_seen=2, num_recompiles=0):
        counter.num_graphs_seen += 2


def test_expect_reports_every_wrong_counter():
    counter = CompilationCounter()
    with pytest.raises(AssertionError) as info:
        with counter.expect(num_graphs_seen=1, num_backend_compilations=3):
            counter.num_backend_compilations += 2
    message = str(info.value)
    assert "num_graphs_seen: expected +1, got +0" in message
    assert "num_backend_compilations: expected +3, got +2" in message


def test_expect_rejects_unknown_counter():
    with pytest.raises(ValueError, match="num_grapsh_seen"):
        with compilation_counter.expect(num_grapsh_seen=1):
            pass


def test_deltas_not_absolute_values():
    counter = CompilationCounter(num_models_seen=5)
    with counter.expect(num_models_seen=1):
        counter.num_models_seen += 1
    assert counter.clone() == counter and counter.clone() is not counter


def test_upstream_counter_names_read_ours():
    """Upstream's names for the same events (tests written against upstream's counter):
    artifacts / cache entries saved and loaded, the traced graph (AOT) saved and loaded."""
    counter = CompilationCounter(num_cache_saves=3, num_cache_hits=2, num_graphs_saved=1,
                                 num_graphs_loaded=4)
    assert counter.num_cache_entries_updated == counter.num_compiled_artifacts_saved == 3
    assert counter.num_compiled_artifacts_loaded == 2
    assert (counter.num_aot_artifacts_saved, counter.num_aot_artifacts_loaded) == (1, 4)
    with counter.expect(num_compiled_artifacts_saved=2, num_compiled_artifacts_loaded=0):
        counter.num_cache_saves += 2
    with pytest.raises(AttributeError, match="num_nothing"):
        _ = counter.num_nothing
