"""Stop strings: the Aho-Corasick automaton against the old one-find-per-stop-string search,
and its cost, counted (never timed): per step it reads the new characters plus at most as
many failure links, whatever the number of stop strings."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.engine.output_processor import OutputProcessor, find_stop_string
from vllm.engine.sched_output import EngineCoreOutput
from vllm.engine.stop_matcher import (
    FEW_STOP_STRINGS,
    StopStringMatcher,
    find_stop_string_brute_force,
)
from vllm.sampling_params import (
    MAX_STOP_STRINGS,
    MAX_STOP_STRINGS_TOTAL_LENGTH,
    SamplingParams,
)

ALPHABET = "ab c\u00e9\U0001f600"
stop_strings = st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=8)
chunks = st.lists(st.tuples(st.text(ALPHABET, max_size=5), st.booleans()), max_size=25)


@settings(max_examples=400, deadline=None)
@given(stops=stop_strings, chunks=chunks)
def test_cursor_matches_brute_force_step_by_step(stops, chunks):
    """Text arrives in chunks; some steps skip the check (as before min_tokens) and the next
    check must still report only stops that end in its own new characters. Both search
    modes (the automaton, and str.find for a few stop strings) give the reference's answer."""
    cursors = [StopStringMatcher(stops, automaton=True).cursor(),
               StopStringMatcher(stops, automaton=False).cursor()]
    text = ""
    for new, check in chunks:
        text += new
        if not check:
            continue
        expected = find_stop_string_brute_force(text, len(new), stops)
        assert [c.find(text, len(new)) for c in cursors] == [expected] * 2, (text, new)
        if expected is not None:
            break


def test_search_mode_follows_the_number_of_stop_strings():
    assert not StopStringMatcher(["x"] * FEW_STOP_STRINGS).automaton
    assert StopStringMatcher(["x"] * (FEW_STOP_STRINGS + 1)).automaton


@settings(max_examples=300, deadline=None)
@given(stops=stop_strings, text=st.text(ALPHABET, max_size=30), new=st.integers(0, 30),
       include=st.booleans())
def test_find_stop_string_matches_brute_force(stops, text, new, include):
    new = min(new, len(text))
    expected = find_stop_string_brute_force(text, new, stops)
    got = find_stop_string(text, new, stops, include)
    if expected is None:
        assert got is None
    else:
        index, stop = expected
        assert got == (stop, index + len(stop) if include else index)


@pytest.mark.parametrize("automaton", [True, False])
def test_earliest_start_then_list_order(automaton):
    def matcher(stops):
        return StopStringMatcher(stops, automaton=automaton)

    assert matcher(["abc", "ab"]).cursor().find("xabc", 3) == (1, "abc")
    assert matcher(["ab", "abc"]).cursor().find("xabc", 3) == (1, "ab")
    # A later end can start earlier: "bcd" ends first but "abcde" starts first.
    assert matcher(["bcd", "abcde"]).cursor().find("abcde", 5) == (0, "abcde")
    # An occurrence that ended before the new characters hides nothing that ends in them.
    cursor = matcher(["abc", "bcd"]).cursor()
    assert cursor.find("abc", 0) is None  # read without reporting (a skipped check)
    assert cursor.find("abcd", 1) == (1, "bcd")


def _adversarial_stops(count: int) -> list[str]:
    """`count` stop strings sharing a prefix of "a"s that never complete on "aaaa...": the
    brute force scans a window per string per step; the automaton stays deep in its trie,
    following a failure link per character."""
    length = MAX_STOP_STRINGS_TOTAL_LENGTH // MAX_STOP_STRINGS
    return ["a" * (length - 1) + chr(0x100 + i) for i in range(count)]


