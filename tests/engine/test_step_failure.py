"""A step that fails because of one request fails only that request; the engine goes on, its
scheduler and KV cache consistent. Failures that mean a broken engine still kill it.

The real engine on the demo model at -O0. Faults are injected where the original one was
(issue 18: top_k=2**63 -> ValueError('Overflow when unpacking long long') while the runner
built the sampling tensors): `ModelRunner._sampling_metadata` raises for the rows a test
marks, so the forward has run (and written KV) when the step fails.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM, RequestFailedError
from vllm.engine.errors import EngineFatalError
from vllm.engine.llm_engine import LLMEngine
from vllm.engine.model_runner import ModelRunner
from vllm.sampling_params import SamplingParams

POISON = "\x00poison"  # a stop string no text contains: marks the requests that fail
PROMPTS = ["Hello world!", "The quick brown fox jumps over the lazy dog", "def main():"]


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine.from_engine_args(EngineArgs(
        model="demo", optimization_level=0, max_model_len=128, kv_cache_memory="16MiB",
        max_num_batched_tokens=32, disable_log_stats=True))
    yield engine
    engine.shutdown()


class Faults:
    """What `ModelRunner._sampling_metadata` raises for: rows whose request carries POISON
    once it has `after` output tokens, or any batch `batch(states)` says."""

    def __init__(self) -> None:
        self.after = 0
        self.error: Exception = ValueError("Overflow when unpacking long long")
        self.batch = lambda states: False
        self.calls = 0


@pytest.fixture
def faults(monkeypatch):
    original = ModelRunner._sampling_metadata
    faults = Faults()

    def patched(runner, states, vocab_size):
        faults.calls += 1
        for state in states:
            if POISON in state.sampling_params.stop and state.num_output_tokens >= faults.after:
                raise faults.error
        if faults.batch(states):
            raise RuntimeError("injected batch failure")
        return original(runner, states, vocab_size)

    monkeypatch.setattr(ModelRunner, "_sampling_metadata", patched)
    return faults


def greedy(max_tokens: int = 8, poison: bool = False, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          stop=[POISON] if poison else None, **kw)


def run_all(engine: LLMEngine) -> dict[str, object]:
    finals = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("the engine did not finish its requests in 500 steps")


def assert_clean(engine: LLMEngine) -> None:
    """No request left anywhere: scheduler, output processor, KV blocks, model runner."""
    assert engine.step() == []  # (tells the runner to forget the last finished requests)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert not engine.scheduler.requests and not engine.output_processor.requests
    assert not engine.executor.worker.model_runner.requests


def reference(engine: LLMEngine, prompts: list[str], max_tokens: int = 8) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"ref-{i}", prompt, greedy(max_tokens))
    finals = run_all(engine)
    return [finals[f"ref-{i}"].outputs[0].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("after", [0, 3], ids=["first-step", "mid-decode"])
def test_a_failing_request_fails_alone(engine, faults, after):
    expected = reference(engine, PROMPTS)
    faults.after = after
    engine.add_request("good-0", PROMPTS[0], greedy())
    engine.add_request("bad", PROMPTS[1], greedy(poison=True))
    engine.add_request("good-2", PROMPTS[2], greedy())
    finals = run_all(engine)
    errors = engine.pop_request_errors()
    assert list(errors) == ["bad"]
    assert isinstance(errors["bad"], ValueError) and "Overflow" in str(errors["bad"])
    bad = finals["bad"].outputs[0]
    assert bad.finish_reason == "error" and len(bad.token_ids) == after
    # The others are unharmed: the same tokens as without the failure.
    assert finals["good-0"].outputs[0].token_ids == expected[0]
    assert finals["good-2"].outputs[0].token_ids == expected[2]
    assert engine.pop_request_errors() == {}
    assert_clean(engine)
    # And the engine serves the next requests as before.
    assert reference(engine, PROMPTS) == expected


def test_a_failing_request_during_chunked_prefill(engine, faults):
    """The long prompt's prefill is chunked (32-token budget); a short request fails at its
    first sample while the long one is still prefilling."""
    long_prompt = " ".join(["tokens"] * 60)
    [expected] = reference(engine, [long_prompt])
    engine.add_request("long", long_prompt, greedy())
    engine.add_request("bad", "Hi", greedy(poison=True))
    finals = run_all(engine)
    assert list(engine.pop_request_errors()) == ["bad"]
    assert finals["long"].outputs[0].token_ids == expected
    assert_clean(engine)


def test_one_failing_sequence_fails_its_whole_request(engine, faults):
    """n=3: the sequences share the request's params, so all three fail together; the request
    next to it is unharmed."""
    [expected] = reference(engine, PROMPTS[:1])
    faults.after = 2
    engine.add_request("good", PROMPTS[0], greedy())
    engine.add_request("bad", PROMPTS[1], greedy(poison=True, n=3))
    finals = run_all(engine)
    assert list(engine.pop_request_errors()) == ["bad"]
    assert [c.finish_reason for c in finals["bad"].outputs] == ["error"] * 3
    assert finals["good"].outputs[0].token_ids == expected
    assert_clean(engine)


def test_a_failure_of_the_batch_fails_its_requests_and_repeats_kill_the_engine(engine, faults):
    """A failure no request causes alone (here: any batch of 2+ rows) fails every request of
    the step and the engine goes on; three such steps in a row mean a broken engine."""
    faults.batch = lambda states: len(states) >= 2
    for i in range(2):
        engine.add_request(f"a{i}", PROMPTS[0], greedy())
        engine.add_request(f"b{i}", PROMPTS[1], greedy())
        finals = run_all(engine)
        assert sorted(engine.pop_request_errors()) == [f"a{i}", f"b{i}"]
        assert all(o.outputs[0].finish_reason == "error" for o in finals.values())
    engine.add_request("alone", PROMPTS[2], greedy())  # one row: succeeds, resets the count
    assert run_all(engine)["alone"].outputs[0].finish_reason == "length"
    for i in range(2):
        engine.add_request(f"c{i}", PROMPTS[0], greedy())
        engine.add_request(f"d{i}", PROMPTS[1], greedy())
        run_all(engine)
    engine.add_request("e", PROMPTS[0], greedy())
    engine.add_request("f", PROMPTS[1], greedy())
    with pytest.raises(EngineFatalError, match="3 engine steps in a row failed"):
        run_all(engine)
    # (leave the shared engine usable for the tests after this one)
    engine.abort_request(["e", "f"])
    engine.step_recovery.on_success()
    assert sorted(engine.pop_request_errors()) == ["c0", "c1", "d0", "d1"]
    faults.batch = lambda states: False
    assert_clean(engine)


def test_out_of_memory_again_and_again_is_fatal(engine, faults):
    """One request out of memory fails that request; three steps in a row out of memory mean
    the engine cannot serve, even with a request to blame each time."""
    faults.error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    for i in range(2):
        engine.add_request(f"big{i}", PROMPTS[0], greedy(poison=True))
        assert run_all(engine)[f"big{i}"].outputs[0].finish_reason == "error"
        assert list(engine.pop_request_errors()) == [f"big{i}"]
    engine.add_request("big2", PROMPTS[0], greedy(poison=True))
    with pytest.raises(EngineFatalError, match="out of memory"):
        run_all(engine)
    engine.abort_request("big2")
    engine.step_recovery.on_success()
    assert_clean(engine)


def test_a_failed_health_check_is_fatal(engine, monkeypatch):
    """When the model itself no longer runs (here: every forward raises), the step's failure
    is the engine's, not the request's."""
    def broken(*args, **kwargs):
        raise RuntimeError("the device is gone")

    engine.add_request("r", PROMPTS[0], greedy())
    with monkeypatch.context() as m:
        m.setattr(engine.executor.worker.model_runner, "model", broken)
        with pytest.raises(EngineFatalError, match="failed its health check"):
            engine.step()
    engine.abort_request("r")
    assert_clean(engine)


@pytest.mark.parametrize("error", [
    torch.distributed.DistBackendError("collective failed"),
    EngineFatalError("tensor-parallel worker rank 1 (pid 1) died"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
], ids=["collective", "worker-death", "cuda"])
def test_fatal_errors_leave_step(engine, monkeypatch, error):
    def raising(so):
        raise error

    engine.add_request("r", PROMPTS[0], greedy())
    with monkeypatch.context() as m:
        m.setattr(engine.executor, "execute_model", raising)
        with pytest.raises(type(error)):
            engine.step()
    engine.abort_request("r")
    assert_clean(engine)


def test_async_llm_fails_the_stream_and_serves_on(engine, faults):
    faults.after = 2
    llm = AsyncLLM(engine)

    async def collect(rid: str, params: SamplingParams):
        last = None
        async for out in llm.generate(PROMPTS[0], params, rid):
            last = out
        return last

    async def main():
        return await asyncio.gather(collect("good", greedy(12)), collect("bad", greedy(
            poison=True)), return_exceptions=True)

    try:
        good, bad = asyncio.run(asyncio.wait_for(main(), 120))
        assert isinstance(bad, RequestFailedError), bad
        assert "request bad failed" in str(bad) and "Overflow" in str(bad)
        assert good.outputs[0].finish_reason == "length"
        assert len(good.outputs[0].token_ids) == 12
        assert not llm.errored
        after = asyncio.run(asyncio.wait_for(collect("next", greedy(4)), 120))
        assert len(after.outputs[0].token_ids) == 4
        assert llm.num_in_flight == 0
    finally:
        _stop_loop(llm)
    assert_clean(engine)


def _stop_loop(llm: AsyncLLM) -> None:
    """Stop the AsyncLLM's thread but keep the module's engine for the other tests."""
    from vllm.engine import async_llm

    llm._commands.put(async_llm._STOP)
    llm._thread.join(30)
    assert not llm._thread.is_alive()
