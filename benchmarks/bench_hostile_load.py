"""Normal clients' latency with and without a hostile client on the same `vllm serve`.

One server (`vllm serve demo -O0` on a free loopback port, started and stopped here). N normal
clients (default 8) each send streaming requests back to back, alternating /v1/completions and
/v1/chat/completions, ~64 prompt tokens and exactly 32 output tokens (greedy, ignore_eos),
for a fixed duration per phase. Phases alternate, `--rounds` times:

- alone: the normal clients only;
- hostile: the same, while one hostile client (its own process, so its big bodies do not
  stall the normal clients' event loop) cycles through expensive-but-legal and refused
  requests, one at a time: bodies near the body limit to /tokenize, /v1/completions and chat,
  one over it, n=128 with 1024 stop strings, 1024 bad words, n=128, 1024 prompts, prompt and
  sampled logprobs over a long prompt, a stream of n=128 dropped after the first chunk,
  JSON nested 100000 deep, malformed bodies (truncated, invalid UTF-8, a 5000-digit number),
  refused values (top_k 2^63, temperature inf) - and, beside them, up to 8 slow-loris
  connections (headers or a body trickled a byte a second, each held at most 20 s).

The report (`<output-dir>/<name>.md` and `.json`): per phase the normal clients' TTFT and
end-to-end latency p50/p90/p99, throughput and failures, the ratio hostile/alone, /health's
latency (probed every 0.5 s), the server's RSS, and per hostile kind the outcomes, the times
and the normal requests that overlapped it (with their E2E and TTFT p50). The server runs with
OMP_NUM_THREADS=1 unless --server-threads says otherwise (see its help).

    python benchmarks/bench_hostile_load.py                       # ~2 minutes on 2 cores
    python benchmarks/bench_hostile_load.py --duration 30 --rounds 3 --clients 16
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from bench_serve_levels import free_port, start_server, stop_server  # noqa: E402

from vllm.benchmarks.serve import (  # noqa: E402
    RequestResult,
    RequestSpec,
    add_cli_args,
    load_tokenizer,
    sample_random_requests,
    send_request,
    summarize,
)
from vllm.config.model import resolve_model_path  # noqa: E402

PCTS = [50.0, 90.0, 99.0]
HOSTILE_TIMEOUT_S = 30.0
SLOW_LORIS_MAX = 8
SLOW_LORIS_HOLD_S = 20.0

# ---- normal clients --------------------------------------------------------------------------


def normal_specs(args: argparse.Namespace, tokenizer_dir: str | None,
                 count: int) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """(completion prompts as token ids, chat prompts as text), `count` of each."""
    ns = add_cli_args(argparse.ArgumentParser()).parse_args([
        "--num-prompts", str(count), "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--seed", str(args.seed)])
    tokenizer = load_tokenizer(tokenizer_dir)
    return (sample_random_requests(ns, tokenizer, as_text=False),
            sample_random_requests(ns, tokenizer, as_text=True))


async def normal_clients(base: str, model: str, specs: tuple[list, list], clients: int,
                         duration: float, output_len: int
                         ) -> tuple[list[tuple[float, RequestResult]], float]:
    """`clients` loops sending one streaming request after another until `duration` has
    passed (a request under way then finishes); returns (start time, result) of each request
    (time.monotonic: the same clock in every process) and the wall time."""
    import httpx

    completion_specs, chat_specs = specs
    results: list[tuple[float, RequestResult]] = []
    start = time.monotonic()
    deadline = start + duration

    async def loop(client: Any, index: int) -> None:
        i = index
        while time.monotonic() < deadline:
            chat = i % 2 == 1
            spec = (chat_specs if chat else completion_specs)[i % len(chat_specs)]
            body: dict[str, Any] = {
                "model": model, "max_tokens": output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if chat:
                body["messages"] = [{"role": "user", "content": spec.prompt}]
                url = base + "/v1/chat/completions"
            else:
                body["prompt"] = spec.prompt
                url = base + "/v1/completions"
            t0 = time.monotonic()
            results.append((t0, await send_request(client, url, body, {}, spec, chat)))
            i += clients

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        await asyncio.gather(*(loop(client, k) for k in range(clients)))
    return results, time.monotonic() - start


async def probe_health(base: str, stop: asyncio.Event) -> list[float]:
    """/health latencies (s), one probe every 0.5 s until `stop`; a failure counts as 30 s."""
    import httpx

    times = []
    async with httpx.AsyncClient(timeout=30.0) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                ok = (await client.get(base + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            times.append(time.perf_counter() - t0 if ok else 30.0)
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
    return times


# ---- the hostile client ----------------------------------------------------------------------


def hostile_requests(model: str, body_limit: int) -> list[tuple[str, str, bytes]]:
    """(kind, path, body) of each hostile request, in the order they are cycled through."""
    near = body_limit - 64 * 1024  # leaves room for the JSON around the text

    def dump(body: Any) -> bytes:
        return json.dumps(body).encode()

    rng = random.Random(0)
    stops = [f"{rng.getrandbits(40):010x}q{i:04d}" for i in range(1024)]  # 16 chars each
    words = [f"w{rng.getrandbits(32):08x}{i:04d}"[:15] for i in range(1024)]
    big_text = ("def f(x): return x * 2; " * (near // 24 + 1))[:near]  # (nothing to escape)
    long_prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 40)  # ~800 tokens
    base = {"model": model, "max_tokens": 16, "ignore_eos": True}
    return [
        ("tokenize_near_limit", "/tokenize", dump({"model": model, "prompt": big_text})),
        ("completion_near_limit", "/v1/completions", dump({**base, "prompt": big_text})),
        ("chat_near_limit", "/v1/chat/completions",
         dump({**base, "messages": [{"role": "user", "content": big_text}]})),
        ("over_limit", "/tokenize", b""),  # (sent by _over_limit: headers, then a trickle)
        ("n128_stop1024", "/v1/completions",
         dump({**base, "prompt": "import os", "n": 128, "temperature": 1.0, "stop": stops})),
        ("bad_words1024", "/v1/completions",
         dump({**base, "prompt": "import os", "n": 8, "temperature": 1.0, "bad_words": words})),
        ("n128", "/v1/chat/completions",
         dump({**base, "n": 128, "temperature": 1.0,
               "messages": [{"role": "user", "content": "hello"}]})),
        ("prompts1024", "/v1/completions",
         dump({**base, "max_tokens": 2, "prompt": [f"x = {i}" for i in range(1024)]})),
        ("logprobs_long_prompt", "/v1/completions",
         dump({**base, "prompt": long_prompt, "prompt_logprobs": 20, "logprobs": 20})),
        ("stream_dropped", "/v1/completions",
         dump({**base, "prompt": "import os", "n": 128, "max_tokens": 256, "stream": True})),
        ("deep_json", "/v1/completions",
         b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b', "max_tokens": 4}'),
        ("truncated_json", "/v1/chat/completions", dump({**base, "messages": []})[:-7]),
        ("invalid_utf8", "/v1/completions", b'{"prompt": "\xff\xfe\xed\xa0\x80", "max_tokens": 4}'),
        ("int_5000_digits", "/v1/completions", b'{"prompt": "a", "max_tokens": ' + b"9" * 5000
         + b"}"),
        ("top_k_2_63", "/v1/completions",
         dump({**base, "prompt": "a", "temperature": 0.7, "top_k": 2**63})),
        ("temperature_inf", "/v1/completions", b'{"prompt": "a", "temperature": Infinity}'),
    ]


async def _over_limit(base: str, path: str, length: int) -> str:
    """Announce a body of `length` bytes and send 64 KiB of it: the server should answer 413
    without waiting for the rest. (An HTTP client sending the whole body would see the early
    answer only as a broken connection.)"""
    host, port = base.rsplit("/", 1)[-1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                     f"\r\nContent-Length: {length}\r\n\r\n".encode() + b"a" * 65536)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 10.0)
        return line.split(b" ")[1].decode() if line.startswith(b"HTTP/") else "no answer"
    except (OSError, asyncio.TimeoutError) as exc:
        return f"error {type(exc).__name__}"
    finally:
        writer.close()


async def _send_hostile(client: Any, base: str, kind: str, path: str, body: bytes,
                        body_limit: int) -> str:
    """Send one hostile request; returns its outcome (the status, 'timeout', 'error')."""
    import httpx

    if kind == "over_limit":
        return await _over_limit(base, path, body_limit + 1)
    headers = {"content-type": "application/json"}
    try:
        if kind == "stream_dropped":
            async with client.stream("POST", base + path, content=body,
                                     headers=headers) as resp:
                async for _ in resp.aiter_raw():
                    break  # (closing here drops the connection mid-stream)
                return str(resp.status_code)
        resp = await client.post(base + path, content=body, headers=headers)
        return str(resp.status_code)
    except httpx.TimeoutException:
        return "timeout"
    except httpx.HTTPError as exc:
        return f"error {type(exc).__name__}"


async def _slow_loris(host: str, port: int, headers_only: bool, hold_s: float
                      ) -> tuple[str, float]:
    """Open a connection and trickle a request a byte a second for at most `hold_s`; returns
    what the server did (answered with a status, closed, reset, or nothing: 'held') and the
    time."""
    start = time.monotonic()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000\r\n")
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        return f"connect failed ({type(exc).__name__})", time.monotonic() - start
    outcome = "held"
    try:
        if headers_only:
            writer.write(head[:20])
            trickle = head[20:]
        else:
            writer.write(head + b"\r\n{")
            trickle = b" " * 10000
        for byte in trickle:
            if time.monotonic() - start > hold_s:
                break
            writer.write(bytes([byte]))
            await writer.drain()
            try:
                data = await asyncio.wait_for(reader.read(64), 1.0)
            except asyncio.TimeoutError:
                continue
            outcome = ("answered " + data.split(b" ")[1].decode(errors="replace")
                       if data.startswith(b"HTTP/") else "closed by the server")
            break
    except OSError:
        outcome = "reset by the server"
    finally:
        writer.close()
    return outcome, time.monotonic() - start


async def _hostile_main(cfg: dict, requests: list[tuple[str, str, bytes]]) -> dict:
    """Cycle through `requests` from index cfg["first"] for cfg["duration"] s (the request
    then under way is cancelled, and recorded as such), with cfg["slow_loris"] slow-loris
    connections beside them. Returns the stats, the (kind, start, end) of every request and
    the index to go on from."""
    import httpx

    stats: dict[str, dict] = {kind: {"outcomes": {}, "times_s": []} for kind, _, _ in requests}
    intervals: list[tuple[str, float, float]] = []
    deadline = time.monotonic() + cfg["duration"]
    state = {"next": cfg["first"]}

    def record(kind: str, outcome: str, t0: float) -> None:
        entry = stats.setdefault(kind, {"outcomes": {}, "times_s": []})
        entry["outcomes"][outcome] = entry["outcomes"].get(outcome, 0) + 1
        entry["times_s"].append(time.monotonic() - t0)
        intervals.append((kind, t0, time.monotonic()))

    async def loris_slot(slot: int) -> None:
        kind = "slow_loris_headers" if slot % 2 else "slow_loris_body"
        while (left := deadline - time.monotonic()) > 1.0:
            t0 = time.monotonic()
            outcome, _ = await _slow_loris(cfg["host"], cfg["port"], slot % 2 == 1,
                                           min(SLOW_LORIS_HOLD_S, left))
            record(kind, outcome, t0)

    async def cycle() -> None:
        async with httpx.AsyncClient(timeout=HOSTILE_TIMEOUT_S) as client:
            while requests:
                kind, path, body = requests[state["next"] % len(requests)]
                t0 = time.monotonic()
                try:
                    outcome = await asyncio.wait_for(
                        _send_hostile(client, cfg["base"], kind, path, body,
                                      cfg["body_limit"]), max(0.1, deadline - t0))
                except asyncio.TimeoutError:
                    record(kind, "cancelled at the phase end", t0)
                    state["next"] += 1  # (the next phase starts with the next kind)
                    return
                record(kind, outcome, t0)
                state["next"] += 1
                # (a pause, so that most normal requests overlap one kind only)
                await asyncio.sleep(min(cfg["gap"], max(0.0, deadline - time.monotonic())))

    await asyncio.gather(cycle(), *(loris_slot(k) for k in range(cfg["slow_loris"])))
    return {"stats": stats, "intervals": intervals, "next": state["next"]}


def hostile_process(cfg: dict, ready: Any, go: Any, queue: Any) -> None:
    """The hostile client's process: builds its bodies (tens of MB of JSON: not while the
    normal clients are measured), sets `ready`, waits for `go`, runs for cfg["duration"] s,
    then puts its report on `queue`."""
    requests = [r for r in hostile_requests(cfg["model"], cfg["body_limit"])
                if cfg["kinds"] is None or r[0] in cfg["kinds"]]
    ready.set()
    go.wait()
    queue.put(asyncio.run(_hostile_main(cfg, requests)))


# ---- phases and the report -------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def run_phase(args: argparse.Namespace, base: str, port: int, model: str, specs: tuple,
              hostile_from: int | None) -> dict:
    """One phase: the normal clients for args.duration s, with the hostile client (starting
    at request `hostile_from`) unless that is None. Returns the normal clients' (start,
    result) pairs, the wall time, /health latencies and the hostile client's report."""
    proc = queue = None
    if hostile_from is not None:
        ctx = multiprocessing.get_context("spawn")
        queue, ready, go = ctx.Queue(), ctx.Event(), ctx.Event()
        cfg = {"base": base, "host": "127.0.0.1", "port": port, "model": model,
               "body_limit": int(args.max_request_body_mb * 2**20), "duration": args.duration,
               "first": hostile_from, "gap": args.hostile_gap, "slow_loris": args.slow_loris,
               "kinds": None if args.hostile_kinds == "all" else args.hostile_kinds.split(",")}
        proc = ctx.Process(target=hostile_process, daemon=True, args=(cfg, ready, go, queue))
        proc.start()
        if not ready.wait(120):
            raise RuntimeError("the hostile client did not get ready in 120 s")
        time.sleep(1.0)  # (let the machine settle after building the bodies)
        go.set()

    async def both() -> tuple:
        stop = asyncio.Event()
        probe = asyncio.create_task(probe_health(base, stop))
        results, wall = await normal_clients(base, model, specs, args.clients, args.duration,
                                             args.output_len)
        stop.set()
        return results, wall, await probe

    results, wall, health = asyncio.run(both())
    report = None
    if proc is not None:
        report = queue.get(timeout=args.duration + HOSTILE_TIMEOUT_S + 60)
        proc.join(30)
    return {"results": results, "wall_s": wall, "health_s": health, "hostile": report}


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def phase_summary(phases: list[dict]) -> dict:
    results = [r for ph in phases for _, r in ph["results"]]
    wall = sum(ph["wall_s"] for ph in phases)
    summary = summarize(results, wall, ["ttft", "e2el", "tpot"], PCTS)
    health = [h for ph in phases for h in ph["health_s"]]
    summary.update(health_probes=len(health),
                   health_p50_ms=_pct(health, 50) * 1000, health_p99_ms=_pct(health, 99) * 1000,
                   health_max_ms=max(health, default=float("nan")) * 1000)
    return summary


