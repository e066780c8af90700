"""TP=2 on the CPU at -O2 (the demo model, mp executor): the all-reduce runs through shared
memory; with `fuse_allreduce_rms=True` the AllReduce+RMSNorm fusion pass rewrites every
all-reduce -> RMSNorm of the model (the embedding's, and after each attention and MLP) and the
default (off on the CPU) rewrites none; greedy tokens are identical, and logprobs within
tolerance, between the two, and under the Ray executor too. (TP=2 against TP=1:
tests/model_executor/test_tp_families.py.)"""
from __future__ import annotations

import importlib.util
import logging

import pytest

from vllm import LLM, SamplingParams
from vllm.compilation.passes.fusion.matcher_utils import fusion_match_counter

pytestmark = pytest.mark.slow

PROMPTS = ["Hello world", "The capital of France is"]


def generate(tp: int, fuse: bool | None, backend: str | None = None):
    cc = {} if fuse is None else {"pass_config": {"fuse_allreduce_rms": fuse}}
    llm = LLM(model="demo", tensor_parallel_size=tp, optimization_level=2, max_model_len=128,
              kv_cache_memory="16MiB", compilation_config=cc,
              distributed_executor_backend=backend)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids),
                 [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                for o in outs]
    finally:
        llm.llm_engine.shutdown()  # (a second TP engine in this process needs a fresh group)


def assert_same(got, want, tol: float = 1e-3) -> None:
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, g_steps), (_, w_steps) in zip(got, want):
        for g, w in zip(g_steps, w_steps):
            for token in set(g) & set(w):
                assert abs(g[token] - w[token]) < tol, (token, g[token], w[token])


def test_tp2_fused_matches_unfused(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))  # the passes run (no compile cache)
    caplog.set_level(logging.INFO, logger="vllm")
    before = fusion_match_counter["AllReduceFusionPass"]
    fused = generate(2, True)  # explicit: off by default on the CPU (measured slower)
    matched = fusion_match_counter["AllReduceFusionPass"] - before
    assert matched >= 5, matched  # embedding + 2 per layer of the 2-layer demo model
    assert "Enabled fusions: allreduce_rms" in caplog.text
    assert "AllReduceFusionPass=" in caplog.text
    assert "through shared memory" in caplog.text

    caplog.clear()
    before = fusion_match_counter["AllReduceFusionPass"]
    unfused = generate(2, None)  # the -O2 default
    assert fusion_match_counter["AllReduceFusionPass"] == before
    assert "AllReduceFusionPass" not in caplog.text
    assert_same(fused, unfused)

    # The same fused graph under the Ray executor (ranks as actors of a local cluster on this
    # host, so shared memory): loaded from the compile cache the mp run filled (same key),
    # the same tokens and logprobs.
    if importlib.util.find_spec("ray") is not None:
        assert_same(generate(2, True, "ray"), fused)
