"""The servers over an engine-core process (VLLM_ENABLE_MULTIPROCESSING=1): the core process
killed -> the streams in flight end with an error, the server exits 1 by itself; SIGTERM ->
the server drains, exits 0 and leaves no core process behind. Real processes: slow."""
from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest
from server_utils import RemoteServer, spawned_children

pytestmark = pytest.mark.slow

MP = {"VLLM_ENABLE_MULTIPROCESSING": "1"}
SMALL = ["-O0", "--max-model-len", "512", "--kv-cache-memory", "32MiB"]


def core_pid(server_pid: int) -> int:
    """The server's engine-core process: its one spawned child (spawn_main)."""
    cores = spawned_children(server_pid)
    assert len(cores) == 1, cores
    return cores[0]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("module, args, path", [
    ("vllm.entrypoints.cli.main", ["serve", "demo"], "/v1/completions"),
    ("vllm.entrypoints.api_server", ["--model", "demo"], "/generate"),
], ids=["vllm-serve", "api_server"])
def test_killing_the_core_process_fails_streams_and_exits_1(module, args, path, tmp_path):
    server = RemoteServer(module, [*args, *SMALL], env=MP, log_dir=str(tmp_path))
    try:
        pid = core_pid(server.proc.pid)
        assert f"Engine core running in process {pid}" in server.log()
        body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        if path == "/v1/completions":
            body["temperature"] = 0
        seen: list[str] = []
        killed = threading.Event()

        def stream():
            try:
                with httpx.stream("POST", server.url + path, json=body, timeout=60) as resp:
                    # (/generate separates its chunks with NUL, the OpenAI server with lines)
                    for piece in resp.iter_text():
                        seen.extend(p for p in piece.replace("\0", "\n").splitlines()
                                    if p.strip())
                        if len(seen) >= 3 and not killed.is_set():
                            os.kill(pid, signal.SIGKILL)
                            killed.set()
            except httpx.HTTPError as exc:  # the server may close the connection
                seen.append(f"closed: {exc!r}")

        thread = threading.Thread(target=stream)
        thread.start()
        assert killed.wait(120), server.log()
        code = server.proc.wait(timeout=60)
        thread.join(30)
        log = server.log()
        assert code == 1, log
        assert f"pid {pid}" in log and "exit code 1" in log
        assert not any(line.endswith("[DONE]") for line in seen) or any(
            "error" in line for line in seen), seen
    finally:
        server.stop()


def test_sigterm_stops_the_core_process_too(tmp_path):
    server = RemoteServer("vllm.entrypoints.cli.main", ["serve", "demo", *SMALL], env=MP,
                          log_dir=str(tmp_path))
    try:
        pid = core_pid(server.proc.pid)
        resp = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": "def f(", "max_tokens": 5, "temperature": 0, "stop": ["zzzz"]})
        assert resp.status_code == 200 and len(json.loads(resp.text)["choices"]) == 1
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert "vllm:num_requests_running" in metrics
    finally:
        code = server.stop()
    assert code == 0
    assert not alive(pid)
