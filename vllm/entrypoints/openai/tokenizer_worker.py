"""TokenizerWorker: the OpenAI server's tokenizing and chat-template rendering, off the event
loop and under a time limit.

One thread runs every job, one at a time: a Rust-backed tokenizer must not be used from two
threads at once, and the event loop stays free to answer /health and stream other requests
while a large prompt is tokenized. A job that runs longer than its limit is interrupted by
raising `JobTimeout` inside the thread (`PyThreadState_SetAsyncExc`: it lands at the next
Python bytecode, so it stops a Jinja template's loops, which are Python code; a single call
into native code finishes first, which is why requests are also bounded in size before they
get here). The awaiting caller then gets `JobTimeout`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["JobTimeout", "TokenizerWorker"]


class JobTimeout(Exception):
    """A job ran past its time limit and was interrupted."""


class _Job:
    def __init__(self, fn: Callable[[], Any], limit_s: float) -> None:
        self.fn = fn
        self.limit_s = limit_s
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.deadline = float("inf")
        self.interrupted = False


def _raise_in_thread(ident: int, exc_type: type[BaseException] | None) -> None:
    """Schedule `exc_type` in thread `ident` (None clears a scheduled one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(exc_type) if exc_type else None)


class TokenizerWorker:
    """`await worker.run(fn, limit_s)` runs `fn()` in the worker thread; see the module
    docstring. `close()` stops the threads (jobs still queued fail)."""

    def __init__(self, name: str = "vllm-tokenizer") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._current: _Job | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog",
                                          daemon=True)
        self._watchdog.start()

    async def run(self, fn: Callable[[], Any], limit_s: float) -> Any:
        """fn()'s result (or exception); JobTimeout when it ran more than `limit_s` seconds
        (time spent queued behind other jobs does not count)."""
        if self._closed:
            raise RuntimeError("the tokenizer worker is closed")
        job = _Job(fn, limit_s)
        self._jobs.put(job)
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.future.cancel()  # (skipped if it has not started; else it runs to its end)
            raise

    def close(self) -> None:
        self._closed = True
        self._jobs.put(None)
        with self._cond:
            self._cond.notify_all()

    # ---- the worker thread ---------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = None
            try:
                job = self._jobs.get()
                if job is None:
                    return
                if not job.future.set_running_or_notify_cancel():
                    continue
                self._run(job)
            except JobTimeout:  # (landed just after the job's own handler: same outcome)
                self._finish(job, None, JobTimeout())

    def _run(self, job: _Job) -> None:
        with self._cond:
            job.deadline = time.monotonic() + job.limit_s
            self._current = job
            self._cond.notify_all()
        try:
            result, error = job.fn(), None
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result, error = None, exc
        self._finish(job, result, error)

    def _finish(self, job: _Job | None, result: Any, error: BaseException | None) -> None:
        with self._cond:
            self._current = None
        if job is None:
            return
        if job.interrupted:
            _raise_in_thread(threading.get_ident(), None)  # drop it if it has not landed yet
            error = JobTimeout(f"took more than {job.limit_s:g} s")
        if job.future.done():
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    # ---- the watchdog --------------------------------------------------------------------
    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                job = self._current
                if job is None or job.interrupted:
                    self._cond.wait(1.0)
                    continue
                remaining = job.deadline - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                job.interrupted = True
                logger.warning("a tokenizer job ran past %.1f s: interrupting it", job.limit_s)
                _raise_in_thread(self._thread.ident, JobTimeout)