def merge_hostile(phases: list[dict]) -> dict:
    """Per hostile kind: outcomes, times, and the normal requests that overlapped one of its
    requests (count, E2E and TTFT p50 in ms; a normal request may overlap several kinds)."""
    merged: dict[str, dict] = {}
    for ph in phases:
        report = ph["hostile"] or {"stats": {}, "intervals": []}
        for kind, entry in report["stats"].items():
            out = merged.setdefault(kind, {"outcomes": {}, "times_s": []})
            for outcome, count in entry["outcomes"].items():
                out["outcomes"][outcome] = out["outcomes"].get(outcome, 0) + count
            out["times_s"] += entry["times_s"]
        for kind in merged:
            spans = [(a, b) for k, a, b in report["intervals"] if k == kind]
            hit = [r for t0, r in ph["results"] if r.success
                   and any(a < t0 + r.latency and t0 < b for a, b in spans)]
            out = merged[kind].setdefault("overlapping", {"e2el": [], "ttft": []})
            out["e2el"] += [r.latency * 1000 for r in hit]
            out["ttft"] += [r.ttft * 1000 for r in hit]
    for entry in merged.values():
        spans = entry.pop("overlapping", {"e2el": [], "ttft": []})
        entry["overlapping_normal"] = {"count": len(spans["e2el"]),
                                       "p50_e2el_ms": _pct(spans["e2el"], 50),
                                       "p50_ttft_ms": _pct(spans["ttft"], 50)}
    return merged


