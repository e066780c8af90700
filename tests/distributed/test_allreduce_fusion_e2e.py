"""TP=2 on the CPU at -O2 (a one-layer tiny Llama, mp executor): the all-reduce runs through
shared memory; with `fuse_allreduce_rms=True` the AllReduce+RMSNorm fusion pass rewrites every
all-reduce -> RMSNorm of the model (the embedding's, and after the attention and the MLP) in
the Inductor-compiled graph, and the -O2 default (off on the CPU) rewrites none; greedy tokens
are identical, and logprobs within tolerance, between the two, and under the Ray executor too.
(TP=2 against TP=1: tests/model_executor/test_tp_families.py; the unfused TP=2 -O2 graph
through Inductor against -O0: tests/compile/test_graph_cache_e2e.py.)

One layer, so that the cold TP=2 Inductor compile has two pieces to build per rank (the
embedding's and the layer's), not three: it is most of this test's time."""
from __future__ import annotations

import importlib.util
import logging

import pytest

try:
    from tests.model_executor.hf_checkpoints import make_llama
except ImportError:  # tests/ itself on sys.path
    from model_executor.hf_checkpoints import make_llama

from vllm import LLM, SamplingParams
from vllm.compilation.passes.fusion.matcher_utils import fusion_match_counter

# (its Ray run starts a local cluster: see tests/engine/test_ray_executor.py's group)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray_cluster")]

PROMPTS = ["Hello world", "The capital of France is"]
# Every all-reduce followed by an RMSNorm in a one-layer Llama: the embedding's (-> the
# layer's input norm), the attention's (-> its post-attention norm, with the residual add)
# and the MLP's (-> the final norm, with the residual add).
ALLREDUCE_NORMS = 3


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return make_llama(tmp_path_factory.mktemp("allreduce") / "llama", num_hidden_layers=1)


def generate(model: str, tp: int, cc: dict, backend: str | None = None):
    llm = LLM(model=model, tensor_parallel_size=tp, optimization_level=2, max_model_len=128,
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


FUSED = {"pass_config": {"fuse_allreduce_rms": True}}  # explicit: off by default on the CPU


def test_tp2_fused_matches_unfused(tmp_path, monkeypatch, caplog, llama):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))  # the passes run (no compile cache)
    caplog.set_level(logging.INFO, logger="vllm")
    before = fusion_match_counter["AllReduceFusionPass"]
    fused = generate(llama, 2, FUSED)
    # (Rank 0's pieces: the match counter is this process's.)
    assert fusion_match_counter["AllReduceFusionPass"] - before == ALLREDUCE_NORMS
    assert "Enabled fusions: allreduce_rms" in caplog.text
    assert "AllReduceFusionPass=" in caplog.text
    assert "through shared memory" in caplog.text
    assert "backend inductor" in caplog.text and "compile cache: miss" in caplog.text

    # The -O2 default, through the same graph passes but the "eager" compile backend (our
    # passes, no codegen): no pass is a fusion, nothing is rewritten, and the fused Inductor
    # graph generates what the unfused graph does when torch runs it op by op.
    caplog.clear()
    before = fusion_match_counter["AllReduceFusionPass"]
    unfused = generate(llama, 2, {"backend": "eager"})
    assert fusion_match_counter["AllReduceFusionPass"] == before
    assert "Enabled fusions: none" in caplog.text
    assert "AllReduceFusionPass" not in caplog.text
    assert "through shared memory" in caplog.text
    assert_same(fused, unfused)

    # The same fused graph under the Ray executor (ranks as actors of a local cluster on this
    # host, so shared memory): loaded from the compile cache the mp run filled (same key),
    # the same tokens and logprobs.
    if importlib.util.find_spec("ray") is not None:
        assert_same(generate(llama, 2, FUSED, "ray"), fused)
