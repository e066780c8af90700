"""Models named by a Hugging Face Hub repo id: resolved by huggingface_hub into the standard
cache (laid out as huggingface_hub lays it out), against a local server standing in for the
Hub (tests/hub_server.py), or read from the cache alone with HF_HUB_OFFLINE=1."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.fresh_python import run_fresh
from tests.hub_server import TOKEN, FakeHub, folder_files, hub_env, write_cache_by_hand
from tests.model_executor.hf_checkpoints import make_llama
from vllm.config import ModelConfig, VllmConfig
from vllm.transformers_utils.hub import download_weights, is_repo_id, weight_file_names

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def to_bin(src: str, dst: str) -> str:
    """A copy of the safetensors checkpoint `src` with PyTorch *.bin weights instead
    (pytorch_model.bin, or shards and pytorch_model.bin.index.json), as older checkpoints."""
    shutil.copytree(src, dst)
    index = os.path.join(dst, "model.safetensors.index.json")
    renames = {}
    for name in sorted(os.listdir(dst)):
        if name.endswith(".safetensors"):
            new = name.replace("model", "pytorch_model", 1).replace(".safetensors", ".bin")
            torch.save(load_file(os.path.join(dst, name)), os.path.join(dst, new))
            os.remove(os.path.join(dst, name))
            renames[name] = new
    if os.path.exists(index):
        data = json.load(open(index))
        data["weight_map"] = {k: renames[v] for k, v in data["weight_map"].items()}
        json.dump(data, open(os.path.join(dst, "pytorch_model.bin.index.json"), "w"))
        os.remove(index)
    return dst


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-src")
    single = make_llama(root / "single")
    both = shutil.copytree(single, root / "both")
    torch.save(load_file(os.path.join(single, "model.safetensors")),
               os.path.join(both, "pytorch_model.bin"))
    no_weights = shutil.copytree(single, root / "no-weights")
    os.remove(os.path.join(no_weights, "model.safetensors"))
    sharded = make_llama(root / "sharded", max_shard_size="40KB")
    return {"single": single, "sharded": sharded, "v1": make_llama(root / "v1", seed=1),
            "bin": to_bin(single, str(root / "bin")),
            "bin_sharded": to_bin(sharded, str(root / "bin-sharded")),
            "both": str(both), "no_weights": str(no_weights)}


@pytest.fixture(scope="module")
def hub(ckpt):
    with FakeHub() as server:
        server.shas = {
            "main": server.add_repo("org/tiny", ckpt["sharded"]),
            "v1": server.add_repo("org/tiny", ckpt["v1"], branch="v1"),
            "single": server.add_repo("org/single", ckpt["single"]),
        }
        server.add_repo("org/bin-only", ckpt["bin"])
        server.add_repo("org/bin-sharded", ckpt["bin_sharded"])
        server.add_repo("org/both", ckpt["both"])
        server.add_repo("org/no-weights", ckpt["no_weights"])
        server.add_repo("org/gated", ckpt["single"], gated=True)
        server.add_repo("org/private", ckpt["single"], private=True)
        yield server


@pytest.fixture
def online(hub, tmp_path, monkeypatch):
    """huggingface_hub pointed at the fake Hub, with an empty cache; returns the cache."""
    cache = str(tmp_path / "hf-cache")
    hub_env(monkeypatch, hub.url, cache)
    hub.requests.clear()
    hub.drop_once.clear()
    hub.drop_always.clear()
    return cache


def model_requests(hub) -> list[tuple[str, str]]:
    """The requests about models (huggingface_hub also fetches its agent registry once)."""
    return [(m, p) for m, p, _ in hub.requests if p != "/api/agent-harnesses"]


def snapshot_dir(cache: str, repo: str, sha: str) -> str:
    return os.path.join(cache, "models--" + repo.replace("/", "--"), "snapshots", sha)


# ---- names -------------------------------------------------------------------------------
def test_repo_ids_and_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    for name in ("Qwen/Qwen3-0.6B", "gpt2", "org/name.v2", "meta-llama/Llama-3.2-1B_x"):
        assert is_repo_id(name), name
    for name in ("/abs/org/name", "./org/name", "../name", "~/models/x", "a/b/c", "org\\name",
                 "models/llama", "weights.bin", "org/-bad", "org/a--b", "", "org/na me"):
        assert not is_repo_id(name), name


@pytest.mark.parametrize("name", ["./org/missing", "/no/such/org/model", "a/b/c", "~/nope-x"])
def test_mistyped_paths_stay_local_errors(name):
    with pytest.raises(ValueError, match="is not a local folder. Pass the path") as exc:
        ModelConfig(model=name)
    assert name in str(exc.value)


def test_local_folders_import_no_huggingface_hub(ckpt):
    """Config resolution of a local folder, or of a mistyped path, stays free of
    huggingface_hub (and of torch/transformers, tests/config/test_lazy_hf_config.py)."""
    code = (
        "import sys\n"
        "from vllm.config import ModelConfig, VllmConfig\n"
        f"VllmConfig(model_config=ModelConfig(model={ckpt['single']!r}), optimization_level=1)\n"
        "try:\n"
        "    ModelConfig(model='./org/missing')\n"
        "except ValueError as exc:\n"
        "    print('error:', exc)\n"
        "print(sorted(m for m in ('huggingface_hub', 'torch', 'transformers')"
        " if m in sys.modules))\n")
    out = run_fresh(code, REPO_ROOT)
    assert "is not a local folder" in out
    # A torch built for a GPU is imported to ask whether one is present (vllm.platforms).
    import torch

    gpu_build = torch.version.cuda is not None or torch.version.hip is not None
    expected = "['torch']" if gpu_build else "[]"
    assert out.strip().endswith(expected), out


def test_weight_file_rule():
    def no_index(name):
        raise AssertionError(name)

    index = {"weight_map": {"a": "model-2.safetensors", "b": "model-1.safetensors"}}
    assert weight_file_names(["model.safetensors.index.json", "model-1.safetensors",
                              "model-2.safetensors", "model-3.safetensors"],
                             lambda name: index) == ["model-1.safetensors", "model-2.safetensors"]
    assert weight_file_names(["model.safetensors", "consolidated.safetensors",
                              "pytorch_model.bin"], no_index) == ["model.safetensors"]
    assert weight_file_names(["pytorch_model.bin", "training_args.bin", "sub/x.safetensors"],
                             no_index) == ["pytorch_model.bin"]
    assert weight_file_names(["config.json", "training_args.bin"], no_index) == []


# ---- downloads ---------------------------------------------------------------------------
def test_download_into_the_hub_cache_layout(hub, online, ckpt):
    sha = hub.shas["main"]
    mc = ModelConfig(model="org/tiny", download_dir=online)
    snap = os.path.join(online, "models--org--tiny", "snapshots", sha)
    assert (mc.model, mc.served_model_names, mc.model_path) == ("org/tiny", ["org/tiny"], snap)
    assert mc.model_commit == sha and mc.tokenizer_path == snap and mc.max_model_len == 512
    assert open(os.path.join(online, "models--org--tiny", "refs", "main")).read() == sha
    # Config resolution fetched the config, tokenizer and index, not the weights.
    assert not [f for f in os.listdir(snap) if f.endswith(".safetensors")]
    assert not hub.file_gets("model-00001-of-00012.safetensors")
    assert os.path.islink(os.path.join(snap, "config.json"))
    assert os.path.realpath(os.path.join(snap, "config.json")).startswith(
        os.path.join(online, "models--org--tiny", "blobs"))
    paths = download_weights(mc.hub_snapshot, show_progress=False)
    assert len(paths) == 12
    original = folder_files(ckpt["sharded"])
    for path in paths:
        assert open(path, "rb").read() == original[os.path.basename(path)]


def test_second_start_makes_no_file_requests(hub, online, monkeypatch):
    first = ModelConfig(model="org/tiny", download_dir=online)
    download_weights(first.hub_snapshot, show_progress=False)
    assert len(hub.file_gets()) > 12
    for revision, expected in ((None, [("GET", "/api/models/org/tiny")]),
                               (hub.shas["main"], [])):
        hub.requests.clear()
        again = ModelConfig(model="org/tiny", revision=revision, download_dir=online)
        download_weights(again.hub_snapshot, show_progress=False)
        assert again.model_path == first.model_path
        assert model_requests(hub) == expected, revision
    hub_env(monkeypatch, hub.url, online, offline=True)
    hub.requests.clear()
    offline = ModelConfig(model="org/tiny", download_dir=online)
    download_weights(offline.hub_snapshot, show_progress=False)
    assert offline.model_path == first.model_path and model_requests(hub) == []


def test_branch_tag_and_commit_revisions(hub, online):
    main = ModelConfig(model="org/tiny", download_dir=online)
    v1 = ModelConfig(model="org/tiny", revision="v1", download_dir=online)
    pinned = ModelConfig(model="org/tiny", revision=hub.shas["v1"], download_dir=online)
    assert v1.model_commit == pinned.model_commit == hub.shas["v1"] != main.model_commit
    assert v1.model_path == pinned.model_path != main.model_path
    assert v1.hub_snapshot.weight_files == ("model.safetensors",)
    # Same config, other weights: a new commit must not load graphs compiled for another.
    assert v1.hf_config.to_json_string() == main.hf_config.to_json_string()
    assert v1.compute_hash() != main.compute_hash()
    assert v1.compute_hash() == pinned.compute_hash()


def test_tokenizer_revision_and_tokenizer_repo(hub, online):
    mc = ModelConfig(model="org/tiny", tokenizer_revision="v1", download_dir=online)
    assert mc.tokenizer_path == snapshot_dir(online, "org/tiny", hub.shas["v1"])
    assert not [f for f in os.listdir(mc.tokenizer_path) if f.endswith(".safetensors")]
    other = ModelConfig(model="org/tiny", tokenizer="org/single", download_dir=online)
    assert other.tokenizer_path == snapshot_dir(online, "org/single", hub.shas["single"])
    assert os.path.isfile(os.path.join(other.tokenizer_path, "tokenizer.json"))


def test_hf_token_opens_gated_and_private_repos(hub, online, monkeypatch):
    for repo in ("org/gated", "org/private"):
        with pytest.raises(ValueError, match="set HF_TOKEN"):
            ModelConfig(model=repo, download_dir=online)
    hub_env(monkeypatch, hub.url, online, token=TOKEN)
    for repo in ("org/gated", "org/private"):
        mc = ModelConfig(model=repo, download_dir=online)
        assert download_weights(mc.hub_snapshot, show_progress=False)
    auth = [p for m, p, _ in hub.requests if "/org/gated/resolve/" in p]
    assert auth  # the token went with the requests (the server refuses them without it)
    hub_env(monkeypatch, hub.url, online, token="hf_wrong")
    with pytest.raises(ValueError, match="a token is set .* cannot read this repo"):
        ModelConfig(model="org/private", download_dir=str(online) + "-other")


@pytest.mark.parametrize("model, revision, expected", [
    ("org/missing", None, "'org/missing' is neither a local folder nor a model repo on the "
     "Hugging Face Hub; if it is a private or gated repo, set HF_TOKEN"),
    ("org/gated", None, "org/gated on the Hugging Face Hub is gated: accept its terms on its "
     "Hub page, and set HF_TOKEN"),
    ("org/tiny", "nope", "Revision 'nope' does not exist in org/tiny on the Hugging Face Hub"),
    ("org/no-weights", None, "has no supported weights: no *.safetensors and no PyTorch *.bin"),
])
def test_hub_errors_are_one_line(online, model, revision, expected):
    with pytest.raises(ValueError) as exc:
        ModelConfig(model=model, revision=revision, download_dir=online)
    message = str(exc.value)
    assert expected in message and "\n" not in message, message


def test_offline_with_nothing_cached(hub, online, monkeypatch, ckpt):
    hub_env(monkeypatch, hub.url, online, offline=True)
    with pytest.raises(ValueError) as exc:
        ModelConfig(model="org/tiny", download_dir=online)
    message = str(exc.value)
    assert "Model org/tiny is not a local folder and is not (completely) in the Hugging Face " \
           f"cache {online}" in message
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in message and "\n" not in message
    assert model_requests(hub) == []
    # A cached snapshot without weights (and without huggingface_hub's file list) is
    # incomplete, not a repo without weights.
    write_cache_by_hand(online, "org/partial", ckpt["no_weights"], "ab" * 20)
    with pytest.raises(ValueError, match=r"org/partial is not a local folder and is not "
                       r"\(completely\) in the Hugging Face cache .*\(the cached snapshot holds "
                       "no weight files\\), and HF_HUB_OFFLINE=1"):
        ModelConfig(model="org/partial", download_dir=online)


def test_hub_unreachable(hub, online, monkeypatch, ckpt):
    from tests.entrypoints.server_utils import free_port

    hub_env(monkeypatch, f"http://127.0.0.1:{free_port()}", online)  # nothing listens there
    with pytest.raises(ValueError, match="the Hugging Face Hub could not be reached.* not "
                                         r"\(completely\) in the Hugging Face cache"):
        ModelConfig(model="org/tiny", download_dir=online)
    # With the branch cached, an unreachable Hub falls back to the cached commit.
    hub_env(monkeypatch, hub.url, online)
    first = ModelConfig(model="org/single", download_dir=online)
    download_weights(first.hub_snapshot, show_progress=False)
    hub_env(monkeypatch, f"http://127.0.0.1:{free_port()}", online)
    again = ModelConfig(model="org/single", download_dir=online)
    assert again.model_path == first.model_path
    assert download_weights(again.hub_snapshot, show_progress=False)


# ---- weights formats ---------------------------------------------------------------------
def _state(config: VllmConfig) -> dict[str, torch.Tensor]:
    from vllm.model_executor.model_loader import get_model

    return {k: v.clone() for k, v in get_model(config).state_dict().items()}


def test_bin_only_repos_load_like_safetensors(hub, online, ckpt):
    reference = _state(VllmConfig(model_config=ModelConfig(model=ckpt["single"]),
                                  optimization_level=0))
    for repo, weights in (("org/bin-only", ("pytorch_model.bin",)),
                          ("org/bin-sharded", None)):
        mc = ModelConfig(model=repo, download_dir=online)
        if weights is not None:
            assert mc.hub_snapshot.weight_files == weights
        else:
            assert len(mc.hub_snapshot.weight_files) > 1
            assert all(f.endswith(".bin") for f in mc.hub_snapshot.weight_files)
        state = _state(VllmConfig(model_config=mc, optimization_level=0))
        if repo == "org/bin-only":
            assert state.keys() == reference.keys()
            for key, value in reference.items():
                assert torch.equal(state[key], value), key
    # A repo with both formats: only the safetensors are fetched.
    mc = ModelConfig(model="org/both", download_dir=online)
    assert mc.hub_snapshot.weight_files == ("model.safetensors",)
    download_weights(mc.hub_snapshot, show_progress=False)
    fetched = [p.rsplit("/", 1)[-1] for p in hub.file_gets() if p.startswith("/org/both/")]
    assert "model.safetensors" in fetched and "pytorch_model.bin" not in fetched
    assert not os.path.exists(os.path.join(mc.model_path, "pytorch_model.bin"))


def test_bin_loader_in_a_local_folder(ckpt, tmp_path):
    """A local folder with only *.bin loads too (and a corrupt one is named)."""
    from vllm.model_executor.model_loader import weight_files

    folder = ckpt["bin_sharded"]
    assert [os.path.basename(f) for f in weight_files(folder)] == sorted(
        set(json.load(open(os.path.join(folder, "pytorch_model.bin.index.json")))
            ["weight_map"].values()))
    broken = shutil.copytree(ckpt["bin"], tmp_path / "broken")
    (broken / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot read PyTorch weight file .*pytorch_model.bin"):
        _state(VllmConfig(model_config=ModelConfig(model=str(broken)), optimization_level=0))


# ---- interrupted downloads ---------------------------------------------------------------
def test_connection_dropped_mid_file_resumes(hub, online, ckpt, monkeypatch):
    from huggingface_hub import constants

    # huggingface_hub counts the bytes it read in chunks (10 MB): small ones for a small file.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 256)
    victim = "model-00003-of-00012.safetensors"
    hub.drop_once[victim] = 1000
    mc = ModelConfig(model="org/tiny", download_dir=online)
    paths = download_weights(mc.hub_snapshot, show_progress=False)
    assert open(os.path.join(mc.model_path, victim), "rb").read() == \
        folder_files(ckpt["sharded"])[victim]
    # huggingface_hub resumed in the same call, from the last whole chunk it had read.
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith(victim)]
    assert len(ranges) == 2 and ranges[0] is None, ranges
    assert ranges[1] in ("bytes=768-", "bytes=1000-"), ranges
    assert len(paths) == 12


def test_failed_download_leaves_the_cache_usable(hub, online, ckpt, monkeypatch):
    import huggingface_hub.file_download as file_download

    monkeypatch.setattr(file_download.time, "sleep", lambda s: None)  # its retry pauses
    victim = "model-00005-of-00012.safetensors"
    hub.drop_always[victim] = 0
    mc = ModelConfig(model="org/tiny", download_dir=online)
    with pytest.raises(ValueError) as exc:
        download_weights(mc.hub_snapshot, show_progress=False)
    message = str(exc.value)
    assert "Downloading org/tiny from the Hugging Face Hub failed" in message
    assert "run again to fetch the rest" in message and "\n" not in message
    blobs = os.path.join(online, "models--org--tiny", "blobs")
    assert not [f for f in os.listdir(blobs) if f.endswith(".incomplete")]
    assert not os.path.exists(os.path.join(mc.model_path, victim))
    del hub.drop_always[victim]
    hub.requests.clear()
    again = ModelConfig(model="org/tiny", download_dir=online)
    download_weights(again.hub_snapshot, show_progress=False)
    original = folder_files(ckpt["sharded"])
    for name in again.hub_snapshot.weight_files:
        assert open(os.path.join(again.model_path, name), "rb").read() == original[name]
    fetched = {p.rsplit("/", 1)[-1] for p in hub.file_gets()}
    assert victim in fetched and len(fetched) < 12  # only what was missing


# ---- end to end --------------------------------------------------------------------------
PROMPTS = ["Hello world", "The quick brown fox"]


@pytest.fixture(scope="module")
def reference_tokens(ckpt):
    from vllm import LLM, SamplingParams

    llm = LLM(model=ckpt["sharded"], optimization_level=0, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_llm_generates_from_a_download_and_offline_from_a_hand_made_cache(
        hub, online, ckpt, reference_tokens, monkeypatch, tmp_path):
    from vllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6)
    llm = LLM(model="org/tiny", download_dir=online, optimization_level=0, max_model_len=256)
    assert llm.llm_engine.model_config.served_model_names == ["org/tiny"]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] \
        == reference_tokens
    # A cache laid out by hand (no trees/ listing), read with HF_HUB_OFFLINE=1 and nothing
    # listening at HF_ENDPOINT.
    cache = str(tmp_path / "by-hand")
    commit = "0123456789abcdef0123456789abcdef01234567"
    write_cache_by_hand(cache, "org/hand", ckpt["sharded"], commit)
    hub_env(monkeypatch, "http://127.0.0.1:9", cache, offline=True)
    llm = LLM(model="org/hand", optimization_level=0, max_model_len=256)
    mc = llm.llm_engine.model_config
    assert mc.model_commit == commit and mc.model_path == snapshot_dir(cache, "org/hand", commit)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] \
        == reference_tokens
