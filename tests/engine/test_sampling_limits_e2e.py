"""Through the real engine: values at the edges of SamplingParams' ranges run (int64 top_k
and seeds reach tensors and torch generators), values past them never reach the engine, and
a request with the maximum number of stop strings and bad words gives the same output as one
with only the strings that matter, its n sequences sharing one automaton."""
from __future__ import annotations

import pytest
from engine_test_utils import PROMPTS

from vllm import SamplingParams
from vllm.sampling_params import INT64_MAX, INT64_MIN, MAX_BAD_WORDS, MAX_STOP_STRINGS


def _texts(llm, params):
    return [c.text for c in llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs]


def _tokens(llm, params):
    return [c.token_ids for c in llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs]


def test_int64_edges_run_and_what_is_past_them_is_refused(llm):
    """top_k = 2**63 - 1 means "every token" (the same tokens as top_k off, same seed);
    2**63 is refused before the engine (it used to kill the engine loop with "Overflow when
    unpacking long long"), and the engine still serves afterwards."""
    base = {"temperature": 1.0, "max_tokens": 6, "seed": 7}
    assert _tokens(llm, SamplingParams(top_k=INT64_MAX, **base)) == \
        _tokens(llm, SamplingParams(**base))
    with pytest.raises(ValueError, match="^top_k"):
        SamplingParams(top_k=INT64_MAX + 1, **base)
    # Seeds at both ends, with n children seeded seed + i.
    for seed in (INT64_MAX, INT64_MIN):
        params = SamplingParams(temperature=1.0, max_tokens=4, n=3, seed=seed)
        assert _tokens(llm, params) == _tokens(llm, params)
    for value in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="^temperature"):
            SamplingParams(temperature=value)
        with pytest.raises(ValueError, match="^logit_bias"):
            SamplingParams(logit_bias={5: value})
    assert _tokens(llm, SamplingParams(temperature=0, max_tokens=4))


def test_max_stop_strings_give_the_same_output_and_share_one_automaton(llm):
    reference = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12,
                                                        min_tokens=12),
                             use_tqdm=False)[0].outputs[0].text
    stop = reference[len(reference) // 2:len(reference) // 2 + 3]
    assert stop.strip(), reference
    few = SamplingParams(temperature=0, max_tokens=12, n=3, stop=[stop])
    # Stop strings that never occur (characters a tokenizer's output cannot contain here).
    fillers = [f"\u2603{i}\u2603" for i in range(MAX_STOP_STRINGS - 1)]
    many = SamplingParams(temperature=0, max_tokens=12, n=3, stop=fillers + [stop])
    assert _texts(llm, many) == _texts(llm, few)
    assert all(text == reference[:reference.index(stop)] for text in _texts(llm, many))

    engine = llm.llm_engine
    engine.add_request("shared-automaton", PROMPTS[1], many)
    state = engine.output_processor.requests["shared-automaton"]
    matchers = {id(seq.stop_cursor.matcher) for seq in state.sequences}
    assert len(state.sequences) == 3 and len(matchers) == 1
    assert state.sequences[0].stop_cursor.matcher.automaton
    engine.abort_request("shared-automaton")
    while engine.has_unfinished_requests():
        engine.step()


def test_max_bad_words_give_the_same_output_as_the_words_that_matter(llm, tokenizer):
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    ref = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    word = next(w for t in ref if (w := tokenizer.decode([t])).strip()
                and tokenizer.encode(w, add_special_tokens=False) == [t])
    fillers = [f"\u2603{i}" for i in range(MAX_BAD_WORDS - 1)]

    def run(words):
        p = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, bad_words=words)
        return llm.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0].token_ids

    few, many = run([word]), run(fillers + [word])
    assert few == many and few != ref