def _random_stops(count: int, rng: random.Random) -> list[str]:
    length = MAX_STOP_STRINGS_TOTAL_LENGTH // MAX_STOP_STRINGS
    return ["".join(rng.choice("ab ") for _ in range(rng.randint(length // 2, length)))
            for _ in range(count)]


def test_work_per_character_does_not_grow_with_the_number_of_stop_strings():
    """Characters fed to the automaton plus occurrences it reported: at most 2 per character
    for the maximum number of stop strings, no more than a single stop string's str.find
    windows (the old search examined new + longest - 1 characters per stop string per step,
    ~20000 per step here)."""
    rng = random.Random(0)
    text = "a" * 3000 + "".join(rng.choice("ab ") for _ in range(3000))
    for make in (_adversarial_stops, lambda n: _random_stops(n, rng)):
        work = {}
        for count in (1, MAX_STOP_STRINGS):
            stops = make(count)
            cursor = StopStringMatcher(stops).cursor()
            chars = 0
            for end in range(4, len(text) + 1, 4):  # 4 new characters a step
                if cursor.find(text[:end], 4) is not None:
                    break
                chars = end
            assert chars > 1000
            work[count] = cursor.work / chars
            if count == MAX_STOP_STRINGS:
                assert cursor.work <= 2 * chars + 4, (cursor.work, chars)
        assert work[MAX_STOP_STRINGS] <= 2 * work[1], work


# ---- through the OutputProcessor -------------------------------------------------------------
class CharTokenizer:
    """Token id = code point; decoding joins the characters."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


class CountingList(list):
    """A stop list that counts how often it is read whole."""

    reads = 0

    def __iter__(self):
        CountingList.reads += 1
        return super().__iter__()

    def __len__(self):
        CountingList.reads += 1
        return super().__len__()


def _run(proc, ids, tokens, per_step=1):
    """Feed `tokens` to the sequences `ids`, `per_step` at a time; the last outputs."""
    outs = None
    for start in range(0, len(tokens), per_step):
        step = tokens[start:start + per_step]
        outs, stopped = proc.process_outputs(
            [EngineCoreOutput(request_id=i, new_token_ids=step) for i in ids])
        if stopped:
            return outs, stopped
    return outs, []


def test_processor_step_cost_is_independent_of_the_number_of_stop_strings():
    """A request with n=4 sequences and the maximum number of stop strings: its sequences
    share one automaton, each step reads only the new characters (work per character as with
    one stop string), and no step walks the stop list (the hold-back is computed once)."""
    text = [ord(c) for c in "a" * 2000 + "b"]
    work = {}
    for count in (1, MAX_STOP_STRINGS):
        stops = _adversarial_stops(count - 1) + ["ab"]
        params = SamplingParams(n=4, stop=stops, max_tokens=None)
        children = [params.clone() for _ in range(4)]
        proc = OutputProcessor(CharTokenizer())
        ids = [f"{i}_r" for i in range(4)]
        proc.add_request("r", None, [1], params, ids, children)
        seqs = [proc._seq_to_request[i][1] for i in ids]
        assert len({id(s.stop_cursor.matcher) for s in seqs}) == 1
        for child in children:
            child.stop = CountingList(child.stop)
        CountingList.reads = 0
        outs, stopped = _run(proc, ids, text)
        assert CountingList.reads == 0
        assert stopped == ids
        assert [c.text for c in outs[0].outputs] == ["a" * 1999] * 4
        assert all(c.stop_reason == "ab" for c in outs[0].outputs)
        work[count] = sum(s.stop_cursor.work for s in seqs)
        assert work[count] <= 4 * 2 * len(text)
    assert work[MAX_STOP_STRINGS] <= 2 * work[1], work


def test_min_tokens_then_stop_in_new_text_only():
    """Stops before min_tokens are ignored; afterwards only an occurrence that ends in a
    step's new characters stops (the old "xy" is not reported late)."""
    params = SamplingParams(stop=["xy", "zz"], min_tokens=5, max_tokens=None)
    proc = OutputProcessor(CharTokenizer())
    proc.add_request("r", None, [1], params, ["r"], [params])
    outs, stopped = _run(proc, ["r"], [ord(c) for c in "xyab" + "cdzz" + "ef"], per_step=4)
    assert stopped == ["r"]
    assert outs[0].outputs[0].text == "xyabcd" and outs[0].outputs[0].stop_reason == "zz"


def test_stop_across_steps_with_include_and_hold_back():
    params = SamplingParams(stop=["needle"], include_stop_str_in_output=True,
                            max_tokens=None)
    proc = OutputProcessor(CharTokenizer())
    proc.add_request("r", None, [1], params, ["r"], [params])
    outs, stopped = _run(proc, ["r"], [ord(c) for c in "hay needle rest"], per_step=3)
    assert stopped == ["r"] and outs[0].outputs[0].text == "hay needle"
    held = SamplingParams(stop=["needle"], max_tokens=None)
    proc = OutputProcessor(CharTokenizer())
    proc.add_request("h", None, [1], held, ["h"], [held])
    seen = [proc.process_outputs([EngineCoreOutput(request_id="h", new_token_ids=[ord(c)])])
            [0][0].outputs[0].text for c in "hay need"]
    assert seen[-1] == "hay"  # "hay need"[:-5]: a partial "needle" is never shown
