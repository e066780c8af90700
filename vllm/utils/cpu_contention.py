"""Noticing other processes busy on the CPU engine's CPUs, and running fewer intra-op threads
while they are (issue 21).

`ContentionDetector` is pure decision logic over step times and other processes' CPU use (the
tests feed it synthetic windows); `ThreadGovernor` wires it to the process: a clock, /proc/stat
(others' use = the busy time of our CPUs minus our own CPU time) and torch.set_num_threads.
The worker makes one per rank from its `ThreadPlan` (vllm/utils/cpu_threads.py), feeds it each
step's time and batch shape, and polls it once after warm-up. It warns once per process,
naming the fixes (OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND, taskset); a thread count the
user chose is never changed (warning only); VLLM_CPU_ADAPTIVE_THREADS=0 makes it warn only.

Why fewer threads: torch's parallel regions (one per linear layer, ~100 per decode step) end
at a barrier that waits for every thread. A thread that shares its core with a busy process
runs only in its share of the time slices, so every region waits for it.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from vllm.logger import init_logger
from vllm.utils.cpu_threads import ThreadPlan, read_text_or_none

logger = init_logger(__name__)

PROC_STAT = "/proc/stat"
_logged: set[str] = set()


@dataclass
class Decision:
    """What the detector asks for after a step: `threads` to run with (None: keep), and
    `warn` the one-time warning's text (None: nothing to say)."""

    threads: int | None = None
    warn: str | None = None
    info: str | None = None


@dataclass
class ContentionDetector:
    """Decides, from step times and other processes' CPU use on this engine's CPUs, when to
    run fewer threads. Pure: the caller supplies the clock and the measurements.

    Every `window_s` (and at least `min_steps` steps) the caller reports `others_busy`, the
    CPUs' worth of time other processes used on our CPUs in that window. Contention starts
    once windows in a row covering at least `enter_s` seconds show others keeping at least
    `busy_on` CPUs busy while we run more threads than the CPUs left to us (the first window
    runs from the engine's start, so a process already busy before it is seen at the first
    step); or, where `others_busy` is unknown, when the windows' median step is `slow_factor`
    x slower than the best seen at the same batch shape and thread count. It ends after
    `leave_s` seconds of windows with others below `busy_off`. `adjust=False` (the user chose
    the thread count): warn only.
    """

    full_threads: int
    num_cpus: int
    adjust: bool = True
    window_s: float = 0.25
    min_steps: int = 1
    busy_on: float = 0.6
    busy_off: float = 0.3
    enter_s: float = 0.5
    leave_s: float = 0.5
    slow_factor: float = 3.0
    threads: int = 0
    _best: dict = field(default_factory=dict)
    _ratios: list = field(default_factory=list)
    _window_start: float | None = None
    _busy_run: float = 0.0
    _calm_run: float = 0.0
    warned: bool = False

    def __post_init__(self) -> None:
        self.threads = self.threads or self.full_threads

    MAX_SHAPES = 512  # a server sees many batch shapes: forget them all past this many

    def _ratio(self, shape, step_s: float) -> float:
        key = (shape, self.threads)
        if key not in self._best and len(self._best) >= self.MAX_SHAPES:
            self._best.clear()
        recent = self._best.setdefault(key, deque(maxlen=64))
        best = min(recent) if recent else None
        recent.append(step_s)
        return 1.0 if best is None or best <= 0 else step_s / best

    def observe(self, now: float, step_s: float, shape, others_busy=None) -> Decision | None:
        """One step of `step_s` seconds at batch `shape` ending at `now`. `others_busy` is
        called (no arguments) at a window's end for other processes' CPUs' worth of use since
        the last call, or is None/returns None when unknown."""
        self._ratios.append(self._ratio(shape, step_s))
        if self._window_start is None:
            self._window_start = now - step_s
        if now - self._window_start < self.window_s or len(self._ratios) < self.min_steps:
            return None
        slow = statistics.median(self._ratios)
        return self.end_window(now, others_busy, slow)

    def start(self, now: float) -> None:
        """Open the first window at `now` (the engine's start)."""
        self._window_start = now

    def end_window(self, now: float, others_busy=None, slow: float = 1.0) -> Decision | None:
        """Close the window at `now` (also without a step: after the warm-up)."""
        duration = now - (self._window_start if self._window_start is not None else now)
        self._ratios.clear()
        self._window_start = now
        busy = others_busy() if callable(others_busy) else others_busy
        return self.decide(busy, slow, duration)

    def decide(self, busy: float | None, slow: float,
               duration: float | None = None) -> Decision | None:
        """A window's verdict: `busy` other processes' CPUs' worth (None: unknown), `slow` the
        window's median step time over the best at the same shape and threads, `duration`
        its length in seconds (default `window_s`)."""
        duration = self.window_s if duration is None else duration
        left = self.num_cpus - (busy or 0.0)
        if self.threads < self.full_threads:  # contended now: is it over?
            if busy is not None and busy < self.busy_off:
                self._calm_run += duration
                if self._calm_run >= self.leave_s - 1e-9:
                    self._calm_run = self._busy_run = 0.0
                    old, self.threads = self.threads, self.full_threads
                    return Decision(threads=self.full_threads, info=(
                        f"CPU contention over (other processes now use {busy:.2f} CPUs): back "
                        f"to {self.full_threads} threads from {old}"))
                return None
            self._calm_run = 0.0
            target = max(1, min(self.full_threads, math.floor(left + 0.5)))
            if busy is not None and busy >= self.busy_on and target < self.threads:
                self.threads = target
                return Decision(threads=target)
            return None
        target = max(1, min(self.full_threads, math.floor(left + 0.5)))
        # Only when fewer threads would help: one thread has nothing to give back.
        contended = busy is not None and busy >= self.busy_on and self.threads > target
        if busy is None:
            contended = slow >= self.slow_factor and self.threads > 1
        if not contended:
            self._busy_run = 0.0
            return None
        self._busy_run += duration
        if self._busy_run < self.enter_s - 1e-9:
            return None
        self._busy_run = 0.0
        decision = Decision()
        if self.adjust and busy is not None and target < self.threads:
            self.threads = target
            decision.threads = target
        if not self.warned:
            self.warned = True
            decision.warn = self._warning(busy, slow, target, decision.threads is not None)
        return decision if (decision.threads or decision.warn) else None

    def _warning(self, busy, slow, target, adjusted) -> str:
        seen = (f"other processes use ~{busy:.1f} of the {self.num_cpus} CPUs this engine's "
                f"{self.full_threads} threads run on" if busy is not None
                else f"decode steps run {slow:.1f}x slower than the recent best at the same "
                     "batch")
        fix = (f"OMP_NUM_THREADS={target}, VLLM_CPU_OMP_THREADS_BIND=<free CPUs> or "
               "`taskset -c <free CPUs>`")
        if adjusted:
            return (f"CPU contention: {seen}. Running {target} intra-op thread(s) instead of "
                    f"{self.full_threads} while it lasts (a thread sharing a busy core stalls "
                    f"every parallel region). To choose yourself: {fix}.")
        return (f"CPU contention: {seen}, and a thread sharing a busy core stalls every "
                f"parallel region. Your thread setting is kept; consider {fix}.")


