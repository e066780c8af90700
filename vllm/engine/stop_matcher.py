"""Stop-string matching in O(new characters) per step, whatever the number of stop strings.

`StopStringMatcher` holds one request's stop strings: built once per request (its n
sequences share it; it is read-only after construction). Each sequence walks it with its own
`StopStringCursor`:

- with a few stop strings (at most FEW_STOP_STRINGS, the common case), one `str.find` per stop
  string over the window that can hold an occurrence ending in the new characters (new +
  longest - 1): a C scan each, cheaper than a per-character automaton step in Python;
- with more, an Aho-Corasick automaton whose state the cursor keeps between steps, so a step
  reads only the new characters (plus, after steps whose check was skipped, at most the
  longest stop string's length of earlier ones). Per state it knows the longest stop string
  ending there, which is the earliest-starting occurrence ending at that character. The
  failure links followed over a walk never outnumber the characters read.

Semantics (what `find_stop_string` has always meant): among the occurrences of stop strings
that end in the new characters, the one that starts earliest; at equal starts, the stop
string listed first.

Why not a library: pyahocorasick can continue a search across chunks
(`AutomatonSearchIter.set(chunk, False)`), but doing so corrupts the heap when the chunks mix
BMP and astral characters (open issue WojciechMula/pyahocorasick#221; model output with an
emoji segfaulted here). ahocorasick-rs keeps no state between calls: each step would rescan
the window, and after a min_tokens stretch step past the occurrences that ended before the new
text one search at a time (quadratic in the window), or list all overlapping occurrences
(stop strings "a", "aa", ... report hundreds per character).
"""
from __future__ import annotations

from collections.abc import Sequence

FEW_STOP_STRINGS = 8
"""Up to this many stop strings, a search is one str.find per stop string over the window."""


class StopStringMatcher:
    """A request's stop strings (non-empty; duplicates allowed), ready to search.
    `automaton`: True or False forces the search (tests); None chooses by the number of stop
    strings (FEW_STOP_STRINGS). Building the automaton costs O(total characters)."""

    def __init__(self, stops: Sequence[str], automaton: bool | None = None) -> None:
        self.stops: tuple[str, ...] = tuple(stops)
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.automaton = len(self.stops) > FEW_STOP_STRINGS if automaton is None else automaton
        self._window_extra = sum(len(s) - 1 for s in self.stops)
        self._rank: dict[str, int] = {}
        """stop string -> its first index in `stops` (the tie-break at equal starts)."""
        for rank, stop in enumerate(self.stops):
            self._rank.setdefault(stop, rank)
        self._goto: list[dict[str, int]] = [{}]
        self._fail: list[int] = [0]
        self._longest: list[int] = [0]
        """state -> length of the longest stop string that is a suffix of the state's text."""
        if self.automaton:
            self._build()

    def _build(self) -> None:
        goto = self._goto
        ends: dict[int, int] = {}  # state -> length of the stop string spelled to it
        for stop in self._rank:
            node, shared = 0, 0
            for char in stop:  # follow the part already in the trie
                nxt = goto[node].get(char)
                if nxt is None:
                    break
                node, shared = nxt, shared + 1
            rest = stop[shared:]
            if rest:  # then add the rest as one chain of new states
                first = len(goto)
                goto[node][rest[0]] = first
                goto.extend([{char: first + i} for i, char in enumerate(rest[1:], start=1)])
                goto.append({})
                node = len(goto) - 1
            ends[node] = len(stop)
        fail = [0] * len(goto)
        longest = [0] * len(goto)
        # Level by level, so a state's failure target (a shallower state) is finished first.
        level = list(goto[0].values())
        for node in level:
            longest[node] = ends.get(node, 0)
        while level:
            below = []
            for node in level:
                for char, child in goto[node].items():
                    target = fail[node]
                    while target and char not in goto[target]:
                        target = fail[target]
                    # target is shallower than child, so its transition is never child itself.
                    fail[child] = link = goto[target].get(char, 0)
                    longest[child] = ends.get(child) or longest[link]
                    below.append(child)
            level = below
        self._fail, self._longest = fail, longest

    @property
    def num_states(self) -> int:
        return len(self._goto)

    def rank(self, stop: str) -> int:
        return self._rank[stop]

    def cursor(self) -> StopStringCursor:
        return StopStringCursor(self)


class StopStringCursor:
    """One sequence's position in a StopStringMatcher. The text passed to `find` may only
    grow between calls, and a cursor is not used again once it found a stop (the sequence
    ends there)."""

    __slots__ = ("matcher", "state", "num_read", "work")

    def __init__(self, matcher: StopStringMatcher) -> None:
        self.matcher = matcher
        self.state = 0
        """The automaton state after reading the text's first `num_read` characters (or the
        ones from where the walk last restarted)."""
        self.num_read = 0
        self.work = 0
        """Characters read plus failure links followed (with str.find: at most the
        characters in the windows searched), over the cursor's life: the matching cost,
        counted so tests can check it does not grow with the number of stop strings."""

    def find(self, text: str, num_new_chars: int) -> tuple[int, str] | None:
        """The earliest (start, stop string) among stop-string occurrences that end in the
        last `num_new_chars` characters of `text`, or None. Earlier characters not read yet
        (steps whose check was skipped, e.g. before min_tokens) are read first, without
        reporting what ends in them: at most the longest stop string's length minus one."""
        matcher = self.matcher
        end = len(text)
        if not matcher.automaton:
            self.num_read = end
            self.work += len(matcher.stops) * num_new_chars + matcher._window_extra
            return find_stop_string_brute_force(text, num_new_chars, matcher.stops)
        goto, fail, longest = matcher._goto, matcher._fail, matcher._longest
        first_new = max(end - num_new_chars, 0)
        window = max(first_new - matcher.max_len + 1, 0)
        if self.num_read < window:
            # Nothing before the window can begin an occurrence that ends in the new text.
            self.state, self.num_read = 0, window
        state, read, work = self.state, self.num_read, 0
        best_start, best_ends = end, []  # the earliest start and the ends that reach it
        while read < end:
            char = text[read]
            read += 1
            while True:
                nxt = goto[state].get(char)
                if nxt is not None:
                    state = nxt
                    break
                if not state:
                    break
                state = fail[state]
                work += 1
            length = longest[state]
            if length and read > first_new:
                start = read - length
                if start < best_start:
                    best_start, best_ends = start, [read]
                elif start == best_start:
                    best_ends.append(read)
            if best_ends and read >= best_start + matcher.max_len:
                break  # every later occurrence starts after best_start
        self.work += work + read - self.num_read
        self.state, self.num_read = state, read
        if not best_ends:
            return None
        stop = min((text[best_start:e] for e in best_ends), key=matcher.rank)
        return best_start, stop


def find_stop_string_brute_force(text: str, num_new_chars: int,
                                 stops: Sequence[str]) -> tuple[int, str] | None:
    """One `str.find` per stop string over the window that can hold an occurrence ending in
    the new characters: O(stop strings x window). What the engine did before the automaton,
    its search for a few stop strings, and the reference tests compare the automaton with."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
