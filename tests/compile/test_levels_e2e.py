"""-O0..-O3 end to end on the engine's tiny float32 checkpoints (Llama, Qwen3, Mixtral).

Greedy tokens are identical to -O0 token for token and logprobs (sampled and prompt) agree
within a tight tolerance, under continuous batching of mixed prompt lengths with chunked
prefill (every step has another token count, so the dynamic dimension is exercised across
sizes, compile sizes included). The model is traced by Dynamo exactly once, split into
attention layers + 1 compiled pieces, compiled during start-up (nothing is compiled or
recompiled while serving; VLLM_TEST_FAIL_ON_RECOMPILE=1), and the start-up phase table adds
up to the wall time. Most combinations use the "eager" compile backend (our passes, no
codegen); one Inductor run is marked slow.
"""
from __future__ import annotations

import gc
import json
import logging
import time

import pytest
import torch

try:
    from tests.model_executor.hf_checkpoints import lazy_checkpoints
except ImportError:  # tests/ itself on sys.path
    from model_executor.hf_checkpoints import lazy_checkpoints

from vllm import LLM, SamplingParams
from vllm.compilation.counter import compilation_counter
from vllm.config.vllm import ATTENTION_OPS
from vllm.model_executor.layers import cpu_prepacked_linear as cpl
from vllm.utils.startup_timer import STANDARD_PHASES

NUM_LAYERS = 2  # the TINY checkpoints
# Prompt lengths from 1 to 37 tokens and output lengths from 3 to 10: with a 24-token step
# budget, prefill chunks, decodes and finished requests mix in every step.
PROMPT_LENS = [1, 5, 37, 3, 18, 9, 26, 2]
MAX_TOKENS = [6, 10, 4, 8, 3, 9, 5, 7]
LOGPROBS = 3
ENGINE = {"max_model_len": 128, "max_num_batched_tokens": 24, "max_num_seqs": 8,
          "kv_cache_memory": "16MiB", "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return lazy_checkpoints(tmp_path_factory.mktemp("levels"))


@pytest.fixture(autouse=True)
def _fail_on_recompile(monkeypatch, cpu_platform):
    """(On the CPU even on a GPU machine: the checks below are the CPU's level table, prepacked
    linears and whole-graph -O3; tests/engine/test_cuda_e2e.py runs the levels on CUDA.)"""
    monkeypatch.setenv("VLLM_TEST_FAIL_ON_RECOMPILE", "1")


def prompts() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 384, (n,), generator=g).tolist()}
            for n in PROMPT_LENS]


def params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, logprobs=LOGPROBS,
                           prompt_logprobs=LOGPROBS) for n in MAX_TOKENS]


def run(llm: LLM) -> tuple[list[list[int]], list[dict[int, float]]]:
    """(generated token ids per request, every logprob entry in order: prompt then sample)."""
    outputs = llm.generate(prompts(), params(), use_tqdm=False)
    tokens, logprobs = [], []
    for out in outputs:
        tokens.append(out.outputs[0].token_ids)
        for entry in (out.prompt_logprobs or [])[1:] + out.outputs[0].logprobs:
            logprobs.append({token: lp.logprob for token, lp in entry.items()})
    return tokens, logprobs


def assert_logprobs_close(actual: list[dict], expected: list[dict], atol: float) -> None:
    assert len(actual) == len(expected)
    worst = 0.0
    for got, want in zip(actual, expected):
        shared = set(got) & set(want)
        # The sampled/prompt token and the top-k: the same set unless two were within atol.
        assert len(shared) >= len(want) - 1, (got, want)
        worst = max([worst] + [abs(got[t] - want[t]) for t in shared])
    assert worst <= atol, f"largest logprob difference {worst:.2e} > {atol:.0e}"


_REFERENCE: dict[str, tuple] = {}


