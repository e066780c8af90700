"""SamplingParams validation and derived fields."""
from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm import SamplingParams
from vllm.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_ABS_LOGIT_BIAS,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_LENGTH,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_TOTAL_LENGTH,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_STRINGS,
    MAX_STOP_STRINGS_TOTAL_LENGTH,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    SamplingType,
)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"logprobs": -2}, "logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": 1.5}, "seed"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    sp = SamplingParams()
    assert sp.max_tokens == 16 and sp.n == 1 and sp.temperature == 1.0 and sp.top_k == 0
    assert sp.skip_special_tokens and sp.detokenize and sp.stop == []
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(top_k=-1).top_k == 0
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=3)
    assert greedy.sampling_type == SamplingType.GREEDY and greedy.top_k == 0
    assert SamplingParams(seed=1).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams().sampling_type == SamplingType.RANDOM
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_eos_and_stop_ids():
    sp = SamplingParams(stop_token_ids=[5])
    sp.update_from_eos({2})
    assert sp.all_stop_token_ids == {2, 5} and sp.eos_token_ids == {2}
    sp = SamplingParams(stop_token_ids=[5], ignore_eos=True)
    sp.update_from_eos({2})
    assert sp.all_stop_token_ids == {5}


def test_stop_string_hold_back():
    assert SamplingParams(stop=["ab", "xyz"]).output_text_buffer_length == 2
    assert SamplingParams(stop=["xyz"], include_stop_str_in_output=True) \
        .output_text_buffer_length == 0



# ---- range checks: every numeric field, at the boundary -----------------------------------
NOT_FINITE = [float("inf"), float("-inf"), float("nan")]


def _field_of(exc: pytest.ExceptionInfo) -> str:
    """The parameter the OpenAI server names in its 400 (the message's first word)."""
    return str(exc.value).split(" ", 1)[0]


@pytest.mark.parametrize("field, values", [
    ("n", [0, 2**63, MAX_N + 1, True, 1.0, "2", float("nan")]),
    ("top_k", [-2, 2**63, 10**400, True, 5.0, "5"]),
    ("seed", [2**63, -(2**63) - 1, 10**400, True, 1.5, "1", float("inf")]),
    ("max_tokens", [0, 2**63, 10**400, True, 16.0]),
    ("min_tokens", [-1, 2**63, 10**400, True, 1.0]),
    ("logprobs", [-2, 2**63, 10**400, True, 1.5]),
    ("prompt_logprobs", [-2, 2**63, True]),
    ("truncate_prompt_tokens", [0, -2, 2**63, True]),
    ("temperature", [-0.1, MAX_TEMPERATURE * 10, True, "0.5", None, 10**400, *NOT_FINITE]),
    ("top_p", [0.0, 1.5, True, *NOT_FINITE]),
    ("min_p", [-0.1, 1.5, True, *NOT_FINITE]),
    ("presence_penalty", [3.0, -3, True, *NOT_FINITE]),
    ("frequency_penalty", [3.0, -3, True, *NOT_FINITE]),
    ("repetition_penalty", [0.0, -1.0, 1e-300, MAX_REPETITION_PENALTY * 10, True,
                            *NOT_FINITE]),
])
def test_every_numeric_field_is_range_checked(field, values):
    """Huge ints (which used to reach an int64 tensor and kill the engine), inf, NaN, bools
    and strings are refused with a message that starts with the field's name."""
    for value in values:
        with pytest.raises(ValueError) as exc:
            SamplingParams(**{field: value})
        assert _field_of(exc) == field, (value, str(exc.value))
        assert "must be" in str(exc.value)


def test_int64_edges_are_accepted_and_normalised():
    sp = SamplingParams(top_k=INT64_MAX, seed=INT64_MIN, max_tokens=INT64_MAX,
                        min_tokens=INT64_MAX, logprobs=-1, n=MAX_N)
    assert sp.top_k == INT64_MAX and sp.seed == INT64_MIN
    assert SamplingParams(seed=INT64_MAX).seed == INT64_MAX
    np = pytest.importorskip("numpy")
    sp = SamplingParams(top_k=np.int64(5), temperature=np.float32(0.5), n=np.int32(2))
    assert type(sp.top_k) is int and type(sp.n) is int and type(sp.temperature) is float
    assert sp.temperature == 0.5 and sp.top_k == 5


def test_number_subclasses_cannot_fool_the_checks():
    """A float subclass that answers every comparison with True passes `x >= 0` but not the
    check, which compares the plain float; accepted values are stored as plain numbers."""

    class Liar(float):
        def __ge__(self, other):
            return True

        __le__ = __gt__ = __lt__ = __ge__

    with pytest.raises(ValueError, match="^temperature"):
        SamplingParams(temperature=Liar("inf"))
    with pytest.raises(ValueError, match="^temperature"):
        SamplingParams(temperature=Liar("nan"))
    sp = SamplingParams(temperature=Liar(0.5), top_p=Liar(0.9))
    assert type(sp.temperature) is float and type(sp.top_p) is float

    class Big(int):
        pass

    with pytest.raises(ValueError, match="^top_k"):
        SamplingParams(top_k=Big(2**63))
    assert type(SamplingParams(top_k=Big(7)).top_k) is int


