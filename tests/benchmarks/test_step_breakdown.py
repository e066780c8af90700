"""benchmarks/step_breakdown.py --phases: the unprofiled per-phase timing of an engine step."""
from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import step_breakdown  # noqa: E402


class _Part:
    """Stands for a scheduler / model runner / output processor: each phase method sleeps a
    known time and returns its arguments."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s

    def _work(self, *args):
        time.sleep(self.sleep_s)
        return args

    schedule = update_from_output = _prepare_inputs = _run_model = _sample = _work
    process_outputs = _work


def _fake_engine(sleep_s: float) -> SimpleNamespace:
    return SimpleNamespace(
        scheduler=_Part(sleep_s), output_processor=_Part(sleep_s),
        executor=SimpleNamespace(worker=SimpleNamespace(model_runner=_Part(sleep_s))))


def test_phase_timers_time_each_phase_only_while_recording_and_restore_the_methods():
    engine = _fake_engine(0.01)
    runner = engine.executor.worker.model_runner
    timers = step_breakdown.PhaseTimers(engine)
    assert runner._run_model(1, 2) == (1, 2)  # wrapped calls still return what they return
    assert set(timers.seconds.values()) == {0.0}  # not recording yet
    timers.recording = True
    for _ in range(3):
        runner._run_model()
    engine.scheduler.schedule()
    timers.recording = False
    engine.output_processor.process_outputs()
    assert timers.seconds["forward"] >= 0.03
    assert timers.seconds["schedule"] >= 0.01
    assert timers.seconds["output processing"] == 0.0
    assert timers.seconds["logits + sampling"] == 0.0
    timers.close()
    for owner, method in [(runner, "_run_model"), (engine.scheduler, "schedule"),
                          (engine.output_processor, "process_outputs")]:
        assert method not in vars(owner)  # the class's own method again


def test_phase_table_splits_the_step_and_names_the_host_work():
    seconds = dict.fromkeys(step_breakdown.PHASES, 0.0)
    seconds.update({"forward": 6.0, "logits + sampling": 2.0, "schedule": 0.5,
                    "output processing": 0.5})
    lines = step_breakdown.phase_table(seconds, wall=10.0, num_steps=100)
    text = "\n".join(lines)
    assert "forward" in text and "60.000 ms" in text and "60.0%" in text
    assert "engine loop, rest" in text and "10.000 ms" in text  # 10 - 9 s over 100 steps
    # host work = the step outside forward and sampling: 2 s of 10 over 100 steps
    assert lines[-1].strip() == "host work outside forward and sampling: 20.000 ms a step (20.0%)"


def test_phase_timers_wrap_the_real_engine():
    """The PHASES names exist on the in-process engine, and a few decode steps of the demo
    model spend time in the forward and in sampling."""
    pytest.importorskip("transformers")
    from vllm import LLM, SamplingParams

    llm = LLM(model="demo", optimization_level=0, max_model_len=128, kv_cache_memory="64MiB")
    engine = llm.llm_engine
    timers = step_breakdown.PhaseTimers(engine)
    timers.recording = True
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}],
                       SamplingParams(max_tokens=4, ignore_eos=True))
    timers.close()
    assert len(out[0].outputs[0].token_ids) == 4
    assert all(timers.seconds[p] > 0 for p in step_breakdown.PHASES), timers.seconds
