"""The compile cache's interface for the backend (cache.py): a compiled piece stored and loaded
by entry name and key (one path for a hit and a miss), the traced graph stored and found again
before tracing through the index, and the backend's piece path that a warm start's restored
pieces go through too (no second copy of the hit path)."""
from __future__ import annotations

import ast
import os
import pathlib

import pytest

import vllm.compilation
from vllm.compilation.cache import GRAPH_ENTRY, CompileCache, GraphCacheMiss
from vllm.compilation.counter import compilation_counter
from vllm.config import CompilationConfig, VllmConfig
from vllm.config.utils import Range


def config(tmp_path) -> VllmConfig:
    return VllmConfig(optimization_level=1, compilation_config=CompilationConfig(
        backend="inductor", cache_dir=str(tmp_path / "root")))


class FakeCompiler:
    """Saves an "artifact" (a string) as a file; loads it back, or fails as told."""

    name = "inductor"

    def __init__(self) -> None:
        self.fail_load = False
        self.loads = 0

    @staticmethod
    def save(artifact: str, path: str) -> None:
        with open(path, "w") as f:
            f.write(artifact)

    def load(self, path: str, cache_dir: str | None = None) -> str:
        self.loads += 1
        if self.fail_load:
            raise RuntimeError("undefined symbol in kernel.so")
        with open(path) as f:
            return f.read()


def test_a_piece_is_stored_and_loaded_under_its_key(tmp_path):
    cache = CompileCache(str(tmp_path))
    compiler = FakeCompiler()
    name = cache.piece_entry(2, Range(1, 16).tag)
    assert name == "piece_2.range_1_16.bin"
    assert cache.load_piece(name, "key-a", compiler) is None  # nothing yet: the caller compiles
    with compilation_counter.expect(num_cache_misses=1, num_cache_saves=1):
        cache.store_piece(name, "key-a", compiler, "compiled code")
    with compilation_counter.expect(num_cache_hits=1):
        assert cache.load_piece(name, "key-a", compiler) == ("compiled code", "hit")
    assert cache.load_piece(name, "key-b", compiler) is None  # another graph: a plain miss
    assert (cache.hits, cache.misses) == ([name], [name])


def test_a_piece_that_fails_to_load_is_dropped_and_named(tmp_path, caplog):
    """Recompiled, never trusted: the entry goes, Inductor's cache is emptied (a damaged kernel
    there would be reused), and the backend can tell "load failed" from "missing"."""
    cache = CompileCache(str(tmp_path))
    compiler = FakeCompiler()
    name = cache.piece_entry(0, Range(1, 8).tag)
    cache.store_piece(name, "k", compiler, "code")
    os.makedirs(os.path.join(cache.inductor_cache_dir, "ab"))
    open(os.path.join(cache.inductor_cache_dir, "ab", "kernel.so"), "w").close()
    compiler.fail_load = True
    with compilation_counter.expect(num_cache_corrupt=1, num_cache_hits=0):
        assert cache.load_piece(name, "k", compiler) is None
    assert cache.dropped == [name]
    assert cache.lookup(name, "k") is None and not os.path.exists(cache.inductor_cache_dir)
    assert "undefined symbol in kernel.so" in caplog.text and "emptying" in caplog.text


def test_the_traced_graph_is_found_again_before_tracing(tmp_path):
    """The traced files are part of the key but known only after tracing: the index, keyed
    without them, leads a later start to the entry; a changed traced file is another key."""
    cfg = config(tmp_path)
    model_file, traced_file = tmp_path / "model.py", tmp_path / "layers.py"
    model_file.write_text("m = 1\n")
    traced_file.write_text("t = 1\n")
    with pytest.raises(GraphCacheMiss, match="none saved"):
        CompileCache.find_saved_graph(cfg, [str(model_file)], "p")
    cache = CompileCache.for_model(cfg, [str(model_file)], "p", rank=1,
                                   traced_files=[str(traced_file)])
    with pytest.raises(GraphCacheMiss, match=f"{GRAPH_ENTRY} is missing"):
        cache.load_graph()
    with compilation_counter.expect(num_graphs_saved=1):
        cache.store_graph({"format": 2, "items": []})
    found = CompileCache.find_saved_graph(cfg, [str(model_file)], "p", rank=1)
    assert found.directory == cache.directory and found.traced_files == [str(traced_file)]
    assert found.load_graph() == {"format": 2, "items": []}
    with pytest.raises(GraphCacheMiss, match="none saved"):  # another rank
        CompileCache.find_saved_graph(cfg, [str(model_file)], "p", rank=0)
    traced_file.write_text("t = 2\n")
    with pytest.raises(GraphCacheMiss, match="current source of the traced files"):
        CompileCache.find_saved_graph(cfg, [str(model_file)], "p", rank=1)


def test_restored_pieces_load_through_the_backends_one_piece_path(tmp_path):
    """A piece restored with the traced graph (no graph at hand) goes through
    `VllmBackend.compile_piece` like a traced one: a hit is shared between pieces with the
    same key and counted once per load; a miss raises GraphCacheMiss (the start then traces)
    and its start-up row says "missing"."""
    from vllm.compilation.backends import VllmBackend
    from vllm.utils.startup_timer import reset_startup_timer

    backend = VllmBackend(config(tmp_path))
    backend.compiler = FakeCompiler()
    backend.cache = CompileCache(str(tmp_path / "entry"))
    timer = backend.timer = reset_startup_timer()
    tag = Range(1, 8).tag
    backend.cache.store_piece(backend.cache.piece_entry(1, tag), "k1", backend.compiler, "one")
    with compilation_counter.expect(num_backend_compilations=2, num_cache_hits=1,
                                    num_shared_piece_compiles=1, num_inductor_compiles=0):
        assert backend.compile_piece(None, [], 1, Range(1, 8), key="k1") == "one"
        assert backend.compile_piece(None, [], 3, Range(1, 8), key="k1") == "one"
    with pytest.raises(GraphCacheMiss, match="compiled piece 5"):
        backend.compile_piece(None, [], 5, Range(1, 8), key="k5")
    caches = [e["cache"] for e in timer.as_dict()["phases"]["inductor compilation"]["events"]]
    assert caches == ["hit", "shared with piece 1", "missing"]


def test_no_compilation_module_imports_another_modules_private_names():
    """The warm-start modules use the compile cache through its interface, not its helpers."""
    root = pathlib.Path(vllm.compilation.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm."):
                found += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []
