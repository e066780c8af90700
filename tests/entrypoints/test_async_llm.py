"""AsyncLLM over a fake engine: continuous batching, abort on cancel, errors, shutdown."""
from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine, greedy_continuation

from vllm.engine.async_llm import AsyncLLM, EngineDeadError
from vllm.entrypoints.openai.metrics import ServerMetrics
from vllm.sampling_params import SamplingParams


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.fixture
def fake():
    return FakeEngine(step_delay=0.002)


@pytest.fixture
def llm(fake):
    engine = AsyncLLM(fake)
    yield engine
    engine.shutdown()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_concurrent_requests_are_batched_and_complete(llm, fake):
    async def one(i: int):
        last = None
        async for out in llm.generate(f"prompt {i}", greedy(5 + i), f"r{i}"):
            last = out
        return last

    async def main():
        return await asyncio.gather(*(one(i) for i in range(12)))

    finals = run(main())
    for i, final in enumerate(finals):
        assert final.finished
        assert len(final.outputs[0].token_ids) == 5 + i
        assert final.outputs[0].text == greedy_continuation(f"prompt {i}", 5 + i)
    assert max(fake.batch_sizes) > 1  # requests shared steps
    assert llm.num_in_flight == 0
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_outputs_are_cumulative_and_end_finished(llm):
    async def main():
        return [out async for out in llm.generate("abc", greedy(6), "r")]

    outs = run(main())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 6


def test_leaving_the_iteration_aborts_the_request(llm, fake):
    async def main():
        gen = llm.generate("abc", greedy(100), "leave")
        seen = 0
        async for _ in gen:
            seen += 1
            if seen == 3:
                break
        await gen.aclose()
        await asyncio.sleep(0.1)

    run(main())
    assert "leave" in fake.aborted
    assert llm.num_in_flight == 0
    stats = llm.get_stats()
    assert stats["running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_cancelling_the_task_aborts_the_request(llm, fake):
    async def consume():
        async for _ in llm.generate("abc", greedy(10_000 // 100), "cancel-me"):
            await asyncio.sleep(0.01)

    async def main():
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)

    run(main())
    assert "cancel-me" in fake.aborted
    assert not fake.has_unfinished_requests()


def test_abort_ends_the_stream_with_abort(llm):
    async def main():
        stream = await llm.add_request("x", "abc", greedy(100))
        await stream.get()
        await llm.abort("x")
        return [o async for o in stream]

    outs = run(main())
    assert outs[-1].finished
    assert outs[-1].outputs[0].finish_reason == "abort"


def test_add_request_errors_reach_the_caller_and_others_continue(llm, fake):
    async def main():
        good = asyncio.ensure_future(_last(llm.generate("abc", greedy(20), "good")))
        with pytest.raises(ValueError, match="max_model_len"):
            await llm.add_request("bad", "x" * 500, greedy(4))
        with pytest.raises(ValueError, match="already in flight"):
            await llm.add_request("good", "abc", greedy(4))
        return await good

    final = run(main())
    assert len(final.outputs[0].token_ids) == 20
    assert llm.num_in_flight == 0


async def _last(gen):
    last = None
    async for out in gen:
        last = out
    return last


def test_engine_death_fails_streams_and_new_requests(llm, fake):
    async def main():
        stream = await llm.add_request("r", "abc", greedy(1000))
        await stream.get()
        fake.fail_next_step = True
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await llm.add_request("r2", "abc", greedy(4))

    run(main())
    assert llm.errored


def test_shutdown_aborts_in_flight_requests(fake):
    llm = AsyncLLM(fake)

    async def main():
        stream = await llm.add_request("r", "abc", greedy(1000))
        await stream.get()
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        return [o async for o in stream]

    outs = run(main())
    assert outs[-1].outputs[0].finish_reason == "abort"
    assert not llm.is_running
    with pytest.raises(EngineDeadError):
        llm.check_health()


def test_stat_observer_counts_tokens_and_ttft(fake):
    metrics = ServerMetrics("m")
    llm = AsyncLLM(fake, stat_observer=metrics)
    try:
        async def main():
            await asyncio.gather(*(_last(llm.generate("abc", greedy(7, n=2), f"r{i}"))
                                   for i in range(3)))
        run(main())
    finally:
        llm.shutdown()
    assert metrics.generation_tokens_total == 3 * 2 * 7
    assert metrics.prompt_tokens_total == 3 * 4  # BOS + "abc"
    assert metrics.ttft.count == 3
    assert metrics.finished["length"] == 3
    assert metrics.generation_tokens_per_second() > 0


def test_engine_built_and_stepped_in_the_engine_thread():
    """`build_engine` runs in the engine thread, which then steps it: the caller's thread
    does no model work (a second thread with an OpenMP team slows the engine's)."""
    import threading

    threads = {}

    class Recording(FakeEngine):
        def step(self):
            threads["step"] = threading.current_thread().name
            return super().step()

    def build():
        threads["build"] = threading.current_thread().name
        return Recording(step_delay=0.001)

    llm = AsyncLLM(build_engine=build)
    try:
        async def go():
            return [o async for o in llm.generate("hi", greedy(3), "r0")][-1]

        assert run(go()).finished
        assert threads == {"build": "vllm-engine-loop", "step": "vllm-engine-loop"}
    finally:
        llm.shutdown()


def test_a_failed_build_is_raised_to_the_caller():
    def build():
        raise ValueError("bad model path 'nowhere'")

    with pytest.raises(ValueError, match="nowhere"):
        AsyncLLM(build_engine=build)
    with pytest.raises(TypeError, match="exactly one"):
        AsyncLLM()


def test_upstream_async_names_on_a_real_engine():
    """`from vllm import AsyncLLMEngine, AsyncEngineArgs, TokensPrompt, TextPrompt` and
    upstream's `async for out in engine.generate(prompt, params, request_id)`: the outputs
    equal the offline LLM's."""
    from vllm import LLM, AsyncEngineArgs, AsyncLLMEngine, TextPrompt, TokensPrompt

    params = SamplingParams(max_tokens=6, temperature=0)
    llm = LLM(model="demo", optimization_level=0, max_model_len=64)
    expected = llm.generate("def f(", params, use_tqdm=False)[0].outputs[0]
    ids = llm.get_tokenizer().encode("def f(")
    llm.llm_engine.shutdown()

    async def run(engine):
        finals = []
        for i, prompt in enumerate([TextPrompt(prompt="def f("),
                                    TokensPrompt(prompt_token_ids=ids)]):
            outputs = [out async for out in engine.generate(prompt, params, f"r{i}")]
            finals.append(outputs[-1])
        return finals

    async def accessors(engine):
        assert (await engine.get_tokenizer()) is engine.tokenizer
        assert (await engine.get_model_config()).max_model_len == 64
        assert (await engine.get_vllm_config()).optimization_level == 0
        return await engine.reset_prefix_cache()

    engine = AsyncLLMEngine.from_engine_args(
        AsyncEngineArgs(model="demo", optimization_level=0, max_model_len=64))
    try:
        finals = asyncio.run(run(engine))
        assert asyncio.run(accessors(engine)) is True and not engine.is_stopped
    finally:
        engine.shutdown()
    assert engine.is_stopped
    assert all(f.finished and f.outputs[0].token_ids == expected.token_ids for f in finals)
    assert finals[0].outputs[0].text == expected.text


def test_itl_counts_every_token_after_the_first_even_when_they_arrive_together():
    """The engine-core process may hand over two steps' tokens in one output: the extra tokens
    of the first output are inter-token intervals (of 0 s), so a request of N tokens always
    adds N - 1 to the ITL histogram's count."""
    from types import SimpleNamespace

    from vllm.engine.async_llm import RequestStream

    metrics = ServerMetrics("m")
    loop = asyncio.new_event_loop()
    try:
        stream = RequestStream("r", loop)
        stream.arrival_time = 0.0

        def output(n):
            return SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(n)))],
                                   prompt_token_ids=[1, 2], finished=False)

        for now, n in ((1.0, 2), (1.5, 3), (2.5, 5)):  # 2 tokens at once, then 1, then 2
            AsyncLLM._observe(metrics, stream, output(n), now)
    finally:
        loop.close()
    assert metrics.ttft.count == 1
    assert metrics.itl.count == 4  # 5 tokens


