"""Start-up phase timings: where the seconds between "start" and "ready" went.

    timer = get_startup_timer()
    with timer.phase("weight loading"):
        load()
    timer.record("inductor compilation", 1.2, piece=0, cache="miss")
    print(timer.table())

Phases recorded more than once (one per piece, one per capture) are summed in `table()` and
listed one by one in `as_dict()["phases"][name]["events"]`.

The engine resets the timer when its start-up begins and, once ready, logs `table(wall)`:
every standard phase (0 when it did not happen), the per-piece compile rows, and "other"
(the wall time no phase covers), so that the rows add up to the start-up wall time. Phases
must not overlap: a phase that contains others (warm-up runs the Dynamo trace and the
compiles) subtracts them (`subtract`).
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from vllm.logger import init_logger
from vllm.utils.progress import waiting

logger = init_logger(__name__)

# The phases the engine reports, in start-up order (others may be added freely).
STANDARD_PHASES = (
    "config resolution",
    "weight loading",
    "dynamo tracing",
    "inductor compilation",
    "cudagraph capture",
    "kv cache allocation",
    "warm-up",
)
OTHER = "other"
# Building our C++ CPU kernels (the first start on a machine): a row of its own, taken out of
# the phase it happened in (weight loading, the first forward).
CPU_KERNEL_BUILD = "cpu kernel build"
# Phases listed only when they happened, at their place in start-up order.
_ORDER = (STANDARD_PHASES[:2] + (CPU_KERNEL_BUILD,) + STANDARD_PHASES[2:3] + ("graph loading",)
          + STANDARD_PHASES[3:])


class StartupTimer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[str, float, dict[str, Any]]] = []
        self._created = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str, **info: Any) -> Iterator[dict[str, Any]]:
        """Time the block as one event of phase `name`; the yielded dict may be filled with
        details (e.g. `info["cache"] = "hit"`). A block that lasts over 2 s logs "Start-up
        (<name>): 7.0 s so far" every few seconds, unless a wait inside it (a compile, a
        kernel build) reports instead (vllm/utils/progress.py)."""
        details = dict(info)
        start = time.perf_counter()
        try:
            with waiting(logger, f"Start-up ({name})", announce=False):
                yield details
        finally:
            self.record(name, time.perf_counter() - start, **details)

    @contextlib.contextmanager
    def phase_around(self, name: str, nested: tuple[str, ...]) -> Iterator[None]:
        """Time the block as phase `name`, less the time the `nested` phases recorded inside
        it (they are rows of their own: counted twice, the rows would exceed the wall time)."""
        before = self.total(nested)
        with self.phase(name):
            yield
        self.subtract(name, self.total(nested) - before)

    def record(self, name: str, seconds: float, **info: Any) -> None:
        with self._lock:
            self._events.append((name, float(seconds), info))

    def subtract(self, name: str, seconds: float) -> None:
        """Record a negative correction (e.g. backend time that happened inside tracing)."""
        self.record(name, -seconds, correction=True)

    def seconds(self, name: str) -> float:
        with self._lock:
            return sum(s for n, s, _ in self._events if n == name)

    def total(self, names: tuple[str, ...]) -> float:
        """The seconds recorded so far in all of `names` (a region's nested phases)."""
        return sum(self.seconds(n) for n in names)

    def count(self, name: str) -> int:
        with self._lock:
            return sum(1 for n, _, info in self._events if n == name and _counted(info))

    def wall_seconds(self) -> float:
        """Seconds since the timer was created or last reset (the start of start-up)."""
        return time.perf_counter() - self._created

    def phase_seconds(self, wall_seconds: float | None = None) -> dict[str, float]:
        """phase -> seconds: every standard phase (0.0 when it did not happen), then the other
        phases recorded, then "other" = `wall_seconds` minus their sum (when given)."""
        recorded = self.phases()
        names = [n for n in _ORDER if n in STANDARD_PHASES or n in recorded]
        names += [n for n in recorded if n not in names]
        result = {name: max(self.seconds(name), 0.0) for name in names}
        if wall_seconds is not None:
            result[OTHER] = max(wall_seconds - sum(result.values()), 0.0)
        return result

    def phases(self) -> list[str]:
        with self._lock:
            names = list(dict.fromkeys(n for n, _, _ in self._events))
        known = [p for p in _ORDER if p in names]
        return known + [n for n in names if n not in _ORDER]

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            events = list(self._events)
        phases: dict[str, Any] = {}
        for name in self.phases():
            mine = [(s, info) for n, s, info in events if n == name]
            phases[name] = {
                "seconds": round(sum(s for s, _ in mine), 6),
                "count": sum(1 for _, info in mine if _counted(info)),
                "events": [{"seconds": round(s, 6), **info} for s, info in mine
                           if not info.get("correction")],
            }
        total = sum(p["seconds"] for p in phases.values())
        return {"total_seconds": round(total, 6), "phases": phases}

    def table(self, wall_seconds: float | None = None) -> str:
        """The start-up table: one row per phase (standard ones always), a row per compiled
        piece under "inductor compilation", "other" (with `wall_seconds`) and the total."""
        data = self.as_dict()
        seconds = self.phase_seconds(wall_seconds)
        rows = []
        for name, secs in seconds.items():
            phase = data["phases"].get(name, {"count": 0, "events": []})
            count = "" if name == OTHER else str(phase["count"])
            rows.append((name, f"{secs:.2f}", count, _summarize(phase["events"])))
            if name == "inductor compilation":
                rows += _piece_rows(phase["events"])
        total = sum(seconds.values())
        rows.append(("total", f"{total:.2f}", "",
                     "" if wall_seconds is None else f"wall {wall_seconds:.2f}"))
        widths = [max(len(r[i]) for r in rows + [("phase", "seconds", "count", "")])
                  for i in range(3)]
        lines = [f"{'phase':<{widths[0]}}  {'seconds':>{widths[1]}}  {'count':>{widths[2]}}  "
                 "details"]
        for name, secs, count, detail in rows:
            lines.append(f"{name:<{widths[0]}}  {secs:>{widths[1]}}  {count:>{widths[2]}}  "
                         f"{detail}".rstrip())
        return "\n".join(lines)

    def take_events(self) -> list[tuple[str, float, dict[str, Any]]]:
        """The events recorded so far, removed from this timer: a worker process hands its
        phases (compiles, kernel builds, captures) to the engine's timer (`add_events`)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def add_events(self, events: list[tuple[str, float, dict[str, Any]]]) -> None:
        """Record events another process's timer took (`take_events`)."""
        for name, seconds, info in events:
            self.record(name, seconds, **info)

    def reset(self) -> None:
        with self._lock:
            self._events.clear()
            self._created = time.perf_counter()


def _counted(info: dict[str, Any]) -> bool:
    """Corrections and time around the counted events (`uncounted=True`) are not events."""
    return not info.get("correction") and not info.get("uncounted")


def _piece_rows(events: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """One indented row per compiled piece: its seconds, compiles and cache results."""
    pieces: dict[Any, list[dict[str, Any]]] = {}
    for event in events:
        if "piece" in event:
            pieces.setdefault(event["piece"], []).append(event)
    rows = []
    for piece, mine in pieces.items():
        details = {k: v for k, v in ((k, [str(e[k]) for e in mine if k in e])
                                     for k in ("cache", "range")) if v}
        text = "; ".join(f"{k}: " + ", ".join(dict.fromkeys(v)) for k, v in details.items())
        rows.append((f"  piece {piece}", f"{sum(e['seconds'] for e in mine):.2f}",
                     str(len(mine)), text))
    return rows


def _summarize(events: list[dict[str, Any]]) -> str:
    """"cache: 2 hit, 1 miss" style summary of the detail fields shared by the events."""
    parts = []
    keys = dict.fromkeys(k for e in events for k in e if k not in ("seconds", "uncounted"))
    for key in keys:
        values = [str(e[key]) for e in events if key in e]
        counts = dict.fromkeys(values, 0)
        for v in values:
            counts[v] += 1
        if len(counts) <= 4:
            parts.append(f"{key}: " + ", ".join(f"{n} {v}" if n > 1 else v
                                                for v, n in counts.items()))
    return "; ".join(parts)


_startup_timer = StartupTimer()


def get_startup_timer() -> StartupTimer:
    """The process-wide timer the engine and the compile stack report into."""
    return _startup_timer


def reset_startup_timer() -> StartupTimer:
    _startup_timer.reset()
    return _startup_timer