def reference(checkpoints, model: str) -> tuple:
    """-O0 results, computed once per model."""
    if model not in _REFERENCE:
        llm = LLM(model=checkpoints(model), optimization_level=0, **ENGINE)
        _REFERENCE[model] = run(llm)
        llm.llm_engine.shutdown()
    return _REFERENCE[model]


def build(path: str, level: int, caplog, **compilation) -> tuple[LLM, float]:
    caplog.clear()
    start = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="vllm"):
        llm = LLM(model=path, optimization_level=level, compilation_config=compilation,
                  **ENGINE)
    return llm, time.perf_counter() - start


def check_startup_table(llm: LLM, wall: float, caplog) -> None:
    engine = llm.llm_engine
    phases = engine.startup_phases
    # The standard phases in order ("graph loading" may come between them, after "dynamo
    # tracing", when the compile cache was looked at for a traced graph).
    assert [p for p in phases if p != "graph loading"][:len(STANDARD_PHASES)] == \
        list(STANDARD_PHASES)
    assert "other" in phases
    # The rows add up to the engine's wall time, which is the caller's within 5%.
    assert sum(phases.values()) == pytest.approx(engine.startup_seconds, rel=1e-6)
    # (20 ms for what LLM() does around the engine: a cached -O0 start takes ~10 ms)
    assert abs(sum(phases.values()) - wall) <= max(0.05 * wall, 0.02), (phases, wall)
    assert phases["other"] <= 0.05 * wall + 0.05, phases
    tables = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith("Start-up phases")]
    assert len(tables) == 1
    for name in (*STANDARD_PHASES, "other", "total"):
        assert f"\n{name} " in tables[0], name


SIZES = [1, 2, 4, 8, 16]


def serve_and_compare(llm, tokens0, logprobs0, atol: float) -> None:
    """Compiled during start-up: serving compiles and traces nothing, and generates what -O0
    does."""
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=0,
                                    num_recompiles=0):
        tokens, logprobs = run(llm)
    assert tokens == tokens0
    assert_logprobs_close(logprobs, logprobs0, atol=atol)
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("model,level,sizes", [
    ("llama", 1, None), ("llama", 2, None), ("llama", 3, None), ("llama", 3, SIZES),
    ("qwen3", 1, None), ("qwen3", 3, SIZES),
    ("mixtral", 2, None),
])
def test_level_matches_o0_eager_backend(checkpoints, model, level, sizes, caplog):
    """`sizes`: explicit per-size static compiles (O3's switch, which the CPU turns off).
    Pieces: one per stretch between attention layers (NUM_LAYERS + 1 compiled, NUM_LAYERS
    attention pieces), except at -O3 on the CPU, which compiles the whole graph as one."""
    tokens0, logprobs0 = reference(checkpoints, model)
    whole_graph = level == 3
    compiled = 1 if whole_graph else NUM_LAYERS + 1
    extra = {} if sizes is None else {"compile_sizes": sizes}
    gc.collect()  # earlier engines' prepacked copies go with them
    prepacked = cpl.num_prepacked()
    with compilation_counter.expect(
            num_models_seen=1, num_graphs_seen=1, num_recompiles=0,
            num_piecewise_graphs_seen=1 if whole_graph else 2 * NUM_LAYERS + 1,
            num_piecewise_capturable_graphs_seen=compiled,
            num_backend_compilations=compiled * (1 + len(sizes or []))):
        llm, wall = build(checkpoints(model), level, caplog, backend="eager", **extra)
    cc = llm.llm_engine.vllm_config.compilation_config
    assert cc.compile_sizes == (sizes or [])
    assert cc.splitting_ops == ([] if whole_graph else ATTENTION_OPS)
    # -O2/-O3 on the CPU: every linear of the decoder layers and the LM head has a oneDNN-
    # prepacked copy (finished in the background after ready).
    cpl.wait_for_prepacking()
    linears = 4 if model != "mixtral" else 3  # qkv, o, gate_up, down (Mixtral: MoE, gate)
    assert cpl.num_prepacked() - prepacked == (NUM_LAYERS * linears + 1 if level >= 2 else 0)
    check_startup_table(llm, wall, caplog)
    serve_and_compare(llm, tokens0, logprobs0, atol=1e-4)


