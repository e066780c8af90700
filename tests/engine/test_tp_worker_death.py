"""Tensor parallelism (2 CPU ranks over gloo, the demo model at -O0): a request that fails on
rank 0 fails alone and the ranks stay in step; a worker killed while the engine is idle
marks the engine dead at once, naming its rank and pid."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from vllm.engine.model_runner import ModelRunner
from vllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

POISON = "\x00poison"


def tp_engine_args() -> EngineArgs:
    return EngineArgs(model="demo", optimization_level=0, tensor_parallel_size=2,
                      max_model_len=128, kv_cache_memory="16MiB", disable_log_stats=True)


def greedy(max_tokens: int = 6, poison: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          stop=[POISON] if poison else None)


async def final(llm: AsyncLLM, rid: str, params: SamplingParams, prompt: str = "Hello world"):
    last = None
    async for out in llm.generate(prompt, params, rid):
        last = out
    return last


def wait_until(predicate, timeout: float, what: str) -> float:
    """Seconds until `predicate()` held (polled; fails after a generous `timeout`)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not {what} after {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - start


def test_tp_request_failure_then_idle_worker_death(monkeypatch):
    original = ModelRunner._sampling_metadata

    def patched(runner, states, vocab_size):  # rank 0 (in this process) samples
        if any(POISON in s.sampling_params.stop and s.num_output_tokens >= 2 for s in states):
            raise ValueError("Overflow when unpacking long long")
        return original(runner, states, vocab_size)

    monkeypatch.setattr(ModelRunner, "_sampling_metadata", patched)
    llm = AsyncLLM.from_engine_args(tp_engine_args())
    try:
        async def main():
            return await asyncio.gather(
                final(llm, "good", greedy()), final(llm, "bad", greedy(poison=True)),
                return_exceptions=True)

        good, bad = asyncio.run(asyncio.wait_for(main(), 300))
        assert isinstance(bad, RequestFailedError) and "Overflow" in str(bad)
        assert len(good.outputs[0].token_ids) == 6
        # The worker answered every call of the failed step: the next ones read their own.
        again = asyncio.run(asyncio.wait_for(final(llm, "again", greedy()), 300))
        assert again.outputs[0].token_ids == good.outputs[0].token_ids
        assert not llm.errored

        # Now kill the worker while nothing runs: the engine knows at once, no request needed.
        proc = llm.engine.executor._procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        wait_until(lambda: llm.errored, 30, "errored")
        message = str(llm.dead_error)
        assert "rank 1" in message and f"pid {proc.pid}" in message and "SIGKILL" in message
        with pytest.raises(EngineDeadError, match="rank 1"):
            asyncio.run(final(llm, "late", greedy()))
        wait_until(lambda: not llm.is_running, 30, "stopped")
    finally:
        start = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - start < 30  # the live rank 0 does not wait for the dead one


def test_tp_worker_stuck_after_rank0_failed_is_fatal(monkeypatch):
    """Rank 0 fails before its forward while rank 1 waits in the forward's collective: rank 1
    never answers, so the ranks cannot be brought back in step and the engine is dead (after
    WORKER_REPLY_TIMEOUT_S, shortened here), naming the rank."""
    from vllm.engine import executor

    monkeypatch.setattr(executor, "WORKER_REPLY_TIMEOUT_S", 3.0)
    original = ModelRunner._update_states

    def patched(runner, so):  # only rank 0 (this process) raises
        if any(POISON in new.sampling_params.stop for new in so.scheduled_new_reqs):
            raise ValueError("rank 0 only")
        return original(runner, so)

    monkeypatch.setattr(ModelRunner, "_update_states", patched)
    llm = AsyncLLM.from_engine_args(tp_engine_args())
    try:
        with pytest.raises(EngineDeadError, match="rank 1 .* did not answer execute_model"):
            asyncio.run(asyncio.wait_for(final(llm, "bad", greedy(poison=True)), 300))
        assert llm.errored
    finally:
        start = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - start < 30