def test_add_requests_hands_the_engine_one_batch(llm, fake, monkeypatch):
    """Several requests in one command: the engine thread adds them all between the same two
    steps (while another request keeps it stepping); a refused one (a bad prompt, an id already
    in flight) comes back as its exception and is not in flight, the others run."""
    events: list[str] = []
    add, step = fake.add_request, fake.step

    def recording_add(*args):
        events.append("add")
        return add(*args)

    def recording_step():
        events.append("step")
        return step()

    monkeypatch.setattr(fake, "add_request", recording_add)
    monkeypatch.setattr(fake, "step", recording_step)
    submitted = []
    submit = llm._submit
    monkeypatch.setattr(llm, "_submit", lambda command: (submitted.append(command),
                                                          submit(command)))

    async def main():
        busy = asyncio.ensure_future(_last(llm.generate("abc", greedy(200), "busy")))
        while "step" not in events:
            await asyncio.sleep(0.001)
        batch = [(f"r{i}", "ab", greedy(3)) for i in range(64)]
        batch[5] = ("bad", "x" * 500, greedy(3))  # longer than max_model_len
        batch[9] = ("busy", "ab", greedy(3))      # already in flight
        results = await llm.add_requests(batch)
        finals = await asyncio.gather(*(_last(r) for r in results
                                        if not isinstance(r, BaseException)))
        await llm.abort("busy")
        await busy
        return results, finals

    results, finals = run(main())
    assert len(submitted) == 2 and len(submitted[1].adds) == 63  # the duplicate never queued
    assert isinstance(results[5], ValueError) and "max_model_len" in str(results[5])
    assert isinstance(results[9], ValueError) and "already in flight" in str(results[9])
    assert len(finals) == 62 and all(len(f.outputs[0].token_ids) == 3 for f in finals)
    adds = [i for i, e in enumerate(events) if e == "add"]
    assert len(adds) == 1 + 63 and "step" not in events[adds[1]:adds[-1] + 1]
    assert llm.num_in_flight == 0