def test_temperature_inf_and_nan_are_errors_not_gibberish():
    for value in NOT_FINITE:
        with pytest.raises(ValueError, match=r"^temperature must be a finite number"):
            SamplingParams(temperature=value)
    assert SamplingParams(temperature=MAX_TEMPERATURE).temperature == MAX_TEMPERATURE


@pytest.mark.parametrize("bias", [
    {1: float("nan")}, {1: float("inf")}, {1: -float("inf")}, {1: True}, {1: "1"},
    {1: 10**400}, {1: MAX_ABS_LOGIT_BIAS * 2}, {True: 1.0}, {-1: 1.0}, {2**63: 1.0},
    {"9" * 5000: 1.0}, {"\u00b2": 1.0}, {"x": 1.0}, {1.0: 1.0}, [1, 2],
])
def test_logit_bias_keys_and_values_are_checked(bias):
    with pytest.raises(ValueError) as exc:
        SamplingParams(logit_bias=bias)
    assert _field_of(exc) == "logit_bias"
    assert len(str(exc.value)) < 400  # the 5000-digit key is not echoed


def test_logit_bias_is_normalised():
    class F(float):
        pass

    sp = SamplingParams(logit_bias={"42": F(-100), " 7": 3, 9: -MAX_ABS_LOGIT_BIAS})
    assert sp.logit_bias == {42: -100.0, 7: 3.0, 9: -MAX_ABS_LOGIT_BIAS}
    assert all(type(k) is int and type(v) is float for k, v in sp.logit_bias.items())


@pytest.mark.parametrize("field, value", [
    ("stop_token_ids", [1, 2**63]), ("stop_token_ids", [True]), ("stop_token_ids", 5),
    ("allowed_token_ids", [2**64]), ("allowed_token_ids", [-1]), ("allowed_token_ids", []),
    ("allowed_token_ids", [1.0]), ("stop", 5), ("stop", [None]), ("bad_words", [1]),
    ("bad_words", 5),
])
def test_token_lists_and_strings_are_checked(field, value):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})
    assert _field_of(exc) == field


