"""The engine core in its own process (vllm/engine/core.py, core_client.py): its messages,
its output processor, and AsyncLLM over a real core process (demo model): same tokens as the
in-process engine, stop strings found in the API process stop the core, an abort frees the
core's blocks, the core dying fails every stream with EngineDeadError."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec
import pytest

from vllm.engine.core import (
    Abort,
    AddRequest,
    CoreOutputProcessor,
    Dead,
    FinishSequences,
    Ready,
    Shutdown,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    command_decoder,
    make_encoder,
    pickled,
    reply_decoder,
)
from vllm.engine.sched_output import EngineCoreOutput, LogprobsLists
from vllm.sampling_params import SamplingParams


# ---- messages ------------------------------------------------------------------------------
def test_commands_round_trip_with_sampling_params():
    params = SamplingParams(temperature=0.5, top_p=0.9, stop=["\n\n", "END"], seed=7,
                            max_tokens=12, logprobs=2)
    params.update_from_eos({2})
    child = params.clone()
    child.n, child.seed = 1, 8
    commands = [AddRequest("r1", [1, 2, 3], pickled(params), ["0_r1", "1_r1"],
                           [pickled(params), pickled(child)], 12, 123.5),
                Abort(["x", "y"]), FinishSequences(["0_r1"]), UtilityCall(3, "reset_prefix_cache"),
                Shutdown()]
    frame = make_encoder().encode(commands)
    decoded = command_decoder().decode(frame)
    assert [type(c) for c in decoded] == [type(c) for c in commands]
    add = decoded[0]
    assert (add.request_id, add.prompt_token_ids, add.internal_ids, add.max_tokens,
            add.arrival_time) == ("r1", [1, 2, 3], ["0_r1", "1_r1"], 12, 123.5)
    assert isinstance(add.params, SamplingParams)
    assert add.params.stop == ["\n\n", "END"] and add.params.seed == 7
    assert add.params.all_stop_token_ids == params.all_stop_token_ids
    assert add.child_params[1].seed == 8
    assert add.params.stop_matcher().stops == ("\n\n", "END")  # derived cache rebuilt
    assert decoded[1].request_ids == ["x", "y"] and decoded[2].internal_ids == ["0_r1"]
    assert decoded[3] == UtilityCall(3, "reset_prefix_cache")


def test_replies_round_trip():
    outs = [EngineCoreOutput("a", [5, 6], new_logprobs=[LogprobsLists([5, 1], [-0.1, -2.0],
                                                                      [1, 2])]),
            EngineCoreOutput("b", [9], finish_reason="stop", stop_reason=9,
                             num_cached_tokens=16)]
    encoder, decoder = make_encoder(), reply_decoder()
    step = decoder.decode(encoder.encode(StepOutputs(outs, {"c": ValueError("bad")},
                                                     {"running": 2, "kv": 0.5})))
    assert isinstance(step, StepOutputs) and step.outputs == outs
    assert step.outputs[1].finished and step.stats == {"running": 2, "kv": 0.5}
    assert isinstance(step.failed["c"], ValueError) and str(step.failed["c"]) == "bad"
    assert decoder.decode(encoder.encode(Dead("boom"))) == Dead("boom")
    assert decoder.decode(encoder.encode(UtilityResult(1, result=True))).result is True
    ready = decoder.decode(encoder.encode(Ready(pickled({"a": {1, 2}}), 1.5, {"x": 1.0},
                                                pickled([]), {}, 42)))
    assert ready.vllm_config == {"a": {1, 2}} and ready.pid == 42


def test_unknown_extension_is_refused():
    frame = msgspec.msgpack.encode(UtilityResult(1, result=msgspec.msgpack.Ext(9, b"x")))
    with pytest.raises(ValueError, match="unknown MessagePack extension 9"):
        reply_decoder().decode(frame)


def test_core_output_processor_collects_ids_and_forgets_finished_requests():
    proc = CoreOutputProcessor(tokenizer=object())  # never decodes
    params = SamplingParams(max_tokens=4, stop=["x"])
    proc.add_request("r", None, [1, 2], params, ["0_r", "1_r"], [params, params])
    outs = [EngineCoreOutput("0_r", [7]), EngineCoreOutput("1_r", [8], finish_reason="length")]
    assert proc.process_outputs(outs) == ([], [])
    assert proc.take() == outs and proc.take() == []
    assert proc.has_unfinished_requests()
    assert proc.finish_sequences(["0_r", "nope"]) == ["0_r"]
    assert not proc.has_unfinished_requests()


# ---- a real engine-core process (demo model) ----------------------------------------------
ARGS = {"model": "demo", "optimization_level": 0, "max_model_len": 256,
        "kv_cache_memory": "32MiB"}


def _run(coro):
    return asyncio.run(coro)


async def _final(llm, prompt, params, rid):
    last = None
    async for out in llm.generate(prompt, params, rid):
        last = out
    return last


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def core_llm():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(EngineArgs(**ARGS), multiprocessing=True)
    yield llm
    llm.shutdown()
    assert not llm.engine.process.is_alive()


@pytest.mark.slow
def test_core_process_matches_the_in_process_engine(core_llm):
    from vllm.engine.core_client import EngineCoreClient
    from vllm.entrypoints.llm import LLM

    assert isinstance(core_llm.engine, EngineCoreClient)
    assert core_llm.engine.process.pid != os.getpid()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=8, n=2, ignore_eos=True)
    llm = LLM(**ARGS)
    try:
        expected = llm.generate(["def f(", "import os"], params, use_tqdm=False)
        expected_seeded = llm.generate(["x = "], seeded, use_tqdm=False)[0]
    finally:
        llm.llm_engine.shutdown()

    async def main():
        return await asyncio.gather(_final(core_llm, "def f(", params, "a"),
                                    _final(core_llm, "import os", params, "b"),
                                    _final(core_llm, "x = ", seeded, "c"))

    got_a, got_b, got_c = _run(main())
    for got, want in ((got_a, expected[0]), (got_b, expected[1])):
        assert got.finished and got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text
        assert [set(lp) for lp in got.outputs[0].logprobs] == \
            [set(lp) for lp in want.outputs[0].logprobs]
    assert [c.token_ids for c in got_c.outputs] == [c.token_ids for c in expected_seeded.outputs]


@pytest.mark.slow
def test_stop_string_finishes_in_the_api_process_and_the_core_stops(core_llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = _run(_final(core_llm, "def f(", greedy, "probe")).outputs[0].text
    stop = text[4:7]
    assert stop and text.find(stop) == 4
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, stop=[stop])
    out = _run(_final(core_llm, "def f(", long, "stopped")).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == text[:4]
    # The core finished it too (not after 200 tokens): nothing running, every block free.
    stats = core_llm.engine.stats
    assert _wait_for(lambda: stats()["running"] == 0 and
                     stats()["num_free_blocks"] == stats()["num_total_blocks"], 30), stats()
    assert len(out.token_ids) < 24


@pytest.mark.slow
def test_abort_reaches_the_core_and_frees_its_blocks(core_llm):
    params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)

    async def main():
        seen = 0
        async for out in core_llm.generate("def f(", params, "aborted"):
            seen = len(out.outputs[0].token_ids)
            if seen >= 2:
                break  # leaving the iteration aborts it
        return seen

    assert _run(main()) >= 2
    stats = core_llm.engine.stats
    assert _wait_for(lambda: stats()["running"] == 0 and
                     stats()["num_free_blocks"] == stats()["num_total_blocks"], 30), stats()
    assert core_llm.num_in_flight == 0 and core_llm.get_stats()["running"] == 0


@pytest.mark.slow
def test_reset_prefix_cache_runs_in_the_core(core_llm):
    assert _run(core_llm.reset_prefix_cache()) is True


@pytest.mark.slow
def test_core_process_death_fails_every_stream_with_engine_dead_error():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.engine.async_llm import AsyncLLM, EngineDeadError

    llm = AsyncLLM.from_engine_args(EngineArgs(**ARGS), multiprocessing=True)
    pid = llm.engine.process.pid
    params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)

    async def main():
        async def consume(rid):
            async for out in llm.generate("def f(", params, rid):
                if len(out.outputs[0].token_ids) >= 2:
                    os.kill(pid, signal.SIGKILL)
        results = await asyncio.wait_for(
            asyncio.gather(consume("a"), consume("b"), return_exceptions=True), 60)
        with pytest.raises(EngineDeadError):
            await llm.add_request("late", "x", params)
        return results

    try:
        results = _run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert llm.errored and f"pid {pid}" in str(llm.dead_error)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_core_start_failure_is_raised_in_the_api_process():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.engine.async_llm import AsyncLLM

    with pytest.raises(ValueError, match="max_model_len"):
        AsyncLLM.from_engine_args(EngineArgs(model="demo", optimization_level=0,
                                             max_model_len=10**9), multiprocessing=True)


def test_servers_default_to_the_core_process_and_the_switch_turns_it_off(monkeypatch):
    from vllm.engine.async_llm import multiprocessing_requested

    monkeypatch.delenv("VLLM_ENABLE_MULTIPROCESSING", raising=False)
    assert multiprocessing_requested() is True  # the servers' default
    assert multiprocessing_requested(default=False) is False  # AsyncLLM's own default
    monkeypatch.setenv("VLLM_ENABLE_MULTIPROCESSING", "0")
    assert multiprocessing_requested() is False
    monkeypatch.setenv("VLLM_ENABLE_MULTIPROCESSING", "1")
    assert multiprocessing_requested(default=False) is True
    monkeypatch.setenv("VLLM_ENABLE_MULTIPROCESSING", "sometimes")
    with pytest.raises(ValueError, match="VLLM_ENABLE_MULTIPROCESSING"):
        multiprocessing_requested()
