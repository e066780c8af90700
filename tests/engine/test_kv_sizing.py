"""KV cache sizing: defaults, env, cap, override, the clear too-small error; TP > 1."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig
from vllm.engine.executor import Executor, MultiprocExecutor, UniProcExecutor
from vllm.engine.worker import GiB, determine_num_blocks

BLOCK_BYTES = 1 << 20  # 1 MiB per block


def config(max_len=64, max_seqs=4, **cache):
    return SimpleNamespace(
        cache_config=CacheConfig(block_size=16, **cache),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_seqs,
                                         max_model_len=max_len))


def test_default_is_capped_at_what_the_scheduler_can_use(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    num, why = determine_num_blocks(config(), BLOCK_BYTES)
    assert num == 4 * 4 + 1 and "capped" in why


def test_explicit_memory_env_and_override(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert determine_num_blocks(config(max_seqs=100, kv_cache_memory=10 * BLOCK_BYTES),
                                BLOCK_BYTES)[0] == 10
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.0078125")  # 8 MiB
    num, why = determine_num_blocks(config(max_seqs=100), BLOCK_BYTES)
    assert num == 8 and "VLLM_CPU_KVCACHE_SPACE" in why
    assert determine_num_blocks(config(num_gpu_blocks_override=7), BLOCK_BYTES)[0] == 7
    assert determine_num_blocks(config(), BLOCK_BYTES, available_bytes=6 * BLOCK_BYTES)[0] == 6


def test_explicit_memory_wins_over_gpu_memory_utilization(monkeypatch):
    """Upstream's kv_cache_memory_bytes: a fixed KV size on CUDA too, so several engines can
    share one GPU (the profiled `available_bytes` are ignored)."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    num, why = determine_num_blocks(config(max_seqs=100, kv_cache_memory=10 * BLOCK_BYTES),
                                    BLOCK_BYTES, available_bytes=1000 * BLOCK_BYTES)
    assert (num, why) == (10, "kv_cache_memory")


def test_kv_cache_memory_bytes_is_an_alias():
    from vllm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--kv-cache-memory-bytes", "512MiB"])
    assert EngineArgs.from_cli_args(args).kv_cache_memory == 512 * 1024 * 1024


def test_too_small_names_the_numbers():
    with pytest.raises(ValueError) as info:
        determine_num_blocks(config(max_len=64, kv_cache_memory=3 * BLOCK_BYTES), BLOCK_BYTES)
    message = str(info.value)
    assert f"{BLOCK_BYTES} bytes per block" in message and "5 blocks needed" in message
    assert "3 available" in message and "max_model_len=64" in message
    with pytest.raises(ValueError, match="5 blocks needed"):
        determine_num_blocks(config(), BLOCK_BYTES, available_bytes=-GiB)


def test_executor_class():
    single = SimpleNamespace(parallel_config=ParallelConfig())
    assert Executor.get_class(single) is UniProcExecutor
    tp2 = SimpleNamespace(parallel_config=ParallelConfig(tensor_parallel_size=2))
    assert Executor.get_class(tp2) is MultiprocExecutor
    tp2_uni = SimpleNamespace(parallel_config=ParallelConfig(
        tensor_parallel_size=2, distributed_executor_backend="uni"))
    with pytest.raises(NotImplementedError, match="distributed_executor_backend='mp'"):
        Executor.get_class(tp2_uni)


def test_a_cpu_kv_cache_larger_than_free_memory_is_refused_with_the_numbers(monkeypatch):
    from vllm.engine import worker

    monkeypatch.setattr(worker, "available_cpu_memory", lambda: 10 * BLOCK_BYTES)
    worker.check_cpu_memory_for_kv_cache(10, BLOCK_BYTES)  # fits exactly
    with pytest.raises(ValueError) as info:
        worker.check_cpu_memory_for_kv_cache(11, BLOCK_BYTES)
    message = str(info.value)
    assert f"11 blocks of {BLOCK_BYTES} bytes" in message
    assert "VLLM_CPU_KVCACHE_SPACE" in message and "0.01 GiB available" in message
    monkeypatch.setattr(worker, "available_cpu_memory", lambda: None)  # not Linux: no check
    worker.check_cpu_memory_for_kv_cache(1 << 30, BLOCK_BYTES)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/meminfo"), reason="Linux only")
def test_available_cpu_memory_is_read_from_meminfo():
    from vllm.engine.worker import available_cpu_memory

    with open("/proc/meminfo") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    available = available_cpu_memory()
    assert 0 < available <= fields["MemTotal"] + fields.get("SwapTotal", 0)


def _resident_bytes(t) -> int:
    """Bytes of `t`'s pages resident in memory (mincore(2), page by page)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
    return sum(v & 1 for v in vec) * page


@pytest.mark.skipif(not __import__("os").path.exists("/proc/meminfo"), reason="Linux only")
def test_the_engine_refuses_a_kv_cache_the_machine_cannot_hold(llama_path, monkeypatch):
    from vllm import LLM
    from vllm.engine import worker

    monkeypatch.setattr(worker, "available_cpu_memory", lambda: 1 << 20)
    with pytest.raises(ValueError, match="does not fit in the memory this machine has free"):
        LLM(model=llama_path, optimization_level=0, max_model_len=64)


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="Linux only")
def test_a_cpu_kv_cache_takes_its_first_blocks_at_start_up_the_rest_as_written(llama_path,
                                                                               monkeypatch):
    """A 1 GiB cache takes KV_CACHE_BYTES_TAKEN_AT_START (here 128 MiB) at start-up, the rest
    as steps first write it (with huge pages on; elsewhere it is torch.zeros, all of it
    resident at once)."""
    from vllm import LLM, SamplingParams
    from vllm.engine import model_runner
    from vllm.utils.hugepages import huge_pages_enabled

    if not huge_pages_enabled():
        pytest.skip("transparent huge pages unavailable: the cache is torch.zeros")
    monkeypatch.setattr(model_runner, "KV_CACHE_BYTES_TAKEN_AT_START", 128 << 20)
    llm = LLM(model=llama_path, optimization_level=0, max_model_len=64,
              num_gpu_blocks_override=1 << 17)  # x 8 KiB a block
    caches = list(llm.llm_engine.executor.worker.model_runner.kv_caches.values())
    cache_bytes = sum(t.numel() * t.element_size() for t in caches)
    assert cache_bytes >= GiB
    resident = sum(_resident_bytes(t) for t in caches)
    # 128 MiB of first blocks (+ up to a huge page of each K and V half past them)
    assert 128 << 20 <= resident <= (128 << 20) + 2 * len(caches) * (2 << 20)
    for half in caches[0]:  # K and V of the blocks the first requests get: resident
        first = half[:16]
        assert _resident_bytes(first) == first.numel() * first.element_size()
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
