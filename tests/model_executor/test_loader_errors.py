"""Bad checkpoints and configs fail with a clear ValueError naming the file or tensor."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model_executor.hf_checkpoints import make_llama, make_mixtral
from vllm.config import ModelConfig, VllmConfig
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.registry import ModelRegistry


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    return {"llama": make_llama(root / "llama", tokenizer=False),
            "mixtral": make_mixtral(root / "mixtral", tokenizer=False, num_hidden_layers=1),
            "sharded": make_llama(root / "sharded", tokenizer=False, max_shard_size="60KB")}


def copy(pristine, name, tmp_path):
    target = tmp_path / name
    shutil.copytree(pristine[name], target)
    return str(target)


def load(path, **kwargs):
    config = VllmConfig(model_config=ModelConfig(model=path, dtype="float32"),
                        optimization_level=0)
    return get_model(config, **kwargs)


def edit_weights(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_unsupported_architecture(pristine, tmp_path):
    path = copy(pristine, "llama", tmp_path)
    config_file = os.path.join(path, "config.json")
    config = json.loads(open(config_file).read())
    config["architectures"] = ["FooForCausalLM"]
    open(config_file, "w").write(json.dumps(config))
    with pytest.raises(ValueError, match=r"FooForCausalLM.*not supported.*LlamaForCausalLM"):
        load(path)


def test_missing_weight_files(pristine, tmp_path):
    path = copy(pristine, "llama", tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"no \*\.safetensors weight files"):
        load(path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(pristine, tmp_path, damage):
    path = copy(pristine, "llama", tmp_path)
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    data = b"\x07not a safetensors file" * 10 if damage == "garbage" else data[:len(data) // 2]
    open(file, "wb").write(data)
    with pytest.raises(ValueError, match=r"model\.safetensors.*corrupt or truncated"):
        load(path)


def test_missing_tensor_is_named(pristine, tmp_path):
    path = copy(pristine, "llama", tmp_path)
    edit_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors.*model\.layers\.1\.self_attn\.k_proj"):
        load(path)


def test_missing_expert_is_named(pristine, tmp_path):
    path = copy(pristine, "mixtral", tmp_path)
    edit_weights(path, lambda t: t.pop("model.layers.0.block_sparse_moe.experts.1.w3.weight"))
    with pytest.raises(ValueError, match=r"block_sparse_moe\.experts\.1\.w3\.weight"):
        load(path)


def test_unexpected_tensor_is_named(pristine, tmp_path):
    path = copy(pristine, "llama", tmp_path)
    edit_weights(path, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight'"
                                         r".*model\.safetensors"):
        load(path)


def test_wrong_shape_is_named(pristine, tmp_path):
    path = copy(pristine, "llama", tmp_path)
    edit_weights(path, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"shape \(3,\).*model\.norm\.weight"):
        load(path)


def test_index_naming_a_missing_shard(pristine, tmp_path):
    path = copy(pristine, "sharded", tmp_path)
    index = json.loads(open(os.path.join(path, "model.safetensors.index.json")).read())
    victim = sorted(set(index["weight_map"].values()))[-1]
    os.remove(os.path.join(path, victim))
    with pytest.raises(ValueError, match=f"do not exist.*{victim}"):
        load(path)


def test_unknown_load_format(pristine):
    with pytest.raises(ValueError, match="load_format 'pt' is not supported"):
        load(pristine["llama"], load_format="pt")


def test_registry_lists_and_registers():
    archs = ModelRegistry.get_supported_archs()
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "MixtralForCausalLM"):
        assert name in archs
    cls, arch = ModelRegistry.resolve_model_cls(["Unknown", "Qwen2ForCausalLM"])
    assert arch == "Qwen2ForCausalLM" and cls.__name__ == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match="Supported architectures"):
        ModelRegistry.resolve_model_cls([])


def test_loading_warns_about_custom_ops_the_model_lacks(pristine, caplog):
    import logging

    from vllm.config import CompilationConfig

    config = VllmConfig(model_config=ModelConfig(model=pristine["llama"], dtype="float32"),
                        compilation_config=CompilationConfig(custom_ops=["+rms_norm",
                                                                         "+rms_nrom"]),
                        optimization_level=0)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        get_model(config)
    assert "'rms_nrom' is not present in the model" in caplog.text
    assert "'rms_norm' is not present" not in caplog.text
