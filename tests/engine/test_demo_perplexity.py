"""The demo model's held-out perplexity computed through our engine (prompt logprobs) matches
the figure transformers gave (vllm/demo_model/eval.json) within 0.5%."""
from __future__ import annotations

import json
import math
import os

import pytest

from vllm import LLM, SamplingParams
from vllm.config.model import demo_model_path


@pytest.mark.parametrize("level", [0])
def test_demo_heldout_perplexity_matches_transformers(level):
    folder = demo_model_path()
    with open(os.path.join(folder, "eval.json")) as f:
        reference = json.load(f)
    with open(os.path.join(folder, reference["heldout_sample_file"]), encoding="utf-8") as f:
        text = f.read()
    llm = LLM(model="demo", optimization_level=level, dtype="float32",
              kv_cache_memory="64MiB", enable_prefix_caching=False)
    ids = llm.get_tokenizer()(text)["input_ids"]
    width = reference["context_length"]
    windows = [ids[i:i + width] for i in range(0, len(ids), width)]
    windows = [w for w in windows if len(w) >= 2]
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll, count = 0.0, 0
    for window, out in zip(windows, outs):
        assert out.prompt_logprobs[0] is None
        for pos in range(1, len(window)):
            nll -= out.prompt_logprobs[pos][window[pos]].logprob
            count += 1
    assert count == reference["heldout_sample_num_tokens_evaluated"]
    ours = math.exp(nll / count)
    expected = reference["heldout_sample_perplexity"]
    assert abs(ours - expected) / expected < 0.005, (ours, expected)
