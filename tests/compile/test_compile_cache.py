"""On-disk compile cache: key factors, checksummed entries, locking. (Warm starts in new
processes, concurrent cold starts, a damaged artifact: test_cache_e2e.py, through the engine.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from vllm.compilation.cache import (
    CompileCache,
    cache_disabled_reason,
    compute_cache_factors,
    compute_cache_key,
)
from vllm.compilation.counter import compilation_counter
from vllm.config import CacheConfig, CompilationConfig, PassConfig, VllmConfig


def config(**kwargs) -> VllmConfig:
    cache = kwargs.pop("cache_config", CacheConfig())
    kwargs.setdefault("backend", "inductor")
    return VllmConfig(optimization_level=1, cache_config=cache,
                      compilation_config=CompilationConfig(**kwargs))


def key_of(cfg: VllmConfig, sources=(), passes="p") -> str:
    return compute_cache_key(compute_cache_factors(cfg, list(sources), passes))


def test_key_covers_what_changes_the_graph_and_nothing_memory_sized(tmp_path):
    source = tmp_path / "model.py"
    source.write_text("x = 1\n")
    base = key_of(config(), [source])
    assert key_of(config(), [source]) == base  # deterministic
    # Memory sizing and debug paths do not change the graph: same key.
    assert key_of(config(cache_config=CacheConfig(kv_cache_memory="1GiB")), [source]) == base
    assert key_of(config(cache_config=CacheConfig(gpu_memory_utilization=0.5)), [source]) == base
    assert key_of(config(cache_dir=str(tmp_path)), [source]) == base
    # A pass flag, an Inductor option, the pass manager, the model source: different key.
    assert key_of(config(pass_config=PassConfig(eliminate_noops=False)), [source]) != base
    assert key_of(config(max_autotune=True), [source]) != base
    assert key_of(config(cpp_wrapper=True), [source]) != base
    assert key_of(config(), [source], passes="q") != base
    source.write_text("x = 2\n")
    assert key_of(config(), [source]) != base


def test_key_covers_the_instruction_set_the_process_is_limited_to(monkeypatch):
    """ATen's capability (ATEN_CPU_CAPABILITY: Inductor vectorizes its C++ for it) and our
    kernels' level (VLLM_CPU_ISA) are part of the key: a run limited to AVX2 on an AVX-512
    machine gets its own entries (it had shared them, so whichever compiled first decided the
    other's code)."""
    import torch

    from vllm.utils.cpu_info import cpu_isa_level, supported_isa_levels

    cfg = config()
    keys = set()
    for capability in ("AVX512", "AVX2", "DEFAULT"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        factors = compute_cache_factors(cfg, [], "p")
        assert factors["machine"].split("-")[-1].startswith(capability + "/")
        keys.add(compute_cache_key(factors))
    assert len(keys) == 3
    monkeypatch.delenv("VLLM_CPU_ISA", raising=False)
    if "avx2" in supported_isa_levels() and cpu_isa_level() != "avx2":  # (a level below)
        monkeypatch.setenv("VLLM_CPU_ISA", "avx2")
        limited = compute_cache_key(compute_cache_factors(cfg, [], "p"))
        monkeypatch.delenv("VLLM_CPU_ISA")
        assert limited != compute_cache_key(compute_cache_factors(cfg, [], "p"))


@pytest.mark.parametrize("platform", ["cuda"], indirect=True)
def test_key_covers_the_gpu(monkeypatch, platform):
    """Triton kernels are built for one GPU architecture and FP8 layers pick their GEMM by
    capability: two GPUs sharing a cache directory get different keys."""
    import torch

    cfg = config()
    assert compute_cache_factors(cfg, [], "p")["accelerator"] == "none"  # no GPU here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    keys = set()
    for name, capability in [("NVIDIA A100", (8, 0)), ("NVIDIA H100", (9, 0))]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        factors = compute_cache_factors(cfg, [], "p")
        assert factors["accelerator"] == f"cuda12.8-{name}-sm{capability[0]}{capability[1]}"
        keys.add(compute_cache_key(factors))
    assert len(keys) == 2


def test_key_covers_how_the_tp_all_reduce_is_traced(monkeypatch):
    """A TP graph traces either the shared-memory all-reduce op or torch's c10d collective:
    the two must not share an entry (a gloo-traced graph loaded by a shared-memory run kept
    gloo, TP=2 decode ~4x slower)."""
    from vllm.distributed import parallel_state

    cfg = config()
    assert compute_cache_factors(cfg, [], "p")["tp_all_reduce"] == "none"  # no TP group
    keys = {}
    for shm, flashinfer, expected in ((object(), None, "shm"), (None, object(), "flashinfer"),
                                      (None, None, "c10d")):
        group = parallel_state.GroupCoordinator(group=None, rank_in_group=0, world_size=2,
                                                ranks=[0, 1])
        group.shm_all_reduce = shm
        group.flashinfer_all_reduce = flashinfer
        monkeypatch.setattr(parallel_state, "_TP", group)
        factors = compute_cache_factors(cfg, [], "p")
        assert factors["tp_all_reduce"] == expected
        keys[expected] = compute_cache_key(factors)
    assert len(set(keys.values())) == 3


def test_directory_layout_and_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "root"))
    cache = CompileCache.for_model(config(), [], "p", rank=1)
    key = compute_cache_key(cache.factors)
    assert cache.directory == str(tmp_path / "root" / "torch_compile_cache" / key[:10] / "rank_1")
    cache = CompileCache.for_model(config(cache_dir=str(tmp_path / "mine")), [], "p")
    assert cache.directory.startswith(str(tmp_path / "mine") + os.sep)
    assert cache.directory.endswith("rank_0")