def test_o0_compiles_nothing_and_reports_its_startup(checkpoints, caplog):
    with compilation_counter.expect(num_models_seen=0, num_graphs_seen=0,
                                    num_backend_compilations=0):
        llm, wall = build(checkpoints("llama"), 0, caplog)
        check_startup_table(llm, wall, caplog)
    phases = llm.llm_engine.startup_phases
    assert phases["dynamo tracing"] == phases["inductor compilation"] == 0.0


@pytest.mark.slow
def test_inductor_o2_matches_o0(checkpoints, caplog, tmp_path):
    tokens0, logprobs0 = reference(checkpoints, "llama")
    with compilation_counter.expect(num_graphs_seen=1, num_recompiles=0,
                                    num_piecewise_capturable_graphs_seen=NUM_LAYERS + 1,
                                    num_gpu_runner_capture_triggers=0):  # the CPU: no graphs
        llm, wall = build(checkpoints("llama"), 2, caplog, backend="inductor",
                         cache_dir=str(tmp_path / "compile_cache"))
    check_startup_table(llm, wall, caplog)
    events = llm.llm_engine.startup_report["phases"]["inductor compilation"]["events"]
    assert sorted({e["piece"] for e in events}) == [0, 2, 4]
    assert all(e["backend"] == "inductor" and e["cache"] in ("hit", "miss", "off")
               for e in events)
    assert "compile cache: " in caplog.text
    serve_and_compare(llm, tokens0, logprobs0, atol=2e-4)


@pytest.mark.slow
def test_inductor_o3_whole_graph_matches_o0(checkpoints, caplog, tmp_path):
    """CPU -O3: attention (a mutating custom op) inside one Inductor graph."""
    tokens0, logprobs0 = reference(checkpoints, "qwen3")
    with compilation_counter.expect(num_graphs_seen=1, num_recompiles=0,
                                    num_piecewise_graphs_seen=1,
                                    num_piecewise_capturable_graphs_seen=1):
        llm, wall = build(checkpoints("qwen3"), 3, caplog, backend="inductor",
                          cache_dir=str(tmp_path / "compile_cache"))
    check_startup_table(llm, wall, caplog)
    serve_and_compare(llm, tokens0, logprobs0, atol=2e-4)


@pytest.mark.slow
def test_first_start_on_a_machine_accounts_the_kernel_builds(tmp_path):
    """With no built CPU kernels (an empty cache root and home cache), the builds during the
    first traced forward are the "cpu kernel build" row, not Dynamo tracing's, and the rows
    still add up to the wall time. (The linear kernels, the longest build, are switched off:
    the paged-attention build is the one measured.)"""
    import os
    import subprocess
    import sys

    code = ("import json\nfrom vllm import LLM\n"
            "llm = LLM(model='demo', optimization_level=1, max_model_len=64,\n"
            "          compilation_config={'backend': 'eager'})\n"
            "e = llm.llm_engine\n"
            "print(json.dumps({'wall': e.startup_seconds, 'phases': e.startup_phases,\n"
            "                  'builds': e.startup_report['phases']['cpu kernel build']}))\n")
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "root"),
           "XDG_CACHE_HOME": str(tmp_path / "xdg"), "VLLM_CPU_SMALL_M_LINEAR": "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=600, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    phases, wall = report["phases"], report["wall"]
    assert report["builds"]["count"] >= 1  # the paged-attention kernels
    assert phases["cpu kernel build"] > 2 * phases["dynamo tracing"]
    named = sum(v for k, v in phases.items() if k != "other")
    assert named <= 1.05 * wall and phases["other"] < 0.05 * wall, (phases, wall)
