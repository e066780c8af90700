"""OutputProcessor: incremental detokenisation, stop strings (and their hold-back), n fan-in,
logprob dicts."""
from __future__ import annotations

import pytest

from vllm.engine.output_processor import (
    IncrementalDetokenizer,
    OutputProcessor,
    find_stop_string,
    list_decoder,
)
from vllm.engine.sched_output import EngineCoreOutput, LogprobsLists
from vllm.sampling_params import RequestOutputKind, SamplingParams


def test_incremental_matches_full_decode(tokenizer):
    text = "Paged attention stores keys and values in blocks. Hello world! 42 + 7 = 49 ü€😀"
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("Say:")
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    pieces = [detok.update(t) for t in ids]
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids)
    # Multi-byte characters are held back until complete, never emitted half-done.
    assert all("\ufffd" not in p for p in pieces)


def _wordpiece_tokenizer():
    """A WordPiece tokenizer whose decode cleans up spaces before punctuation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[SEP]": 1, "hello": 2, ",": 3, "world": 4, ".": 5, "##s": 6}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)


def test_list_decoder_gives_decode_s_text_without_its_id_conversion(tokenizer, monkeypatch):
    """The detokenizer decodes lists of ints through the tokenizer's `_decode` where `decode`
    is transformers' own: the same text (special tokens skipped or not, a WordPiece
    tokenizer's clean-up of spaces), and `decode`'s per-id conversion (to_py_obj) never runs;
    a tokenizer that overrides `decode`, or one from elsewhere, keeps its `decode`."""
    import transformers.tokenization_utils_base as tub

    wordpiece = _wordpiece_tokenizer()
    cases = [(tokenizer, tokenizer.encode("Hello world! ü€") + [tokenizer.eos_token_id]),
             (wordpiece, [2, 3, 4, 6, 5, 1])]
    for tok, ids in cases:
        assert list_decoder(tok) == tok._decode
        for skip in (True, False):
            assert list_decoder(tok)(ids, skip_special_tokens=skip) == tok.decode(
                ids, skip_special_tokens=skip)
    assert list_decoder(wordpiece)([2, 3, 4, 5]) == "hello, world."  # cleaned up

    def no_conversion(obj):
        raise AssertionError("decode's id conversion ran")

    monkeypatch.setattr(tub, "to_py_obj", no_conversion)
    ids = tokenizer.encode(" quick brown fox")
    detok = IncrementalDetokenizer(tokenizer, [5], skip_special_tokens=True)
    assert "".join(detok.update(t) for t in ids) + detok.flush() == " quick brown fox"

    class OwnDecode:
        def decode(self, ids, skip_special_tokens=False):
            return "own"

    own = OwnDecode()
    assert list_decoder(own) == own.decode
    monkeypatch.setattr(type(tokenizer), "decode", lambda self, ids, **kw: "overridden")
    assert list_decoder(tokenizer)([1, 2]) == "overridden"


def test_find_stop_string():
    assert find_stop_string("hello world", 5, ["wor", "o"], False) == ("wor", 6)
    assert find_stop_string("hello world", 3, ["o w"], True) is None  # completed earlier
    assert find_stop_string("hello world", 5, ["o w"], True) == ("o w", 7)
    assert find_stop_string("abcabc", 1, ["b"], False) is None


def _step(req_id, tokens, finish=None, **kw):
    return EngineCoreOutput(request_id=req_id, new_token_ids=tokens, finish_reason=finish, **kw)


def test_stop_string_truncates_and_holds_back(tokenizer):
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.encode(" quick brown fox jumps")
    params = SamplingParams(stop=["fox"])
    proc.add_request("r", "p", [5], params, ["r"], [params])
    seen = []
    for token in ids:
        outs, stopped = proc.process_outputs([_step("r", [token])])
        seen.append(outs[0].outputs[0].text)
        if stopped:
            break
    assert stopped == ["r"]
    final = outs[0]
    assert final.finished and final.outputs[0].text == " quick brown "
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "fox"
    # No intermediate text ever showed a partial "fox".
    assert all("f" not in text.replace(" quick brown ", "") for text in seen)
    assert not proc.has_unfinished_requests()


def test_n_fan_in_and_logprobs(tokenizer):
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, logprobs=1)
    proc.add_request("r", None, [5, 6], params, ["0_r", "1_r"], [params, params])
    lp = LogprobsLists([7, 9], [-0.5, -0.1], [2, 1])
    outs, _ = proc.process_outputs([_step("0_r", [7], new_logprobs=[lp])])
    assert not outs[0].finished and len(outs[0].outputs) == 2
    outs, _ = proc.process_outputs([_step("1_r", [9], "length", new_logprobs=[lp]),
                                    _step("0_r", [9], "length", new_logprobs=[lp])])
    out = outs[0]
    assert out.finished and [c.index for c in out.outputs] == [0, 1]
    first = out.outputs[0]
    assert first.token_ids == [7, 9] and first.cumulative_logprob == -1.0
    assert first.logprobs[0][7].rank == 2 and first.logprobs[0][9].logprob == -0.1
    assert first.logprobs[0][7].decoded_token == tokenizer.decode([7])


def test_abort_returns_unfinished_internal_ids(tokenizer):
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(n=2)
    proc.add_request("r", None, [5], params, ["0_r", "1_r"], [params, params])
    proc.process_outputs([_step("0_r", [7], "length")])
    assert proc.abort_requests(["r", "unknown"]) == ["1_r"]
    assert not proc.has_unfinished_requests()


def test_output_kinds(tokenizer):
    """CUMULATIVE: everything so far at every step; DELTA: only what each step added (text,
    tokens, logprobs; the prompt logprobs once), with held-back stop-string text released
    later; FINAL_ONLY: one output, when finished."""
    ids = tokenizer.encode(" quick brown fox jumps over")
    lp = LogprobsLists([0], [-0.5], [1])

    def run(kind, **kw):
        proc = OutputProcessor(tokenizer)
        params = SamplingParams(output_kind=kind, logprobs=0, prompt_logprobs=0, **kw)
        proc.add_request("r", "p", [5, 6], params, ["r"], [params])
        outs = []
        for i, token in enumerate(ids):
            finish = "length" if i == len(ids) - 1 else None
            step = _step("r", [token], finish, new_logprobs=[LogprobsLists([token], [-0.5],
                                                                           [1])])
            if i == 0:
                step.new_prompt_logprobs = [lp]
            got, stopped = proc.process_outputs([step])
            outs += got
            if stopped:
                break
        return outs

    cumulative = run(RequestOutputKind.CUMULATIVE)
    assert len(cumulative) == len(ids) and cumulative[-1].outputs[0].token_ids == ids
    full_text = cumulative[-1].outputs[0].text
    assert full_text == tokenizer.decode(ids)

    delta = run(RequestOutputKind.DELTA)
    assert len(delta) == len(ids)
    assert [o.outputs[0].token_ids for o in delta] == [[t] for t in ids]
    assert "".join(o.outputs[0].text for o in delta) == full_text
    assert [len(o.outputs[0].logprobs) for o in delta] == [1] * len(ids)
    assert delta[0].prompt_logprobs is not None
    assert all(o.prompt_logprobs is None for o in delta[1:])
    assert [o.finished for o in delta] == [False] * (len(ids) - 1) + [True]
    # With a stop string the held-back characters come later, never twice or lost.
    delta = run(RequestOutputKind.DELTA, stop=["jumps"])
    assert "".join(o.outputs[0].text for o in delta) == " quick brown fox "
    assert delta[-1].finished and delta[-1].outputs[0].stop_reason == "jumps"

    final = run(RequestOutputKind.FINAL_ONLY)
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == ids and final[0].outputs[0].text == full_text


def test_output_kind_is_validated():
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind.*got 7"):
        SamplingParams(output_kind=7)