def _proc_stat_busy(cpus, path: str = PROC_STAT) -> float | None:
    """Seconds of non-idle time summed over `cpus` since boot, from /proc/stat."""
    text = read_text_or_none(path)
    if text is None:
        return None
    want = {f"cpu{c}" for c in cpus}
    ticks = 0
    found = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name in want:
            f = [int(x) for x in rest.split()]
            # user nice system idle iowait irq softirq steal (guest is inside user)
            ticks += sum(f[:8]) - f[3] - (f[4] if len(f) > 4 else 0)
            found += 1
    if not found:
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """The detector wired to the process: times each step, reads other processes' CPU use of
    our CPUs from /proc/stat (their busy time minus ours), and applies its decisions with
    torch.set_num_threads. One per worker."""

    def __init__(self, plan: ThreadPlan, adjust: bool = True, clock=time.perf_counter,
                 stat_path: str = PROC_STAT) -> None:
        cpus = plan.usable_cpus
        self.detector = ContentionDetector(plan.num_threads, len(cpus),
                                           adjust=adjust and not plan.explicit)
        self.cpus = cpus
        self.clock = clock
        self.stat_path = stat_path
        self._last = self._sample()
        self.detector.start(self._last[0])

    def _sample(self):
        return (self.clock(), _proc_stat_busy(self.cpus, self.stat_path), time.process_time())

    def _others_busy(self) -> float | None:
        now = self._sample()
        (t0, b0, own0), (t1, b1, own1) = self._last, now
        self._last = now
        if b0 is None or b1 is None or t1 <= t0:
            return None
        return max(0.0, ((b1 - b0) - (own1 - own0)) / (t1 - t0))

    def step(self, step_s: float, shape) -> None:
        """After each step: `step_s` its time, `shape` its batch (tokens, requests)."""
        self._apply(self.detector.observe(self.clock(), step_s, shape, self._others_busy))

    def poll(self) -> None:
        """Close a window without a step (after the warm-up: a process that was busy on our
        CPUs since the engine started is acted on before the first request)."""
        self._apply(self.detector.end_window(self.clock(), self._others_busy))

    def _apply(self, decision: Decision | None) -> None:
        if decision is None:
            return
        if decision.warn and "contention" not in _logged:  # once per process
            _logged.add("contention")
            logger.warning(decision.warn)
        if decision.info:
            logger.info(decision.info)
        if decision.threads is not None:
            import torch

            torch.set_num_threads(decision.threads)
