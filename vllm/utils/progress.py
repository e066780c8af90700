"""Progress lines for long waits that have nothing to count (a C++ build, one Inductor compile,
a download): the wait logs when it starts, then every few seconds while it lasts.

    with waiting(logger, "Building the CPU kernel small_m_linear",
                 done="Built the CPU kernel small_m_linear"):
        build()

logs "Building the CPU kernel small_m_linear ..." (or the `announce` text), then, from `DELAY_S`
after the start and every `INTERVAL_S` while the block runs, "Building the CPU kernel
small_m_linear: 7.0 s so far", and at a normal exit "Built the CPU kernel small_m_linear in
9.3 s". With `announce=False` nothing is logged for a wait that ends within `DELAY_S` (a cache
hit); a wait that outlasted it still logs its `done` line, so every progress line gets its end.
While waits are nested in one thread only the innermost logs progress lines (a start-up phase
stays quiet while a compile inside it reports).

One daemon thread per process (`Watcher`, started at the first wait) sleeps until the next line
is due; a wait costs a lock, a list append and at most a notify (~4 us a wait, measured), and
the thread logs nothing for a wait that ended. The lines only report: nothing the block
computes depends on them. Countable work (weight tensors, prompts) uses tqdm instead.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

DELAY_S = 2.0
"""Seconds of a wait before its first progress line."""
INTERVAL_S = 5.0
"""Seconds between two progress lines of one wait."""


class Wait:
    """One wait in progress: what it is, when it started, the lines it has logged."""

    def __init__(self, log: Any, what: str, started: float, first_due: float,
                 done: str | None) -> None:
        self.log = log
        self.what = what
        self.started = started
        self.next_due = first_due
        self.done = done
        """Logged as "<done> in <seconds> s" at a normal exit; may be changed (or set to None)
        inside the block."""
        self.ticks = 0
        """Progress lines logged so far (not counting the start and done lines)."""
        self.thread = threading.get_ident()


class Watcher:
    """Logs the progress lines of the waits in progress, from one background thread.

    `clock` gives the time in seconds (monotonic); `background=False` starts no thread, and
    `poll()` logs what is due (tests drive a fake clock this way)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, delay: float = DELAY_S,
                 interval: float = INTERVAL_S, background: bool = True) -> None:
        if delay < 0 or interval <= 0:
            raise ValueError(f"progress delay must be >= 0 and interval > 0, got delay={delay} "
                             f"and interval={interval}")
        self.clock, self.delay, self.interval = clock, delay, interval
        self.background = background
        self._cond = threading.Condition(threading.Lock())
        # Held while lines are logged (outside `_cond`: a slow handler delays no wait's
        # start); `remove` waits for it, so no progress line follows a wait's end.
        self._emitting = threading.Lock()
        self._waits: list[Wait] = []
        self._thread: threading.Thread | None = None

    def add(self, log: Any, what: str, done: str | None = None) -> Wait:
        now = self.clock()
        wait = Wait(log, what, now, now + self.delay, done)
        with self._cond:
            sooner = all(wait.next_due < w.next_due for w in self._waits)
            self._waits.append(wait)
            if self.background and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="vllm-progress",
                                                daemon=True)
                self._thread.start()
            elif self.background and sooner:
                self._cond.notify()  # it sleeps until a later line (or for good: no wait)
        return wait

    def remove(self, wait: Wait) -> float:
        """Stop `wait`'s lines; its elapsed seconds. The thread is not woken: when it finds
        nothing due, it sleeps again."""
        with self._cond:
            if wait in self._waits:
                self._waits.remove(wait)
        with self._emitting:
            pass
        return self.clock() - wait.started

    def active(self) -> list[str]:
        """What the waits in progress are (outermost first)."""
        with self._cond:
            return [w.what for w in self._waits]

    def poll(self) -> float | None:
        """Log one line for each wait that is due one; the clock time of the next line due
        (None when no wait is in progress)."""
        with self._emitting:
            due = []
            with self._cond:
                now = self.clock()
                inner: set[int] = set()  # threads whose innermost wait was seen (from the end)
                for wait in reversed(self._waits):
                    innermost = wait.thread not in inner
                    inner.add(wait.thread)
                    if wait.next_due <= now:
                        # A late wake-up (a busy machine) logs one line, not the missed ones.
                        while wait.next_due <= now:
                            wait.next_due += self.interval
                        if innermost:  # a wait nested in it says more (the compile in a phase)
                            wait.ticks += 1
                            due.append((wait, now - wait.started))
                due.reverse()
                next_due = min((w.next_due for w in self._waits), default=None)
            for wait, elapsed in due:
                wait.log.info("%s: %.1f s so far", wait.what, elapsed)
        return next_due

    def _run(self) -> None:
        while True:
            self.poll()
            with self._cond:  # `add` notifies under this lock: no wake-up is missed
                next_due = min((w.next_due for w in self._waits), default=None)
                if next_due is None:
                    self._cond.wait()
                else:
                    timeout = next_due - self.clock()
                    if timeout > 0:
                        self._cond.wait(timeout)


class waiting:
    """Context manager: `log`'s progress lines for the wait in the block (module docstring).

    `log`: a logger (or vllm's logger adapter) the lines go to at INFO; when INFO is off for
    it, the block runs with no bookkeeping at all. `announce`: whether to log a line at the
    start ("<what> ..."), or that line's text. Yields the `Wait` (or None when INFO is off)."""

    def __init__(self, log: Any, what: str, *, done: str | None = None,
                 announce: bool | str = True, watcher: Watcher | None = None) -> None:
        self.log, self.what, self.done, self.announce = log, what, done, announce
        self.watcher = watcher
        self.wait: Wait | None = None

    def __enter__(self) -> Wait | None:
        if not self.log.isEnabledFor(logging.INFO):
            return None
        if isinstance(self.announce, str):
            self.log.info("%s", self.announce, stacklevel=2)
        elif self.announce:
            self.log.info("%s ...", self.what, stacklevel=2)
        self.watcher = self.watcher or get_watcher()
        self.wait = self.watcher.add(self.log, self.what, self.done)
        return self.wait

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        wait = self.wait
        if wait is None or self.watcher is None:
            return False
        elapsed = self.watcher.remove(wait)
        if exc_type is None and wait.done is not None and (self.announce or wait.ticks):
            self.log.info("%s in %.1f s", wait.done, elapsed, stacklevel=2)
        elif exc_type is not None and wait.ticks:
            self.log.info("%s: stopped after %.1f s (%s)", self.what, elapsed,
                          exc_type.__name__, stacklevel=2)
        return False


_watcher: Watcher | None = None
_watcher_lock = threading.Lock()


def get_watcher() -> Watcher:
    """The process's watcher (its thread starts with the first wait)."""
    global _watcher
    if _watcher is None:
        with _watcher_lock:
            if _watcher is None:
                _watcher = Watcher()
    return _watcher


def _forget_watcher() -> None:
    # A forked child has no copy of the thread (and the lock may be held): start afresh.
    global _watcher, _watcher_lock
    _watcher, _watcher_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_watcher)
