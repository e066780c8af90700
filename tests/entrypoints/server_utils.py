"""Servers for tests: an app served by uvicorn in a thread (fake engine, fast), and a real
`vllm serve` / api_server subprocess on a free loopback port."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Run `app` with uvicorn in a background thread; yields the base URL."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


class RemoteServer:
    """`python -m <module> <args>` on a free port; waits for /health.

    module: "vllm.entrypoints.cli.main" (with args starting "serve", ...) or
    "vllm.entrypoints.api_server". The log goes to a file (`self.log_path`).
    """

    def __init__(self, module: str, args: list[str], env: dict[str, str] | None = None,
                 startup_timeout: float = 240.0, log_dir: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = dict(os.environ)
        full_env.update({"PYTHONPATH": REPO + os.pathsep + full_env.get("PYTHONPATH", ""),
                         "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                         "PYTHONUNBUFFERED": "1"})
        full_env.update(env or {})
        self.log_path = os.path.join(log_dir or "/tmp", f"vllm-test-server-{self.port}.log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", module, *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=REPO)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-6000:]

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def spawned_children(pid: int) -> list[int]:
    """`pid`'s children running spawn_main (the resource tracker left out)."""
    children: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):  # (the engine thread started them)
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children.update(int(c) for c in f.read().split())
    spawned = []
    for child in sorted(children):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            spawned.append(child)
    return spawned
