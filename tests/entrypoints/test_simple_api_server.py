"""`python -m vllm.entrypoints.api_server`: /generate (JSON and null-byte separated stream) and
/health, as a real process; SIGTERM exits 0."""
from __future__ import annotations

import json

import httpx
import pytest
from server_utils import RemoteServer

pytestmark = pytest.mark.slow

PROMPT = "Hello world"


@pytest.fixture(scope="module")
def server(llama_path, tmp_path_factory):
    srv = RemoteServer("vllm.entrypoints.api_server",
                       ["--model", llama_path, "-O0", "--kv-cache-memory", "2MiB"],
                       log_dir=str(tmp_path_factory.mktemp("logs")))
    yield srv
    assert srv.stop() == 0, srv.log()


def generate(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=body, timeout=60)


def test_health(server):
    assert httpx.get(server.url + "/health").status_code == 200


def test_generate(server):
    resp = generate(server, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "n": 2})
    assert resp.status_code == 200
    texts = resp.json()["text"]
    assert len(texts) == 2 and all(t.startswith(PROMPT) for t in texts)
    assert texts[0] == texts[1] and len(texts[0]) > len(PROMPT)


def test_generate_stream(server):
    # Long enough to stream in several chunks: the stream sends the newest cumulative output,
    # so a few tokens generated between two reads arrive as one chunk.
    body = {"prompt": PROMPT, "max_tokens": 256, "temperature": 0, "ignore_eos": True}
    final = generate(server, body).json()
    with httpx.stream("POST", server.url + "/generate", timeout=60,
                      json={**body, "stream": True}) as resp:
        raw = b"".join(resp.iter_bytes())
    assert raw.endswith(b"\0")
    chunks = [json.loads(part) for part in raw.decode().split("\0") if part]
    assert len(chunks) >= 2
    assert all(c["text"][0].startswith(PROMPT) for c in chunks)
    assert chunks[-1] == final


@pytest.mark.parametrize("body, param", [
    ({"prompt": 3}, "prompt"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "stream": "no"}, "stream"),
    ({"prompt": "a", "bogus": 1}, "bogus"),
    ({"prompt": "a", "n": 129}, "n"),
])
def test_bad_requests(server, body, param):
    resp = generate(server, body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200