def test_disabled_by_env_eager_and_dump(monkeypatch, tmp_path):
    assert cache_disabled_reason(config()) is None
    assert "eager" in cache_disabled_reason(config(backend="eager"))
    assert "debug_dump_path" in cache_disabled_reason(config(debug_dump_path=str(tmp_path)))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    assert cache_disabled_reason(config()) == "VLLM_DISABLE_COMPILE_CACHE=1"


@pytest.mark.parametrize("value, disabled", [
    ("2", True), ("true", True), ("On", True), ("0", False), ("no", False), ("", False)])
def test_disable_env_read_as_upstream(monkeypatch, value, disabled):
    """Upstream reads the variable as an integer (nonzero: off); true/false and the like are
    taken too."""
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", value)
    assert (cache_disabled_reason(config()) is not None) is disabled


def test_disable_env_that_is_no_flag_is_a_config_error(monkeypatch):
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "foo")
    with pytest.raises(ValueError, match="VLLM_DISABLE_COMPILE_CACHE='foo' is not an on/off"):
        config()


def test_inductor_options_from_fields_and_inductor_compile_config_wins():
    from vllm.compilation.compiler_interface import inductor_config_patches

    assert "cpp_wrapper" not in inductor_config_patches(config(), None)
    assert inductor_config_patches(config(cpp_wrapper=True), None)["cpp_wrapper"] is True
    given = config(cpp_wrapper=True, inductor_compile_config={"cpp_wrapper": False})
    assert inductor_config_patches(given, None)["cpp_wrapper"] is False


def test_an_unusable_cache_directory_disables_the_cache_with_a_warning(tmp_path, monkeypatch,
                                                                      caplog):
    """A cache root that is a file (or below one) is named in the reason; one that fails only
    when created is caught too: the start goes on without the cache (it used to fail the
    Dynamo trace with a NotADirectoryError)."""
    from torch import fx

    from vllm.compilation.backends import VllmBackend

    a_file = tmp_path / "file"
    a_file.write_text("x")
    reason = cache_disabled_reason(config(cache_dir=str(a_file)))
    assert reason == f"the cache directory '{a_file}' is not usable: it is a file, not a directory"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(a_file))
    assert "it cannot be created: " in cache_disabled_reason(config())
    backend = VllmBackend(config())
    backend._open_cache(fx.GraphModule({}, fx.Graph()))
    assert backend.cache is None and "compile cache: disabled (the cache directory" in caplog.text
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "root"))

    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(CompileCache, "for_model", refuse)
    backend = VllmBackend(config())
    backend._open_cache(fx.GraphModule({}, fx.Graph()))
    assert backend.cache is None
    assert "cannot create its directory: read-only file system" in caplog.text


def test_disabled_by_env_turns_inductors_own_caches_off_too(monkeypatch):
    """Otherwise Inductor's FX graph cache (in its default directory) still hands back
    earlier compiles, and our passes do not run."""
    from vllm.compilation.compiler_interface import inductor_config_patches

    assert "force_disable_caches" not in inductor_config_patches(config(), None)
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    assert inductor_config_patches(config(), None)["force_disable_caches"] is True


def test_reset_inductor_cache_empties_the_entrys_inductor_directory(tmp_path, caplog):
    cache = CompileCache(str(tmp_path))
    assert not cache.reset_inductor_cache("nothing there")  # no directory yet
    kernel = os.path.join(cache.inductor_cache_dir, "ab", "kernel.so")
    os.makedirs(os.path.dirname(kernel))
    with open(kernel, "wb") as f:
        f.write(b"damaged")
    cache.store("piece_0.bin", "g", _write(b"x"))
    assert cache.reset_inductor_cache("piece 0 failed to load")
    assert not os.path.exists(cache.inductor_cache_dir)
    assert sorted(os.listdir(tmp_path)) == [".lock", "manifest.json", "piece_0.bin"]
    assert cache.lookup("piece_0.bin", "g") is not None  # our own entries are kept
    assert "emptying" in caplog.text and "piece 0 failed to load" in caplog.text


