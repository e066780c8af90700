"""Every model family end to end through `LLM.generate`: greedy tokens identical to
transformers' own `generate` (eager attention, float32) and the sampled tokens' logprobs
within 2e-3 of transformers' log-softmax, on tiny random-weight checkpoints built with
transformers' config classes (tests/model_executor/hf_checkpoints.py: Gemma 2/3 with a window
of 8 shorter than the prompts and soft-capping active, GQA everywhere it exists, Qwen2-MoE's
shared expert), a batch of mixed prompt lengths under continuous batching with a 16-token step
budget (chunked prefill) and 4-token blocks. -O0 for every family; -O2 (Inductor, fusion
passes) for every family as slow tests. The level table's model facts (`is_moe`) are checked
on the same checkpoints.
"""
from __future__ import annotations

import pytest
import torch

try:
    from tests.model_executor.hf_checkpoints import lazy_checkpoints
except ImportError:  # tests/ itself on sys.path (plain `pytest`)
    from model_executor.hf_checkpoints import lazy_checkpoints

from vllm import LLM, SamplingParams

FAMILIES = ["gpt2", "opt", "gemma", "gemma2", "gemma3", "phi3", "qwen2_moe", "qwen3_moe"]
MOE = {"qwen2_moe", "qwen3_moe"}
VOCAB = 384
PROMPT_LENS = [5, 23, 41]
MAX_TOKENS = 12
LOGPROB_ATOL = 2e-3
ENGINE = {"max_model_len": 128, "max_num_batched_tokens": 16, "block_size": 4,
          "kv_cache_memory": "16MiB", "dtype": "float32"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return lazy_checkpoints(tmp_path_factory.mktemp("families"))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


_HF: dict[str, list[tuple[list[int], list[float]]]] = {}


@torch.inference_mode()
def hf_reference(path: str) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy continuation of every prompt (EOS suppressed by min_new_tokens)
    and each generated token's logprob from one forward over prompt + continuation."""
    if path not in _HF:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        results = []
        for ids in prompts():
            ids_t = torch.tensor([ids])
            out = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 pad_token_id=0)
            tokens = out[0, len(ids):].tolist()
            logits = model(out).logits[0, len(ids) - 1:-1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            results.append((tokens, [logprobs[i, t].item() for i, t in enumerate(tokens)]))
        _HF[path] = results
    return _HF[path]


def check_against_transformers(llm: LLM, path: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                            logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params,
                           use_tqdm=False)
    for i, (out, (want_tokens, want_logprobs)) in enumerate(zip(outputs, hf_reference(path))):
        completion = out.outputs[0]
        assert list(completion.token_ids) == want_tokens, \
            f"prompt {i} ({PROMPT_LENS[i]} tokens): greedy tokens differ"
        got = [step[token].logprob for step, token in zip(completion.logprobs, want_tokens)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want_logprobs),
                                   atol=LOGPROB_ATOL, rtol=0,
                                   msg=lambda m, i=i: f"prompt {i} logprobs: {m}")


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers_o0(checkpoints, family):
    path = checkpoints(family)
    llm = LLM(model=path, optimization_level=0, **ENGINE)
    try:
        model_config = llm.llm_engine.vllm_config.model_config
        assert model_config.is_moe == (family in MOE)
        assert not model_config.is_quantized
        check_against_transformers(llm, path)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers_o2(checkpoints, family, tmp_path):
    path = checkpoints(family)
    llm = LLM(model=path, optimization_level=2,
              compilation_config={"cache_dir": str(tmp_path / "compile_cache")}, **ENGINE)
    try:
        assert llm.llm_engine.vllm_config.compilation_config.mode == 3  # VLLM_COMPILE
        check_against_transformers(llm, path)
    finally:
        llm.llm_engine.shutdown()