def git_commit() -> str:
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "vllm")
    return commit + (" (with uncommitted changes under vllm/)" if dirty else "")


def markdown(report: dict) -> str:
    a, alone, hostile = report["args"], report["alone"], report["hostile"]

    def row(name: str, s: dict) -> str:
        return (f"| {name} | {s['completed']} | {s['failed']} | {s['request_throughput']:.2f} | "
                f"{s['output_throughput']:.0f} | {s['p50_ttft_ms']:.0f} / {s['p90_ttft_ms']:.0f}"
                f" / {s['p99_ttft_ms']:.0f} | {s['p50_e2el_ms']:.0f} / {s['p90_e2el_ms']:.0f} / "
                f"{s['p99_e2el_ms']:.0f} | {s['health_p50_ms']:.1f} / {s['health_max_ms']:.0f} |")

    def ratio(key: str) -> str:
        return f"{hostile[key] / alone[key]:.2f}" if alone[key] else "-"

    threads = (f"OMP_NUM_THREADS={a['server_threads']}" if a["server_threads"] > 0
               else "torch's default threads")
    lines = [
        "# Normal clients beside a hostile one (`vllm serve`)", "",
        f"Commit {report['commit']}, {report['date']}; {report['machine']}; load average "
        f"{report['load_before']} before, {report['load_after']} after (other jobs shared the "
        "machine: compare the two phases, measured alternately, rather than absolute numbers)."
        "", "",
        f"Server: `vllm serve {a['model']} -O{a['level']} --max-request-body-mb "
        f"{a['max_request_body_mb']:g}{''.join(' ' + x for x in a['serve_arg'])}` with "
        f"{threads}. Normal load: {a['clients']} clients, "
        f"streaming, back to back, alternating completions and chat, ~{a['input_len']} prompt "
        f"tokens, {a['output_len']} output tokens (greedy, ignore_eos). {a['rounds']} round(s) "
        f"of {a['duration']:g} s alone then {a['duration']:g} s with the hostile client.", "",
        "| phase | requests | failed | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) | "
        "E2E p50 / p90 / p99 (ms) | /health p50 / max (ms) |",
        "|---|---|---|---|---|---|---|---|",
        row("alone", alone), row("with hostile client", hostile),
        f"| hostile / alone | | | {ratio('request_throughput')} | "
        f"{ratio('output_throughput')} | {ratio('p50_ttft_ms')} / {ratio('p90_ttft_ms')} / "
        f"{ratio('p99_ttft_ms')} | {ratio('p50_e2el_ms')} / {ratio('p90_e2el_ms')} / "
        f"{ratio('p99_e2el_ms')} | |", "",
        f"Server RSS: {report['rss_mb']['start']:.0f} MB after warm-up, "
        f"{report['rss_mb']['end']:.0f} MB at the end; /health after the run: "
        f"{report['health_after']}; server exit code {report['exit_code']}.", "",
        "## The hostile client", "",
        "One request at a time, cycling through the kinds below (each with a "
        f"{HOSTILE_TIMEOUT_S:g} s timeout, {a['hostile_gap']:g} s apart, the one under way "
        f"at a phase's end cancelled), plus up to {a['slow_loris']} slow-loris connections "
        f"held at most {SLOW_LORIS_HOLD_S:g} s each.", "",
        "The last columns: the normal requests that overlapped a request of that kind (a normal "
        "request may overlap several kinds), their E2E and TTFT p50, against "
        f"{alone['p50_e2el_ms']:.0f} / {alone['p50_ttft_ms']:.0f} ms alone.", "",
        "| kind | sent | outcomes | mean (s) | max (s) | overlapping normal requests | their "
        "E2E / TTFT p50 (ms) |", "|---|---|---|---|---|---|---|",
    ]
    for kind, entry in report["hostile_requests"].items():
        times = entry["times_s"]
        outcomes = ", ".join(f"{k} x{v}" for k, v in sorted(entry["outcomes"].items()))
        mean = sum(times) / len(times) if times else float("nan")
        near = entry["overlapping_normal"]
        lines.append(f"| {kind} | {len(times)} | {outcomes or '-'} | {mean:.2f} | "
                     f"{max(times, default=float('nan')):.2f} | {near['count']} | "
                     f"{near['p50_e2el_ms']:.0f} / {near['p50_ttft_ms']:.0f} |")
    if report["normal_errors"]:
        lines += ["", "Normal clients' errors: " + "; ".join(report["normal_errors"])]
    if a.get("note"):
        lines += ["", a["note"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--level", type=int, default=0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=20.0, help="Seconds per phase.")
    parser.add_argument("--rounds", type=int, default=2,
                        help="Alone/hostile pairs, alternated (so drift hits both).")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-request-body-mb", type=float, default=32.0,
                        help="The server's body limit (passed on); the hostile bodies are "
                        "sized from it.")
    parser.add_argument("--hostile-gap", type=float, default=0.5,
                        help="Seconds the hostile client waits between its requests (so that "
                        "the overlap columns can tell the kinds apart).")
    parser.add_argument("--hostile-kinds", default="all",
                        help="Comma-separated kinds the hostile client sends (default: all; "
                        "'none': only the slow-loris connections).")
    parser.add_argument("--slow-loris", type=int, default=SLOW_LORIS_MAX,
                        help="Slow-loris connections held open during a hostile phase.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-threads", type=int, default=1,
                        help="OMP_NUM_THREADS for the server (0: torch's default, all cores). "
                        "1 by default: on a small machine shared with the load generators (and "
                        "other jobs), more OpenMP threads than free cores make every step wait "
                        "for a descheduled thread.")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="Extra flag for `vllm serve` (repeat).")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--output-dir", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default="hostile_load")
    parser.add_argument("--note", default=None, help="A paragraph added at the end.")
    args = parser.parse_args()
    if not (args.clients >= 1 and args.duration > 0 and args.rounds >= 1):
        parser.error("--clients, --duration and --rounds must be positive")
    known = {kind for kind, _, _ in hostile_requests("m", 2**20)}
    unknown = set(args.hostile_kinds.split(",")) - known - {"all", "none"}
    if unknown:
        parser.error(f"--hostile-kinds: unknown {sorted(unknown)}; choose from {sorted(known)}")

    log_dir = tempfile.mkdtemp(prefix="bench_hostile_load_")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    load_before = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    serve_args = ["--max-request-body-mb", f"{args.max_request_body_mb:g}", *args.serve_arg]
    if args.server_threads > 0:  # (start_server passes our environment on)
        os.environ["OMP_NUM_THREADS"] = str(args.server_threads)
    proc, startup_s = start_server(args.model, args.level, port, serve_args,
                                   os.path.join(log_dir, "serve.log"), args.startup_timeout)
    print(f"server healthy after {startup_s:.1f} s (log: {log_dir}/serve.log)", flush=True)
    try:
        import httpx

        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        specs = normal_specs(args, resolve_model_path(args.model), 64)
        warm = argparse.Namespace(**{**vars(args), "duration": 3.0})
        run_phase(warm, base, port, model, specs, None)
        rss_start = rss_mb(proc.pid)
        alone: list[dict] = []
        hostile: list[dict] = []
        next_hostile = 0  # (each hostile phase goes on where the last one stopped)
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}: alone ({args.duration:g} s)", flush=True)
            alone.append(run_phase(args, base, port, model, specs, None))
            print(f"round {r + 1}/{args.rounds}: hostile ({args.duration:g} s)", flush=True)
            hostile.append(run_phase(args, base, port, model, specs, next_hostile))
            next_hostile = hostile[-1]["hostile"]["next"]
        rss_end = rss_mb(proc.pid)
        try:
            health_after = httpx.get(base + "/health", timeout=30).status_code
        except httpx.HTTPError as exc:
            health_after = f"no answer ({type(exc).__name__})"
    finally:
        code = stop_server(proc)
    errors = sorted({r.error for ph in alone + hostile for _, r in ph["results"] if r.error})
    report = {
        "args": vars(args), "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                   f"{platform.python_version()}",
        "load_before": load_before,
        "load_after": ", ".join(f"{x:.1f}" for x in os.getloadavg()),
        "startup_s": startup_s, "alone": phase_summary(alone), "hostile": phase_summary(hostile),
        "hostile_requests": merge_hostile(hostile), "rss_mb": {"start": rss_start,
                                                               "end": rss_end},
        "health_after": health_after, "exit_code": code, "normal_errors": errors[:10],
    }
    os.makedirs(args.output_dir, exist_ok=True)
    md_path = os.path.join(args.output_dir, f"{args.name}.md")
    json_path = os.path.join(args.output_dir, f"{args.name}.json")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    text = markdown(report)
    with open(md_path, "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {md_path} and {json_path}")
    ok = health_after == 200 and code == 0 and not errors
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
