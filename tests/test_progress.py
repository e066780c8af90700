"""Progress lines for long waits (vllm/utils/progress.py): driven by a fake clock, so that no
assertion depends on how fast the machine is."""
from __future__ import annotations

import logging
import os
import threading

import pytest

from vllm.utils import progress
from vllm.utils.progress import Watcher, waiting

LOGGER = "vllm.test_progress"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def watcher(clock):
    return Watcher(clock=clock, delay=2.0, interval=5.0, background=False)


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)

    def messages() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == LOGGER]

    return messages


def log() -> logging.Logger:
    return logging.getLogger(LOGGER)


def test_a_long_wait_logs_its_start_then_every_interval_then_its_end(clock, watcher, lines):
    with waiting(log(), "Building k", done="Built k", watcher=watcher) as wait:
        assert lines() == ["Building k ..."]
        for t in (1.9, 2.0, 6.9, 7.0):
            clock.now = 100.0 + t
            watcher.poll()
        assert wait.ticks == 2
        clock.now = 130.0  # a late wake-up: one line, not the five it missed
        assert watcher.poll() == 132.0
    assert lines() == ["Building k ...", "Building k: 2.0 s so far",
                       "Building k: 7.0 s so far", "Building k: 30.0 s so far",
                       "Built k in 30.0 s"]
    assert watcher.active() == [] and watcher.poll() is None


def test_a_quiet_wait_logs_nothing_when_it_ends_within_the_delay(clock, watcher, lines):
    with waiting(log(), "Loading p", done="Loaded p", announce=False, watcher=watcher):
        clock.now += 1.9
        watcher.poll()
    assert lines() == []
    # ... and its end when it did log progress (every progress line gets its end).
    with waiting(log(), "Loading p", done="Loaded p", announce=False, watcher=watcher):
        clock.now += 2.5
        watcher.poll()
    assert lines() == ["Loading p: 2.5 s so far", "Loaded p in 2.5 s"]


def test_a_failed_wait_stops_its_lines_and_says_so_when_it_logged_progress(clock, watcher,
                                                                         lines):
    with pytest.raises(KeyError), waiting(log(), "Compiling x", done="Compiled x",
                                          announce=False, watcher=watcher):
        clock.now += 3.0
        watcher.poll()
        raise KeyError("boom")
    assert lines() == ["Compiling x: 3.0 s so far",
                       "Compiling x: stopped after 3.0 s (KeyError)"]
    clock.now += 60.0
    watcher.poll()
    assert len(lines()) == 2


def test_only_the_innermost_wait_of_a_thread_logs_progress(clock, watcher, lines):
    """A start-up phase stays quiet while the compile inside it reports; a wait of another
    thread has its own lines."""
    other: list = []
    with waiting(log(), "outer", announce=False, watcher=watcher):
        clock.now += 1.0
        with waiting(log(), "inner", announce=False, watcher=watcher):
            assert watcher.active() == ["outer", "inner"]
            thread = threading.Thread(target=lambda: other.append(
                watcher.add(log(), "other thread")))
            thread.start()
            thread.join()
            clock.now += 1.5
            assert watcher.poll() == 103.0  # outer's line skipped; the others' are due at 103
            assert lines() == []
            clock.now += 0.5
            watcher.poll()
        watcher.remove(other[0])
        clock.now = 107.0
        watcher.poll()
    assert lines() == ["inner: 2.0 s so far", "other thread: 2.0 s so far",
                       "outer: 7.0 s so far"]


def test_the_done_line_may_be_changed_inside_the_block(clock, watcher, lines):
    with waiting(log(), "Fetching f", done="Fetched f", watcher=watcher) as wait:
        wait.done = "Found f in the cache"
    with waiting(log(), "Fetching g", done="Fetched g", watcher=watcher) as wait:
        wait.done = None
    assert lines() == ["Fetching f ...", "Found f in the cache in 0.0 s", "Fetching g ..."]


