"""Stop-string matching in O(new characters) per step, whatever the number of stop strings.

`StopStringMatcher` is an Aho-Corasick automaton over one request's stop strings: built once
per request (its n sequences share it; it is immutable after construction) and walked by one
`StopStringCursor` per sequence, which keeps the automaton state between steps and so reads
every output character once. The per-step cost is the new characters plus the failure links
followed, and the links followed over a whole sequence never exceed the characters read, so
a request with a thousand stop strings costs about what one with a single stop string does.

Semantics (what `find_stop_string` has always meant): among the occurrences of stop strings
that end in the new characters, the one that starts earliest; at equal starts, the stop
string listed first.

Why not a library: ahocorasick-rs and pyahocorasick search a whole haystack but keep no state
between calls, so each step would rescan a window of the longest stop string, and they report
either non-overlapping matches (an occurrence that ended before the new text can hide one
that ends in it) or all overlapping ones (stop strings "a", "aa", ... "a" * 1024 over output
"aaaa..." report ~1024 matches per character). One automaton walk per character with a
precomputed "longest stop string ending here" per state avoids both.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class StopStringMatcher:
    """Aho-Corasick automaton over `stops` (non-empty strings; duplicates allowed)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops: tuple[str, ...] = tuple(stops)
        self.max_len = max((len(s) for s in self.stops), default=0)
        self._rank: dict[str, int] = {}
        """stop string -> its first index in `stops` (the tie-break at equal starts)."""
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        terminal = [False]
        for rank, stop in enumerate(self.stops):
            self._rank.setdefault(stop, rank)
            node = 0
            for char in stop:
                nxt = goto[node].get(char)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][char] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    terminal.append(False)
                node = nxt
            terminal[node] = True
        # Breadth-first, so a node's failure target (a shallower node) is finished first.
        fail = [0] * len(goto)
        longest = [0] * len(goto)
        """node -> length of the longest stop string that is a suffix of the node's text."""
        queue = deque(goto[0].values())
        while queue:
            node = queue.popleft()
            longest[node] = depth[node] if terminal[node] else longest[fail[node]]
            for char, child in goto[node].items():
                target = fail[node]
                while char not in goto[target] and target:
                    target = fail[target]
                # target is shallower than child, so its transition is never child itself.
                fail[child] = goto[target].get(char, 0)
                queue.append(child)
        self._goto, self._fail, self._longest = goto, fail, longest

    @property
    def num_states(self) -> int:
        return len(self._goto)

    def cursor(self, start: int = 0) -> StopStringCursor:
        """A walk over a text from its character `start` on (occurrences that begin before
        it are not seen)."""
        cursor = StopStringCursor(self)
        cursor.num_read = start
        return cursor

    def rank(self, stop: str) -> int:
        return self._rank[stop]


class StopStringCursor:
    """One sequence's walk through a StopStringMatcher: the automaton state after the text
    read so far. The text may only grow between calls (a stop ends the sequence)."""

    __slots__ = ("matcher", "state", "num_read", "work")

    def __init__(self, matcher: StopStringMatcher) -> None:
        self.matcher = matcher
        self.state = 0
        self.num_read = 0
        """Characters of the text already fed to the automaton."""
        self.work = 0
        """Characters read plus failure links followed, over the cursor's life: the matching
        cost, counted so tests can check it does not grow with the number of stop strings."""

    def find(self, text: str, num_new_chars: int) -> tuple[int, str] | None:
        """The earliest (start, stop string) among stop-string occurrences that end in the
        last `num_new_chars` characters of `text`, or None. Characters before those that were
        never read (steps whose stop check was skipped, e.g. before min_tokens) are read
        first, without reporting matches that end in them."""
        matcher = self.matcher
        goto, fail, longest = matcher._goto, matcher._fail, matcher._longest
        end = len(text)
        first_new = max(end - num_new_chars, 0)
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
    """The reference the automaton must agree with: one `str.find` per stop string, O(stop
    strings x window) (what the engine did before the automaton; tests compare the two)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
