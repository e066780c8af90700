"""The curl line `vllm serve` prints at start-up names the served model and the address."""
from __future__ import annotations

import json
import shlex

from vllm.entrypoints.openai.api_server import example_curl


def test_example_curl_is_a_valid_request():
    words = shlex.split(example_curl("demo", "127.0.0.1", 8123, api_key=None))
    assert words[:2] == ["curl", "-s"] and "http://127.0.0.1:8123/v1/completions" in words
    body = json.loads(words[words.index("-d") + 1])
    assert body["model"] == "demo" and body["max_tokens"] > 0
    assert "Authorization: Bearer $VLLM_API_KEY" in example_curl("m", "h", 1, api_key="k")
