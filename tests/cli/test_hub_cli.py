"""Hub repo ids on the command line: `vllm config` names the resolved commit, errors are one
line with exit code 2 (vllm config, vllm serve, python -m vllm.entrypoints.api_server), and
`vllm serve ORG/NAME` serves the model under its repo id. The Hub is tests/hub_server.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.entrypoints.server_utils import REPO, RemoteServer, free_port
from tests.hub_server import FakeHub, hub_env, subprocess_env
from tests.model_executor.hf_checkpoints import make_llama
from vllm.entrypoints.cli import main as cli_main


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    src = make_llama(tmp_path_factory.mktemp("hub-cli") / "tiny")
    with FakeHub() as server:
        server.sha = server.add_repo("org/tiny", src)
        yield server


@pytest.fixture
def cache(hub, tmp_path, monkeypatch):
    path = str(tmp_path / "hf-cache")
    hub_env(monkeypatch, hub.url, path)
    return path


def one_error_line(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        cli_main.main(list(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_vllm_config_names_the_commit(hub, cache, capsys):
    assert cli_main.main(["config", "--model", "org/tiny"]) == 0
    out = capsys.readouterr().out
    snapshot = os.path.join(cache, "models--org--tiny", "snapshots", hub.sha)
    assert (f"Model org/tiny from the Hugging Face Hub: revision main = commit {hub.sha} "
            f"(snapshot {snapshot})") in out.splitlines()
    assert cli_main.main(["config", "--model", "org/tiny", "--revision", hub.sha, "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["model_config.hub_commit"]["value"] == hub.sha
    # vllm config fetched no weights
    assert not hub.file_gets("model.safetensors")


@pytest.mark.parametrize("argv, expected", [
    (["--model", "org/missing"], "vllm config: error: Model 'org/missing' is neither a local "
     "folder nor a model repo on the Hugging Face Hub"),
    (["--model", "org/tiny", "--revision", "nope"], "vllm config: error: Revision 'nope' does "
     "not exist in org/tiny"),
    (["--model", "./org/tiny"], "vllm config: error: Model './org/tiny' is not a local folder"),
])
def test_vllm_config_errors(cache, capsys, argv, expected):
    assert one_error_line(capsys, "config", *argv).startswith(expected)


def test_offline_error(hub, cache, capsys, monkeypatch):
    hub_env(monkeypatch, hub.url, cache, offline=True)
    line = one_error_line(capsys, "config", "--model", "org/tiny")
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in line


@pytest.mark.parametrize("module, args", [
    ("vllm.entrypoints.api_server", ["--model", "org/missing"]),
    ("vllm.entrypoints.cli.main", ["serve", "org/missing"]),
])
def test_servers_exit_2_with_one_line(hub, tmp_path, module, args):
    env = subprocess_env(hub.url, str(tmp_path / "cache"))
    env["PYTHONPATH"] = REPO
    result = subprocess.run([sys.executable, "-m", module, *args, "--port", str(free_port())],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "error: Model 'org/missing' is neither a local folder nor a model repo" in last


@pytest.mark.slow
def test_vllm_serve_a_repo_id_then_again_offline(hub, tmp_path):
    """The server reports the repo id (not the snapshot folder) in /v1/models and responses;
    a second start with HF_HUB_OFFLINE=1 serves from the cache without a request."""
    cache = str(tmp_path / "cache")
    for offline in (False, True):
        hub.requests.clear()
        server = RemoteServer("vllm.entrypoints.cli.main",
                              ["serve", "org/tiny", "-O0", "--max-model-len", "256"],
                              env=subprocess_env(hub.url, cache, offline=offline),
                              log_dir=str(tmp_path))
        try:
            models = httpx.get(server.url + "/v1/models", timeout=10).json()
            assert [m["id"] for m in models["data"]] == ["org/tiny"]
            reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "org/tiny", "prompt": "Hello", "max_tokens": 2}).json()
            assert reply["model"] == "org/tiny"
            log = server.log()
        finally:
            server.stop()
        assert f"revision main is commit {hub.sha}" in log
        requests = [p for _, p, _ in hub.requests if p != "/api/agent-harnesses"]
        if offline:
            assert requests == []
        else:
            assert any(p.endswith("/model.safetensors") for p in requests)


@pytest.mark.slow
def test_upstream_example_command_gpt2_repo_through_the_simple_server(tmp_path):
    """Upstream's optimization-level example, `python -m vllm.entrypoints.api_server --model
    microsoft/DialoGPT-medium -O0`: a GPT-2 checkpoint under that repo id on the stand-in Hub,
    downloaded and served by the simple /generate server; and its chat endpoint on the OpenAI
    server answers 400 naming --chat-template (GPT-2's tokenizer has no chat template)."""
    from tests.model_executor.hf_checkpoints import make_gpt2

    src = make_gpt2(tmp_path / "dialogpt")
    # No chat template, as GPT-2's tokenizer.
    if os.path.exists(os.path.join(src, "chat_template.jinja")):
        os.remove(os.path.join(src, "chat_template.jinja"))
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    tokenizer_config.pop("chat_template", None)
    with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(src).chat_template is None
    cache = str(tmp_path / "cache")
    with FakeHub() as hub:
        hub.add_repo("microsoft/DialoGPT-medium", src)
        env = subprocess_env(hub.url, cache)
        server = RemoteServer("vllm.entrypoints.api_server",
                              ["--model", "microsoft/DialoGPT-medium", "-O0",
                               "--max-model-len", "128"], env=env, log_dir=str(tmp_path))
        try:
            reply = httpx.post(server.url + "/generate", timeout=60, json={
                "prompt": "Hello", "max_tokens": 4, "temperature": 0})
            assert reply.status_code == 200, reply.text
            assert reply.json()["text"][0].startswith("Hello")
        finally:
            server.stop()
        server = RemoteServer("vllm.entrypoints.cli.main",
                              ["serve", "microsoft/DialoGPT-medium", "-O0", "--max-model-len",
                               "128"], env=subprocess_env(hub.url, cache, offline=True),
                              log_dir=str(tmp_path))
        try:
            reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
                "model": "microsoft/DialoGPT-medium",
                "messages": [{"role": "user", "content": "Hi"}]})
            assert reply.status_code == 400, reply.text
            assert "--chat-template" in reply.json()["error"]["message"]
        finally:
            server.stop()
