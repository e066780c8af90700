"""ModelConfig: reading a local Hugging Face folder, dtype, length, is_quantized, is_moe."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from tests.config import model_configs
from vllm.config import ModelConfig, VllmConfig
from vllm.config.model import demo_model_path


@pytest.fixture
def llama_dir(tmp_path):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                      max_position_embeddings=300, architectures=["LlamaForCausalLM"],
                      torch_dtype="bfloat16")
    cfg.save_pretrained(tmp_path)
    return tmp_path


def test_reads_local_folder(llama_dir):
    mc = ModelConfig(model=str(llama_dir))
    assert mc.architectures == ["LlamaForCausalLM"]
    assert mc.max_model_len == 300
    assert mc.get_num_kv_heads() == 2 and mc.get_head_size() == 16
    assert mc.tokenizer == str(llama_dir)
    assert not mc.is_quantized and not mc.is_moe


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(ValueError, match="is not a local folder"):
        ModelConfig(model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="has no config.json"):
        ModelConfig(model=str(tmp_path))


def test_max_model_len(llama_dir):
    assert ModelConfig(model=str(llama_dir), max_model_len=128).max_model_len == 128
    with pytest.raises(ValueError, match="max_model_len=301 is longer"):
        ModelConfig(model=str(llama_dir), max_model_len=301)
    with pytest.raises(ValueError, match="max_model_len must be a positive integer"):
        ModelConfig(model=str(llama_dir), max_model_len=0)


@pytest.mark.parametrize("platform", ["cpu"], indirect=True)
def test_auto_dtype_on_cpu(llama_dir, platform, monkeypatch):
    import vllm.platforms.cpu as cpu_mod

    monkeypatch.setattr(cpu_mod, "cpu_has_native_bf16", lambda: False)
    config = VllmConfig(model_config=ModelConfig(model=str(llama_dir)))
    assert config.model_config.torch_dtype == torch.float32
    reason = config.provenance["model_config.dtype"].reason
    assert "no native bf16" in reason and "--dtype bfloat16" in reason
    explicit = VllmConfig(model_config=ModelConfig(model=str(llama_dir), dtype="bfloat16"))
    assert explicit.model_config.torch_dtype == torch.bfloat16
    assert explicit.provenance["model_config.dtype"].label == "user"
    monkeypatch.setattr(cpu_mod, "cpu_has_native_bf16", lambda: True)
    native = VllmConfig(model_config=ModelConfig(model=str(llama_dir)))
    assert native.model_config.torch_dtype == torch.bfloat16


@pytest.mark.parametrize("platform", ["cuda"], indirect=True)
@pytest.mark.parametrize("bf16", [True, False])
def test_auto_dtype_on_cuda_runs_float32_checkpoints_in_16_bits(tmp_path, platform, bf16,
                                                                 monkeypatch):
    """As vLLM does: a float32 checkpoint runs in bfloat16 (float16 without it) unless --dtype
    says otherwise; 16-bit checkpoints as stored."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
           "architectures": ["LlamaForCausalLM"]}
    LlamaConfig(**cfg, torch_dtype="float32").save_pretrained(tmp_path / "fp32")
    LlamaConfig(**cfg, torch_dtype="float16").save_pretrained(tmp_path / "fp16")
    auto = VllmConfig(model_config=ModelConfig(model=str(tmp_path / "fp32")))
    assert auto.model_config.torch_dtype == (torch.bfloat16 if bf16 else torch.float16)
    assert "--dtype float32" in auto.provenance["model_config.dtype"].reason
    kept = VllmConfig(model_config=ModelConfig(model=str(tmp_path / "fp32"), dtype="float32"))
    assert kept.model_config.torch_dtype == torch.float32
    stored = VllmConfig(model_config=ModelConfig(model=str(tmp_path / "fp16")))
    assert stored.model_config.torch_dtype == torch.float16


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype 'int8' is not supported.*float32"):
        ModelConfig(hf_config=LlamaConfig(), dtype="int8")


def test_bool_fields_refuse_strings():
    """enforce_eager="no" was taken as truthy (-O0)."""
    with pytest.raises(ValueError, match="model_config.enforce_eager must be true or false, "
                                         "got 'no'"):
        ModelConfig(model="demo", enforce_eager="no")
    with pytest.raises(ValueError, match="model_config.trust_remote_code must be true or false"):
        ModelConfig(model="demo", trust_remote_code=1)
    assert ModelConfig(model="demo", enforce_eager=True).enforce_eager is True


def test_quantized_and_moe_detection():
    assert model_configs.fp8().is_quantized and model_configs.fp8().is_fp8
    assert model_configs.fp8("static").has_static_activation_scales
    assert not model_configs.fp8("dynamic").has_static_activation_scales
    assert model_configs.compressed_tensors_fp8(dynamic=False).has_static_activation_scales
    assert not model_configs.compressed_tensors_fp8(dynamic=True).has_static_activation_scales
    assert model_configs.compressed_tensors_fp8(dynamic=True).is_fp8
    assert model_configs.moe().is_moe and not model_configs.moe().is_quantized
    assert not model_configs.dense().is_moe
    qwen3 = ModelConfig(hf_config=Qwen3Config(hidden_size=64, num_attention_heads=4,
                                              num_hidden_layers=1, vocab_size=128))
    assert not qwen3.is_moe


def test_demo_name_resolves_to_package_folder():
    assert demo_model_path().endswith("vllm/demo_model")