def _write(data: bytes):
    def write(path: str) -> None:
        with open(path, "wb") as f:
            f.write(data)
    return write


def test_entries_are_checksummed_and_corruption_is_detected(tmp_path, caplog):
    cache = CompileCache(str(tmp_path), {"k": "v"})
    path = cache.store("piece_0.bin", "graph-a", _write(b"x" * 100))
    assert cache.lookup("piece_0.bin", "graph-a") == path
    assert cache.lookup("piece_0.bin", "graph-b") is None  # another graph: a plain miss
    assert cache.lookup("missing.bin", "graph-a") is None
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["factors"] == {"k": "v"}
    assert manifest["entries"]["piece_0.bin"]["size"] == 100
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]  # no temp files left

    with open(path, "r+b") as f:  # same size, one byte flipped
        f.seek(10)
        f.write(b"y")
    with compilation_counter.expect(num_cache_corrupt=1):
        assert cache.lookup("piece_0.bin", "graph-a") is None
    assert "corrupt entry piece_0.bin" in caplog.text and "checksum mismatch" in caplog.text
    assert not os.path.exists(path)  # dropped, will be recompiled

    path = cache.store("piece_1.bin", "g", _write(b"z" * 64))
    with open(path, "r+b") as f:
        f.truncate(10)
    with compilation_counter.expect(num_cache_corrupt=1):
        assert cache.lookup("piece_1.bin", "g") is None
    assert "truncated" in caplog.text


def test_unreadable_manifest_is_started_over(tmp_path, caplog):
    """Its entries can no longer be verified: counted once as corrupt, warned about once, and
    replaced at once by an empty manifest (it was warned about at every read)."""
    (tmp_path / "manifest.json").write_text("{not json")
    cache = CompileCache(str(tmp_path))
    with compilation_counter.expect(num_cache_corrupt=1):
        assert cache.lookup("a.bin", "g") is None
        assert cache.lookup("b.bin", "g") is None
        cache.store("a.bin", "g", _write(b"abc"))
        assert cache.lookup("a.bin", "g") is not None
    assert caplog.text.count("is unreadable") == 1
    assert list(json.loads((tmp_path / "manifest.json").read_text())["entries"]) == ["a.bin"]


HOLD_LOCK_SCRIPT = textwrap.dedent("""
    import sys, time
    from vllm.compilation.cache import CompileCache
    with CompileCache(sys.argv[1]).lock():
        print("locked", flush=True)
        time.sleep(float(sys.argv[2]))
""")


def test_waiting_for_the_lock_is_logged_with_the_holder(tmp_path, caplog, monkeypatch):
    """A start that waits for another process's compile says so at once, naming its pid, and
    again every LOCK_WAIT_LOG_SECONDS (a stopped holder blocked starts silently)."""
    import logging

    from vllm.compilation import cache as cache_module

    monkeypatch.setattr(cache_module, "LOCK_WAIT_LOG_SECONDS", 0.3)
    script = tmp_path / "hold.py"
    script.write_text(HOLD_LOCK_SCRIPT)
    holder = subprocess.Popen([sys.executable, str(script), str(tmp_path / "c"), "1.5"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        cache = CompileCache(str(tmp_path / "c"))
        with caplog.at_level(logging.INFO, logger="vllm"), cache.lock():
            pass
    finally:
        holder.wait(timeout=60)
    assert f"waiting for process {holder.pid}, which holds" in caplog.text
    assert f"still waiting for process {holder.pid}" in caplog.text
    assert "VLLM_DISABLE_COMPILE_CACHE=1" in caplog.text
    assert (tmp_path / "c" / ".lock").read_text() == str(os.getpid())


LOCK_SCRIPT = textwrap.dedent("""
    import sys, time
    from vllm.compilation.cache import CompileCache
    cache = CompileCache(sys.argv[1])
    for _ in range(20):
        with cache.lock():
            path = cache.path("count.txt")
            try:
                value = int(open(path).read())
            except FileNotFoundError:
                value = 0
            time.sleep(0.002)
            open(path, "w").write(str(value + 1))
    with cache.lock(), cache.lock():  # re-entrant in one process
        cache.store("entry-" + sys.argv[2], "g", lambda p: open(p, "w").write(sys.argv[2]))
""")


def test_lock_serializes_processes(tmp_path):
    script = tmp_path / "lock.py"
    script.write_text(LOCK_SCRIPT)
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "c"), str(i)])
             for i in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert (tmp_path / "c" / "count.txt").read_text() == "40"  # no lost update
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert sorted(manifest["entries"]) == ["entry-0", "entry-1"]  # no lost manifest update
