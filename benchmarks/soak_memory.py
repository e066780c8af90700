"""Soak test of `vllm serve`'s memory: after a warm-up, thousands of mixed requests, with the
server's RSS sampled all along; the verdict is whether it stays flat.

A real server process (`vllm serve MODEL -O<level>`, prefix caching off by default, as in
issue 18) is started on 127.0.0.1 at a free port. Clients (threads, keep-alive connections,
loopback only) send a deterministic mix: /v1/completions and /v1/chat/completions, streamed
and not, n=1 and n=2, greedy and random sampling (temperature 0.8, no seed), prompts of 1..40
words and 1..8 output tokens, so the per-step token counts keep changing. The server's RSS
(VmRSS of the process and its children, /proc) is sampled every `--sample-s` seconds.

Verdict: flat when every sample after the warm-up stays within +-`--tolerance-pct` (5%) of
the RSS at the end of the warm-up. Also reported: the least-squares slope in MB per 1000
requests after the warm-up, and RSS at every `--report-every` requests. The run is bounded:
`--num-requests` after `--warmup` requests, and `--max-seconds` overall (a run cut short says
so and is not called flat). Results go to `<output-dir>/<name>.md` and `<name>.json`.

    python benchmarks/soak_memory.py                           # demo model, -O0, 5000 requests
    python benchmarks/soak_memory.py --num-requests 1000 --warmup 200 --name soak_quick
    python benchmarks/soak_memory.py --source-dir /tmp/old-tree --name soak_before
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from bench_serve_levels import stop_server  # (benchmarks/ is the script's directory)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

WORDS = ("the engine schedules tokens for every request in a batch while the cache keeps keys "
         "and values of earlier steps so decoding reads them back instead of computing again "
         "a story about a small robot who learns to paint the sea at night").split()


# ---- the server ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, log_path: str) -> subprocess.Popen:
    """Start `vllm serve` from `args.source_dir` and wait for /health (at most
    `args.startup_timeout` seconds)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model,
           f"-O{args.level}", "--host", "127.0.0.1", "--port", str(port),
           "--disable-uvicorn-access-log",
           "--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching",
           *args.server_arg]
    env = dict(os.environ, PYTHONPATH=args.source_dir + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    log = open(log_path, "w")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=args.source_dir)
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server was not healthy after {args.startup_timeout} s; "
                       f"see {log_path}")


