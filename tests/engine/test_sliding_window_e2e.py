"""Sliding-window models end to end: greedy tokens from LLM.generate are transformers' own
(`generate`, eager attention) on tiny random-weight checkpoints whose window (8) is much
shorter than the prompts and outputs: Mistral and Mixtral (every layer windowed), Qwen2 and
Qwen3 with `use_sliding_window` and mixed layer types, under chunked prefill (a 16-token step
budget, so long prompts are split into chunks that attend over cached context), prefix caching
(a second round of prompts sharing cached blocks) and 4-token blocks (the window spans several
blocks, the context many more). -O0 for every model, -O2 (Inductor) for Mistral.
"""
from __future__ import annotations

import logging

import pytest
import torch

try:
    from tests.model_executor.hf_checkpoints import MAKERS, lazy_checkpoints
except ImportError:  # tests/ itself on sys.path (plain `pytest`)
    from model_executor.hf_checkpoints import MAKERS, lazy_checkpoints

from vllm import LLM, SamplingParams

WINDOW = 8
VOCAB = 384
# Prompt lengths: shorter than the window, a few windows, and long prompts that the 16-token
# budget splits into several chunks; the last two share a 40-token prefix with the third.
PROMPT_LENS = [5, 23, 70, 41]
MAX_TOKENS = 20
ENGINE = {"max_model_len": 256, "max_num_batched_tokens": 16, "block_size": 4,
          "enable_prefix_caching": True, "kv_cache_memory": "16MiB"}
# arch -> checkpoint overrides: Mistral/Mixtral window every layer; Qwen2/Qwen3 only with
# use_sliding_window, on the layers from max_window_layers on (layer_types derived from it by
# transformers: ["full_attention", "sliding_attention"]).
MODELS = {
    "mistral": {"sliding_window": WINDOW},
    "mixtral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen3": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
}
EXPECTED_WINDOWS = {"mistral": [WINDOW, WINDOW], "mixtral": [WINDOW, WINDOW],
                    "qwen2": [None, WINDOW], "qwen3": [None, WINDOW]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return lazy_checkpoints(tmp_path_factory.mktemp("sliding"), MODELS)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    first = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    # Sharing the long prompt's first 40 tokens (10 blocks of 4): prefix-cache hits.
    shared = [first[2][:40] + torch.randint(3, VOCAB, (n,), generator=g).tolist()
              for n in (3, 17)]
    return first + shared


_HF: dict[tuple[str, bool], list[list[int]]] = {}


@torch.inference_mode()
def hf_greedy(path: str, windowed: bool = True) -> list[list[int]]:
    """transformers' greedy continuations (EOS suppressed) of every prompt; with
    windowed=False the same weights with full attention (sliding_window=None)."""
    key = (path, windowed)
    if key not in _HF:
        from transformers import AutoModelForCausalLM

        kwargs = {}
        if not windowed:
            kwargs["sliding_window"] = None
            if "qwen" in path.rsplit("/", 1)[-1]:  # transformers: every layer's type saved
                kwargs["layer_types"] = ["full_attention"] * 2
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation="eager",
                                                     **kwargs).eval()
        if windowed:
            assert model.config.sliding_window == WINDOW
        results = []
        for ids in prompts():
            ids_t = torch.tensor([ids])
            out = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 pad_token_id=0)
            results.append(out[0, len(ids):].tolist())
        _HF[key] = results
    return _HF[key]


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    batch = prompts()
    # The first four prompts together, then the two that share the third one's cached prefix.
    first = llm.generate([{"prompt_token_ids": p} for p in batch[:4]], params, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": p} for p in batch[4:]], params,
                          use_tqdm=False)
    assert all(out.num_cached_tokens >= 36 for out in second), \
        [out.num_cached_tokens for out in second]
    return [out.outputs[0].token_ids for out in first + second]


def check(llm: LLM, path: str, arch: str) -> None:
    windows = [layer.sliding_window
               for layer in llm.llm_engine.executor.model.attention_layers.values()]
    assert windows == EXPECTED_WINDOWS[arch]
    ours, reference = generate(llm), hf_greedy(path)
    for i, (got, want) in enumerate(zip(ours, reference)):
        assert got == want, f"prompt {i} ({len(prompts()[i])} tokens)"


@pytest.mark.parametrize("arch", list(MODELS))
def test_sliding_window_greedy_matches_transformers_o0(checkpoints, arch, caplog):
    path = checkpoints(arch)
    # Not vacuous: the window changes transformers' own tokens on these prompts.
    assert hf_greedy(path) != hf_greedy(path, windowed=False)
    with caplog.at_level(logging.INFO, logger="vllm"):
        llm = LLM(model=path, optimization_level=0, **ENGINE)
    sliding = EXPECTED_WINDOWS[arch].count(WINDOW)
    assert f"Sliding-window attention: window {WINDOW} on {sliding} of 2 layers" in caplog.text
    assert "not implemented" not in caplog.text
    check(llm, path, arch)
    llm.llm_engine.shutdown()


@pytest.mark.slow
def test_sliding_window_greedy_matches_transformers_o2(checkpoints, tmp_path):
    path = checkpoints("mistral")
    llm = LLM(model=path, optimization_level=2,
              compilation_config={"cache_dir": str(tmp_path / "compile_cache")}, **ENGINE)
    check(llm, path, "mistral")
    llm.llm_engine.shutdown()


def test_no_window_unless_qwen_use_sliding_window(checkpoints, tmp_path):
    """Qwen2 with a sliding_window but use_sliding_window=False: full attention everywhere
    (transformers drops the window); Llama-class models without one: none."""
    path = MAKERS["qwen2"](tmp_path / "qwen2-off", tokenizer=False, sliding_window=WINDOW,
                           use_sliding_window=False, max_window_layers=0)
    from vllm.config import ModelConfig, VllmConfig
    from vllm.model_executor.model_loader import get_model

    model = get_model(VllmConfig(model_config=ModelConfig(model=path, dtype="float32"),
                                 optimization_level=0))
    assert [layer.sliding_window for layer in model.attention_layers.values()] == [None, None]


@pytest.mark.parametrize("window", [-4, 0])
def test_bad_config_window_is_an_error_naming_it(tmp_path, window):
    import json
    import os

    path = MAKERS["mistral"](tmp_path / "bad", tokenizer=False)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["sliding_window"] = window
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    from vllm.config import ModelConfig, VllmConfig
    from vllm.model_executor.model_loader import get_model

    with pytest.raises(ValueError, match=f"sliding_window must be .*got {window}"):
        get_model(VllmConfig(model_config=ModelConfig(model=path, dtype="float32"),
                             optimization_level=0))