# ---- size limits -----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field, accepted", [
    ({"stop": ["s%d" % i for i in range(MAX_STOP_STRINGS + 1)]}, "stop",
     {"stop": ["s%d" % i for i in range(MAX_STOP_STRINGS)]}),
    ({"stop": ["x" * (MAX_STOP_STRING_LENGTH + 1)]}, "stop",
     {"stop": ["x" * MAX_STOP_STRING_LENGTH]}),
    ({"stop": ["x" * MAX_STOP_STRING_LENGTH] * (MAX_STOP_STRINGS_TOTAL_LENGTH
                                                // MAX_STOP_STRING_LENGTH + 1)}, "stop",
     {"stop": ["x" * MAX_STOP_STRING_LENGTH] * (MAX_STOP_STRINGS_TOTAL_LENGTH
                                                // MAX_STOP_STRING_LENGTH)}),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids",
     {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))}),
    ({"bad_words": ["w%d" % i for i in range(MAX_BAD_WORDS + 1)]}, "bad_words",
     {"bad_words": ["w%d" % i for i in range(MAX_BAD_WORDS)]}),
    ({"bad_words": ["w" * (MAX_BAD_WORD_LENGTH + 1)]}, "bad_words",
     {"bad_words": ["w" * MAX_BAD_WORD_LENGTH]}),
    ({"bad_words": ["w" * MAX_BAD_WORD_LENGTH] * (MAX_BAD_WORDS_TOTAL_LENGTH
                                                  // MAX_BAD_WORD_LENGTH + 1)}, "bad_words",
     {"bad_words": ["w" * MAX_BAD_WORD_LENGTH] * (MAX_BAD_WORDS_TOTAL_LENGTH
                                                  // MAX_BAD_WORD_LENGTH)}),
    ({"allowed_token_ids": [0] * (MAX_ALLOWED_TOKEN_IDS + 1)}, "allowed_token_ids",
     {"allowed_token_ids": [0] * MAX_ALLOWED_TOKEN_IDS}),
    ({"logit_bias": dict.fromkeys(range(MAX_LOGIT_BIAS_ENTRIES + 1), 1.0)}, "logit_bias",
     {"logit_bias": dict.fromkeys(range(MAX_LOGIT_BIAS_ENTRIES), 1.0)}),
])
def test_size_limits(kwargs, field, accepted):
    """One past each limit is refused (naming the field and the limit, without echoing the
    list); the limit itself is accepted."""
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert _field_of(exc) == field
    assert "at most" in str(exc.value) and len(str(exc.value)) < 300
    SamplingParams(**accepted)


# ---- derived state: clones share it, pickles leave it out ------------------------------------
class _WordTokenizer:
    """encode(): one token per character (ord), so words share prefixes predictably."""

    def __init__(self):
        self.calls = 0

    def encode(self, text, add_special_tokens=False):
        self.calls += 1
        return [ord(c) for c in text]


def test_clone_shares_derived_state_and_copies_containers():
    sp = SamplingParams(n=3, stop=["ab", "cd"], bad_words=["xy"], logit_bias={1: 1.0},
                        stop_token_ids=[5], allowed_token_ids=[1, 2])
    sp.update_from_tokenizer(_WordTokenizer())
    child = sp.clone()
    assert child == sp
    assert child._stop_matcher is sp._stop_matcher is not None
    assert child._bad_words_index is sp._bad_words_index is not None
    for name in ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words"):
        assert getattr(child, name) is not getattr(sp, name), name
    child.stop.append("zz")
    assert sp.stop == ["ab", "cd"]
    # A changed stop list gets its own automaton, never a stale one.
    assert child.stop_matcher().stops == ("ab", "cd", "zz")
    assert sp.stop_matcher().stops == ("ab", "cd")


def test_pickle_leaves_derived_caches_out_and_they_are_rebuilt():
    sp = SamplingParams(stop=["ab"], bad_words=["xy"])
    sp.update_from_tokenizer(_WordTokenizer())
    sp.stop_matcher()
    back = pickle.loads(pickle.dumps(sp))
    assert back._stop_matcher is None and back._bad_words_index is None
    assert back.banned_by_bad_words([ord("x")]) == sp.banned_by_bad_words([ord("x")]) \
        == {ord("y")}
    assert back.stop_matcher().stops == ("ab",)


# ---- bad words: batch tokenization and the prefix index ---------------------------------------
def test_bad_words_tokenized_in_one_batch(tokenizer):
    """A transformers tokenizer gets one batch call; the ids equal per-text encode()."""
    words = ["hello", " world", "paged attention", "ü€😀"]
    calls = []

    class Counting:
        def __call__(self, texts, **kwargs):
            calls.append(len(texts))
            return tokenizer(texts, **kwargs)

    batched = SamplingParams(bad_words=words)
    batched.update_from_tokenizer(Counting())
    single = SamplingParams(bad_words=words)
    single.update_from_tokenizer(type("T", (), {"encode": staticmethod(tokenizer.encode)})())
    assert calls == [2 * len(words)]
    assert batched._bad_words_token_ids == single._bad_words_token_ids
    assert batched._bad_words_token_ids  # non-trivial


def _old_banned_by_bad_words(sequences, output_token_ids):
    """The loop over every word that banned_by_bad_words replaced (the reference)."""
    banned = set()
    for seq in sequences:
        prefix = seq[:-1]
        if not prefix or output_token_ids[-len(prefix):] == prefix:
            banned.add(seq[-1])
    return banned


@settings(max_examples=300, deadline=None)
@given(words=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=5), min_size=1,
                      max_size=12),
       prompt=st.lists(st.integers(0, 4), max_size=4),
       output=st.lists(st.integers(0, 4), max_size=10))
def test_bad_words_index_matches_the_old_loop(words, prompt, output):
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return words[int(text.strip())] if text.strip() else []

    sp = SamplingParams(bad_words=[str(i) for i in range(len(words))])
    sp.update_from_tokenizer(Tok())
    expected = _old_banned_by_bad_words(sp._bad_words_token_ids, output)
    assert sp.banned_by_bad_words(output) == expected
    # The runner passes the whole sequence and the prompt length: prompt tokens never count.
    assert sp.banned_by_bad_words(prompt + output, len(prompt)) == expected


def test_bad_words_step_cost_does_not_grow_with_the_number_of_words():
    """The index walk visits at most one node per output token it matches backwards: with
    MAX_BAD_WORDS two-token words, a step looks at one or two dict entries, not 2048."""
    sp = SamplingParams(bad_words=["a" + chr(0x100 + i) for i in range(MAX_BAD_WORDS)])
    sp.update_from_tokenizer(_WordTokenizer())
    root = sp._bad_words_index
    # Every prefix ("a", and " a" for the leading-space variant) ends in "a": one child.
    assert list(root.children) == [ord("a")] and not root.banned
    assert len(sp.banned_by_bad_words([ord("a")])) == MAX_BAD_WORDS
    assert sp.banned_by_bad_words([ord("b")]) == set()