def process_tree_rss_kb(pid: int) -> int:
    """VmRSS of `pid` and its descendants, in kB (0 once it is gone)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


# ---- the load ------------------------------------------------------------------------------
@dataclass
class Load:
    """Shared state of the client threads."""

    total: int
    deadline: float
    next_index: int = 0
    done: int = 0
    errors: list[str] = field(default_factory=list)
    by_kind: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> int | None:
        with self.lock:
            if self.next_index >= self.total or time.monotonic() > self.deadline:
                return None
            self.next_index += 1
            return self.next_index - 1


def make_request(index: int, seed: int, model: str) -> tuple[str, dict, str]:
    """(path, body, kind) of request `index`: every combination of route, stream, n and
    sampling in turn, prompt length and output budget drawn from `seed`."""
    rng = random.Random(seed * 1_000_003 + index)
    chat, stream, n, greedy = index % 2, (index // 2) % 2, 1 + (index // 4) % 2, (index // 8) % 2
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    body = {"model": model, "max_tokens": rng.randint(1, 8), "n": n, "stream": bool(stream),
            "temperature": 0.0 if greedy else 0.8}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    kind = (f"{'chat' if chat else 'completions'} {'stream' if stream else 'json'} n={n} "
            f"{'greedy' if greedy else 'random'}")
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, kind


def client(port: int, load: Load, seed: int, model: str, offset: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    while (index := load.take()) is not None:
        path, body, kind = make_request(offset + index, seed, model)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            ok = resp.status == 200 and (not body["stream"] or data.rstrip().endswith(
                b"data: [DONE]"))
            error = None if ok else f"{kind}: HTTP {resp.status} {data[:200]!r}"
        except (OSError, http.client.HTTPException) as e:
            error = f"{kind}: {type(e).__name__}: {e}"
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        with load.lock:
            load.done += 1
            load.by_kind[kind] = load.by_kind.get(kind, 0) + 1
            if error is not None:
                load.errors.append(error)


def run_phase(port: int, args: argparse.Namespace, total: int, offset: int, deadline: float,
              on_sample) -> Load:
    """Send `total` requests from `args.concurrency` clients; call `on_sample(load)` every
    `args.sample_s` seconds meanwhile."""
    load = Load(total=total, deadline=deadline)
    threads = [threading.Thread(target=client, args=(port, load, args.seed, args.served_model,
                                                     offset), daemon=True)
               for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        on_sample(load)
        for t in threads:
            t.join(args.sample_s / len(threads))
    on_sample(load)
    return load


# ---- analysis and report -------------------------------------------------------------------
def slope_mb_per_1000(samples: list[dict]) -> float | None:
    """Least-squares slope of RSS (MB) over requests done, per 1000 requests."""
    xs = [s["requests"] for s in samples]
    ys = [s["rss_mb"] for s in samples]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def analyse(samples: list[dict], warmup_rss: float, tolerance_pct: float,
            complete: bool) -> dict:
    after = [s for s in samples if s["phase"] == "soak"]
    rss = [s["rss_mb"] for s in after] or [warmup_rss]
    deviation = max(abs(r - warmup_rss) for r in rss) / warmup_rss * 100
    return {"rss_after_warmup_mb": round(warmup_rss, 1), "rss_end_mb": round(rss[-1], 1),
            "rss_min_mb": round(min(rss), 1), "rss_max_mb": round(max(rss), 1),
            "max_deviation_pct": round(deviation, 2),
            "slope_mb_per_1000_requests": (None if (s := slope_mb_per_1000(after)) is None
                                           else round(s, 2)),
            "flat": complete and deviation <= tolerance_pct}


def checkpoints(samples: list[dict], every: int) -> list[dict]:
    """The first sample at or past each multiple of `every` soak requests."""
    rows, target = [], 0
    for s in samples:
        if s["phase"] == "soak" and s["requests"] >= target:
            rows.append(s)
            target = (s["requests"] // every + 1) * every
    return rows


def markdown(result: dict) -> str:
    a, cfg = result["analysis"], result["config"]
    verdict = "flat" if a["flat"] else "NOT flat"
    lines = [
        f"# Soak: `vllm serve {cfg['model']} -O{cfg['level']}` memory over "
        f"{result['soak_requests_done']} requests",
        "",
        f"Verdict: **{verdict}** (every RSS sample after the warm-up within "
        f"+-{cfg['tolerance_pct']}% of {a['rss_after_warmup_mb']} MB: max deviation "
        f"{a['max_deviation_pct']}%); slope after the warm-up "
        f"{a['slope_mb_per_1000_requests']} MB per 1000 requests.",
        "",
        f"- source: `{cfg['source_dir']}` ({result['source_commit']}), prefix caching "
        f"{'on' if cfg['prefix_caching'] else 'off'}, extra server args: "
        f"{' '.join(cfg['server_arg']) or 'none'}",
        f"- load: {cfg['warmup']} warm-up + {cfg['num_requests']} requests, "
        f"{cfg['concurrency']} keep-alive clients on 127.0.0.1, seed {cfg['seed']}; "
        "completions and chat x stream and not x n=1 and 2 x greedy and random "
        "(temperature 0.8, no seed); 1..40-word prompts, 1..8 output tokens",
        f"- took {result['warmup_seconds']:.0f} s warm-up + {result['soak_seconds']:.0f} s "
        f"soak; failed requests: {len(result['errors'])}; server exit code "
        f"{result['server_exit_code']}; "
        f"{'complete' if result['complete'] else 'CUT SHORT by --max-seconds'}",
        f"- machine: {result['machine']}",
        "",
        "| requests after warm-up | seconds | RSS (MB) | vs. end of warm-up |",
        "|---:|---:|---:|---:|",
    ]
    base = a["rss_after_warmup_mb"]
    for s in result["checkpoints"]:
        lines.append(f"| {s['requests']} | {s['t']:.0f} | {s['rss_mb']:.1f} | "
                     f"{(s['rss_mb'] - base) / base * 100:+.2f}% |")
    lines += ["", "| request kind | count |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(result["requests_by_kind"].items())]
    if result["errors"]:
        lines += ["", "First errors:", ""] + [f"- `{e}`" for e in result["errors"][:10]]
    return "\n".join(lines) + "\n"


def git_commit(path: str) -> str:
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--served-model", default=None,
                   help="The model name requests carry (default: --model).")
    p.add_argument("--level", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--prefix-caching", action="store_true",
                   help="Leave prefix caching on (default: off, as in issue 18).")
    p.add_argument("--server-arg", action="append", default=[],
                   help="An extra argument for `vllm serve` (repeatable).")
    p.add_argument("--source-dir", default=REPO,
                   help="The source tree the server runs from (default: this checkout).")
    p.add_argument("--source-label", default=None,
                   help="What --source-dir is, for the report (default: its git commit).")
    p.add_argument("--num-requests", type=int, default=5000)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-s", type=float, default=1.0)
    p.add_argument("--report-every", type=int, default=500)
    p.add_argument("--tolerance-pct", type=float, default=5.0)
    p.add_argument("--max-seconds", type=float, default=3600.0,
                   help="Stop sending after this long (the run is then not called flat).")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--output-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default="soak_memory")
    args = p.parse_args()
    for name in ("num_requests", "warmup", "concurrency", "report_every"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    args.served_model = args.served_model or args.model
    args.source_dir = os.path.abspath(args.source_dir)
    os.makedirs(args.output_dir, exist_ok=True)

    port = free_port()
    log_dir = tempfile.mkdtemp(prefix="vllm-soak-")
    log_path = os.path.join(log_dir, "server.log")
    started = time.monotonic()
    deadline = started + args.max_seconds
    proc = start_server(args, port, log_path)
    samples: list[dict] = []
    phase = {"name": "warmup", "offset": 0, "t0": time.monotonic()}

    def sample(load: Load) -> None:
        rss = process_tree_rss_kb(proc.pid) / 1024
        samples.append({"phase": phase["name"], "requests": load.done,
                        "t": round(time.monotonic() - phase["t0"], 1), "rss_mb": round(rss, 1)})

    try:
        print(f"server pid {proc.pid} on 127.0.0.1:{port}, RSS "
              f"{process_tree_rss_kb(proc.pid) / 1024:.1f} MB; warm-up {args.warmup} requests",
              flush=True)
        warm = run_phase(port, args, args.warmup, 0, deadline, sample)
        warmup_seconds = time.monotonic() - phase["t0"]
        warmup_rss = process_tree_rss_kb(proc.pid) / 1024
        print(f"warm-up done in {warmup_seconds:.0f} s, RSS {warmup_rss:.1f} MB; soak "
              f"{args.num_requests} requests", flush=True)
        phase.update(name="soak", t0=time.monotonic())
        last_report = [0]

        def sample_and_report(load: Load) -> None:
            sample(load)
            if load.done >= last_report[0] + args.report_every:
                last_report[0] = load.done // args.report_every * args.report_every
                print(f"  {load.done:6d} requests {samples[-1]['t']:7.0f} s  RSS "
                      f"{samples[-1]['rss_mb']:.1f} MB", flush=True)

        soak = run_phase(port, args, args.num_requests, args.warmup, deadline,
                         sample_and_report)
        soak_seconds = time.monotonic() - phase["t0"]
    finally:
        code = stop_server(proc)
    complete = soak.done == args.num_requests
    by_kind: dict[str, int] = {}
    for load in (warm, soak):
        for k, v in load.by_kind.items():
            by_kind[k] = by_kind.get(k, 0) + v
    result = {
        "config": {k: getattr(args, k) for k in (
            "model", "level", "prefix_caching", "server_arg", "source_dir", "num_requests",
            "warmup", "concurrency", "seed", "sample_s", "tolerance_pct", "max_seconds")},
        "source_commit": args.source_label or git_commit(args.source_dir),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "warmup_seconds": round(warmup_seconds, 1), "soak_seconds": round(soak_seconds, 1),
        "soak_requests_done": soak.done, "complete": complete, "server_exit_code": code,
        "errors": warm.errors + soak.errors, "requests_by_kind": by_kind,
        "analysis": analyse(samples, warmup_rss, args.tolerance_pct, complete),
        "checkpoints": checkpoints(samples, args.report_every), "samples": samples,
    }
    with open(os.path.join(args.output_dir, f"{args.name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = markdown(result)
    with open(os.path.join(args.output_dir, f"{args.name}.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"server log: {log_path}")
    return 0 if result["analysis"]["flat"] and not result["errors"] and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
