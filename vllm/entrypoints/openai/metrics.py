"""Server metrics in the Prometheus text exposition format (version 0.0.4).

`ServerMetrics` receives per-request events from the engine thread (it is an
`AsyncLLM` stat observer, so every method is thread-safe) and `render()` writes them, with the
engine's scheduler and KV-cache gauges and the start-up phase seconds, as the `/metrics` page.
Names follow upstream (`vllm:` prefix, `model_name` label).
"""
from __future__ import annotations

import bisect
import collections
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
RATE_WINDOW_S = 10.0


class Histogram:
    """Cumulative-bucket histogram (not thread-safe on its own; ServerMetrics locks)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            running += n
            le = "+Inf" if bound == math.inf else _num(bound)
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {running}')
        out.append(f"{name}_sum{{{labels}}} {_num(self.sum)}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


def _num(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class ServerMetrics:
    """Counters and histograms fed by the engine thread; rendered by `/metrics`."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished: collections.Counter[str] = collections.Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.request_prompt_tokens = Histogram(TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = Histogram(TOKEN_COUNT_BUCKETS)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self.start_time = time.time()

    # ---- StatObserver (engine thread) ----------------------------------------------------
    def on_first_token(self, ttft_s: float) -> None:
        with self._lock:
            self.ttft.observe(ttft_s)

    def on_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.prompt_tokens_total += num_prompt_tokens
            self.generation_tokens_total += num_generation_tokens
            if num_generation_tokens:
                self._recent.append((now, num_generation_tokens))
            self._trim(now)

    def on_inter_token(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` tokens arrived `seconds` after the request's previous ones: each
        counts as one interval of seconds / num_tokens."""
        with self._lock:
            for _ in range(num_tokens):
                self.itl.observe(seconds / num_tokens)

    def on_finished(self, finish_reason: str, e2e_s: float, num_prompt_tokens: int = 0,
                    num_generation_tokens: int = 0) -> None:
        with self._lock:
            self.finished[finish_reason] += 1
            self.e2e.observe(e2e_s)
            if num_prompt_tokens:  # (not known for a request aborted before it ran)
                self.request_prompt_tokens.observe(num_prompt_tokens)
                self.request_generation_tokens.observe(num_generation_tokens)

    # ---- reading -------------------------------------------------------------------------
    def _trim(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()

    def generation_tokens_per_second(self) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S seconds."""
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            total = sum(n for _, n in self._recent)
        return total / RATE_WINDOW_S

    def render(self, stats: Mapping[str, Any],
               startup_phases: Mapping[str, float] | None = None) -> str:
        """The exposition text for the engine `stats` (a snapshot of `LLMEngine.stats()`)."""
        labels = f'model_name="{_escape(self.model_name)}"'
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, Any]]) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            for extra, value in samples:
                lab = labels + ("," + extra if extra else "")
                out.append(f"{name}{{{lab}}} {_num(value)}")

        def gauge(name: str, help_text: str, value: Any) -> None:
            if value is not None:
                metric(name, "gauge", help_text, [("", value)])

        running = stats.get("running", stats.get("num_running"))
        waiting = stats.get("waiting", stats.get("num_waiting"))
        free = stats.get("num_free_blocks")
        total = stats.get("num_total_blocks")
        gauge("vllm:num_requests_running", "Requests being processed by the engine.", running)
        gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", waiting)
        gauge("vllm:num_requests_in_flight", "Requests the server is streaming or waiting on.",
              stats.get("num_in_flight"))
        if free is not None and total:
            usage = float(stats.get("kv_cache_usage", 1.0 - free / total))
            gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 means full).", usage)
            gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (1 means full); the old name "
                  "of vllm:kv_cache_usage_perc.", usage)
        gauge("vllm:kv_cache_free_blocks", "Free KV-cache blocks.", free)
        gauge("vllm:kv_cache_total_blocks", "KV-cache blocks in the pool.", total)
        for key, name, help_text in (
                ("num_preemptions", "vllm:num_preemptions_total", "Preemptions by the scheduler."),
                ("prefix_cache_queries", "vllm:prefix_cache_queries_total",
                 "Prompt tokens looked up in the prefix cache."),
                ("prefix_cache_hits", "vllm:prefix_cache_hits_total",
                 "Prompt tokens found in the prefix cache.")):
            if stats.get(key) is not None:
                metric(name, "counter", help_text, [("", stats[key])])
        if stats.get("block_size") is not None and total:
            metric("vllm:cache_config_info", "gauge", "The KV cache's settings (labels).",
                   [(f'block_size="{stats["block_size"]}",num_gpu_blocks="{total}"', 1)])

        with self._lock:
            prompt_total = self.prompt_tokens_total
            gen_total = self.generation_tokens_total
            finished = dict(self.finished)
            histograms = [
                ("vllm:time_to_first_token_seconds", "Time to first token.", self.ttft),
                ("vllm:e2e_request_latency_seconds", "Request latency, arrival to end.",
                 self.e2e),
                ("vllm:inter_token_latency_seconds", "Time between a request's tokens.",
                 self.itl),
                ("vllm:time_per_output_token_seconds",
                 "Time between a request's tokens (the old name of "
                 "vllm:inter_token_latency_seconds).", self.itl),
                ("vllm:request_prompt_tokens", "Prompt tokens per finished request.",
                 self.request_prompt_tokens),
                ("vllm:request_generation_tokens", "Generated tokens per finished request.",
                 self.request_generation_tokens)]
            histogram_lines = [(name, help_text, h.lines(name, labels))
                               for name, help_text, h in histograms]
        metric("vllm:prompt_tokens_total", "counter", "Prefilled prompt tokens.",
               [("", prompt_total)])
        metric("vllm:generation_tokens_total", "counter", "Generated tokens.",
               [("", gen_total)])
        gauge("vllm:generation_tokens_per_second",
              f"Generated tokens per second over the last {RATE_WINDOW_S:g} s.",
              self.generation_tokens_per_second())
        metric("vllm:request_success_total", "counter", "Finished requests by finish reason.",
               [(f'finished_reason="{_escape(r)}"', n) for r, n in sorted(finished.items())])
        for name, help_text, lines in histogram_lines:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} histogram")
            out.extend(lines)
        if startup_phases:
            metric("vllm:startup_phase_seconds", "gauge", "Seconds spent in each start-up phase.",
                   [(f'phase="{_escape(str(p))}"', float(s)) for p, s in startup_phases.items()])
        gauge("vllm:server_start_time_seconds", "Unix time the server started.",
              self.start_time)
        return "\n".join(out) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """`{"name{labels}": value}` from exposition text (for tests and the benchmark)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        values[key] = float(value)
    return values


def metric_value(text: str, name: str) -> float | None:
    """The first sample of metric `name` (any labels) in exposition text."""
    for key, value in parse_metrics(text).items():
        if key == name or key.startswith(name + "{"):
            return value
    return None