def test_with_info_off_a_wait_does_no_bookkeeping(watcher, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with waiting(log(), "silent", watcher=watcher) as wait:
        assert wait is None and watcher.active() == []


def test_bad_delay_or_interval_is_refused_naming_the_values():
    with pytest.raises(ValueError, match="interval=0"):
        Watcher(interval=0)
    with pytest.raises(ValueError, match="delay=-1"):
        Watcher(delay=-1)


def test_the_background_thread_logs_and_stops_with_the_block(lines):
    """The real thread and clock: the outcome (a line while the block waits, none after it)
    does not depend on the machine's speed; only how long the test takes does."""
    watcher = Watcher(delay=0.0, interval=0.01)
    seen = threading.Event()

    class Signal(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.set()

    handler = Signal()
    log().addHandler(handler)
    try:
        with waiting(log(), "waiting for the thread", announce=False, done="done",
                     watcher=watcher) as wait:
            assert seen.wait(timeout=60), "the progress thread logged nothing in 60 s"
        ticks = wait.ticks
        after = len(lines())
        assert lines()[-1].startswith("done in ")
        assert after == ticks + 1
        # The thread has nothing to do: it sleeps until the next wait.
        assert watcher.poll() is None and len(lines()) == after
    finally:
        log().removeHandler(handler)
    assert watcher._thread is not None and watcher._thread.daemon


def test_the_process_watcher_is_shared_and_forgotten_in_a_forked_child(monkeypatch):
    monkeypatch.setattr(progress, "_watcher", None)
    first = progress.get_watcher()
    assert progress.get_watcher() is first
    progress._forget_watcher()
    assert progress.get_watcher() is not first


def test_a_cpu_kernel_build_logs_while_it_lasts(tmp_path, monkeypatch, clock, watcher, caplog):
    """The first start on a machine builds the C++ CPU kernels (tens of seconds on a busy
    one): the build says which kernel, that it started, and how long it has run."""
    import torch.utils.cpp_extension

    from vllm.utils import cpu_kernels

    def build(name, build_directory, **kwargs) -> None:  # a "build" of 12 s on the fake clock
        for _ in range(12):
            clock.now += 1.0
            watcher.poll()
        open(os.path.join(build_directory, f"{name}.so"), "w").close()

    monkeypatch.setattr(progress, "_watcher", watcher)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", build)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    caplog.set_level(logging.INFO, logger="vllm.utils.cpu_kernels")
    assert cpu_kernels.load_cpu_extension("progress_test_kernel", str(tmp_path / "k.cpp"),
                                          "VLLM_PROGRESS_TEST_KERNEL", source_text="// none")
    messages = [r.getMessage() for r in caplog.records if r.name == "vllm.utils.cpu_kernels"]
    what = "Building the CPU kernel progress_test_kernel"
    assert messages[0].startswith(f"{what} (once per machine")
    assert messages[1:4] == [f"{what}: 2.0 s so far", f"{what}: 7.0 s so far",
                             f"{what}: 12.0 s so far"]
    assert messages[4].startswith("Built the CPU kernel progress_test_kernel into ")
    assert messages[4].endswith(" in 12.0 s") and len(messages) == 5


def test_a_long_start_up_phase_logs_unless_a_wait_inside_it_reports(monkeypatch, clock,
                                                                     watcher, caplog):
    from vllm.utils.startup_timer import StartupTimer

    monkeypatch.setattr(progress, "_watcher", watcher)
    caplog.set_level(logging.INFO)
    timer = StartupTimer()
    with timer.phase("weight loading"):
        clock.now += 2.0
        watcher.poll()
        with waiting(log(), "Building k", watcher=watcher):
            clock.now += 5.0
            watcher.poll()
        clock.now += 5.0
        watcher.poll()
    clock.now += 60.0
    watcher.poll()
    assert [r.getMessage() for r in caplog.records] == [
        "Start-up (weight loading): 2.0 s so far", "Building k ...",
        "Building k: 5.0 s so far", "Start-up (weight loading): 12.0 s so far"]
    assert timer.count("weight loading") == 1 and watcher.active() == []
