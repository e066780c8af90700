"""-O0..-O3 on a real CUDA GPU (skipped without one): the CUDA paths end to end.

On a tiny float32 Llama checkpoint: -O0 generates what transformers' own `generate` does on
the same GPU; the compiled levels (Inductor -> Triton) capture CUDA graphs during start-up,
replay them while serving, compile nothing after start-up, and generate what -O0 does with
logprobs within a tight tolerance, under continuous batching of mixed prompt lengths.
"""
from __future__ import annotations

import pytest
import torch

try:
    from tests.model_executor.hf_checkpoints import make_llama
except ImportError:  # tests/ itself on sys.path
    from model_executor.hf_checkpoints import make_llama

from vllm import LLM, SamplingParams
from vllm.compilation.counter import compilation_counter
from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.config.compilation import CUDAGraphMode
from vllm.engine.worker import Worker

# conftest's _share_the_gpu replaces this for the test workers; one test here uses it.
_PROFILED_KV_BYTES = Worker._cuda_available_kv_bytes

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT_LENS = [1, 5, 37, 3, 18, 9, 26, 2]
MAX_TOKENS = [6, 10, 4, 8, 3, 9, 5, 7]
ENGINE = {"max_model_len": 128, "max_num_batched_tokens": 24, "max_num_seqs": 8,
          "kv_cache_memory": "16MiB", "enable_prefix_caching": False, "dtype": "float32"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("cuda") / "llama")


@pytest.fixture(autouse=True)
def _fail_on_recompile(monkeypatch):
    monkeypatch.setenv("VLLM_TEST_FAIL_ON_RECOMPILE", "1")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in PROMPT_LENS]


def run(llm: LLM) -> tuple[list[list[int]], list[dict[int, float]]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, logprobs=3)
              for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params,
                           use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [{t: lp.logprob for t, lp in entry.items()}
                for o in outputs for entry in o.outputs[0].logprobs]
    return tokens, logprobs


_O0: dict[str, tuple] = {}


def o0(path: str) -> tuple:
    if path not in _O0:
        llm = LLM(model=path, optimization_level=0, **ENGINE)
        _O0[path] = run(llm)
        llm.llm_engine.shutdown()
    return _O0[path]


def test_o0_matches_transformers_on_the_gpu(llama):
    from transformers import AutoModelForCausalLM

    tokens, _ = o0(llama)
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).cuda().eval()
    for prompt, n, got in zip(prompts(), MAX_TOKENS, tokens):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 attention_mask=torch.ones_like(ids))
        assert got == out[0, len(prompt):].tolist()


def test_kv_cache_sized_from_gpu_memory_utilization(llama, monkeypatch):
    """No kv_cache_memory: a profiled forward at the full token budget, then the cache gets
    what gpu_memory_utilization leaves."""
    monkeypatch.setattr(Worker, "_cuda_available_kv_bytes", _PROFILED_KV_BYTES)
    engine = {k: v for k, v in ENGINE.items() if k != "kv_cache_memory"}
    llm = LLM(model=llama, optimization_level=0, gpu_memory_utilization=0.5, **engine)
    worker = llm.llm_engine.executor.worker
    assert worker.kv_source.startswith("gpu_memory_utilization=0.5 leaves")
    free, total = torch.cuda.mem_get_info()
    assert llm.llm_engine.executor.num_blocks * worker.block_bytes <= 0.5 * total
    assert run(llm)[0] == o0(llama)[0]
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("level", [1, 2, 3])
def test_compiled_level_replays_cuda_graphs_and_matches_o0(llama, level):
    """Where Triton is installed (every CUDA build of torch) the default attention backend is
    TRITON_ATTN, whose decode batches replay full graphs at -O2/-O3."""
    tokens0, logprobs0 = o0(llama)
    before = compilation_counter.num_cudagraph_captured
    triggers_before = compilation_counter.num_gpu_runner_capture_triggers
    llm = LLM(model=llama, optimization_level=level, **ENGINE)
    runner = llm.llm_engine.executor.worker.model_runner
    assert runner.device.type == "cuda"
    cc = llm.llm_engine.vllm_config.compilation_config
    assert cc.cudagraph_mode == (CUDAGraphMode.PIECEWISE if level == 1
                                 else CUDAGraphMode.FULL_AND_PIECEWISE)
    assert runner.cudagraph_dispatcher is not None
    captured = compilation_counter.num_cudagraph_captured - before
    assert captured > 0
    # one capture per dispatcher key; a piecewise key captures one graph per piece
    assert 0 < compilation_counter.num_gpu_runner_capture_triggers - triggers_before <= captured
    replayed = compilation_counter.num_cudagraph_replayed
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=0,
                                    num_recompiles=0, num_cudagraph_captured=0):
        tokens, logprobs = run(llm)
    # Decode steps (up to 8 tokens, all captured sizes) replay graphs.
    assert compilation_counter.num_cudagraph_replayed > replayed
    if level >= 2 and runner.attn_backend.get_name() == "TRITON_ATTN":
        # Its decode kernel runs inside full graphs: the decode steps replay whole-model
        # graphs (FULL_AND_PIECEWISE kept, not narrowed to PIECEWISE).
        assert runner._resolved_cudagraph_mode() == CUDAGraphMode.FULL_AND_PIECEWISE
        assert isinstance(runner.model, CUDAGraphWrapper)
        assert runner.model.runtime_mode == CUDAGraphMode.FULL
        assert sum(entry.replays for entry in runner.model.entries.values()) > 0
    assert tokens == tokens0
    assert len(logprobs) == len(logprobs0)
    worst = max(abs(got[t] - want[t]) for got, want in zip(logprobs, logprobs0)
                for t in set(got) & set(want))
    assert worst <= 1e-3, worst
    llm.llm_engine.shutdown()
