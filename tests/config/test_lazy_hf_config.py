"""Resolution reads config.json itself and leaves transformers' config for first use: the
resolved values are those of the old way (transformers' AutoConfig read at once), and a fresh
process resolving a config (or running `vllm config`) imports neither torch nor transformers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
)

from vllm.config import ModelConfig, ParallelConfig, VllmConfig
from vllm.config.model import demo_model_path, read_config_json

REPO_ROOT = Path(__file__).resolve().parents[2]
_SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
          "max_position_embeddings": 300}
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 128}

# config.json as older transformers wrote them for real checkpoints (torch_dtype, rope_theta
# and rope_scaling at the top), shrunk.
QWEN25_STYLE = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "max_position_embeddings": 32768, "max_window_layers": 2,
    "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 256}
LLAMA32_STYLE = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 1,
    "eos_token_id": [2, 3], "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
    "intermediate_size": 128, "max_position_embeddings": 131072, "model_type": "llama",
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05, "rope_scaling": {**_LLAMA3_ROPE, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0", "vocab_size": 256}
FP8_STATIC = {"quant_method": "fp8", "activation_scheme": "static"}
CT_FP8 = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
    "weights": {"type": "float", "num_bits": 8},
    "input_activations": {"type": "float", "num_bits": 8, "dynamic": False}}}}


def _saved(cls, arch: str, **kwargs):
    def write(path: Path) -> None:
        cls(**{**_SMALL, **kwargs}, architectures=[arch]).save_pretrained(path)
    return write


def _raw(data: dict):
    def write(path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(data))
    return write


# Folders config.json is read from directly.
DIRECT = {
    "llama-bf16": _saved(LlamaConfig, "LlamaForCausalLM", torch_dtype="bfloat16"),
    "llama-fp16": _saved(LlamaConfig, "LlamaForCausalLM", dtype="float16"),
    "llama-llama3-rope": _saved(LlamaConfig, "LlamaForCausalLM", rope_scaling=_LLAMA3_ROPE),
    "llama-fp8-static": _saved(LlamaConfig, "LlamaForCausalLM", quantization_config=FP8_STATIC),
    "llama-ct-fp8": _saved(LlamaConfig, "LlamaForCausalLM", quantization_config=CT_FP8),
    "mistral": _saved(MistralConfig, "MistralForCausalLM"),
    "qwen2": _saved(Qwen2Config, "Qwen2ForCausalLM"),
    "qwen3": _saved(Qwen3Config, "Qwen3ForCausalLM", head_dim=32),
    "mixtral": _saved(MixtralConfig, "MixtralForCausalLM", num_local_experts=4),
    "qwen2.5-style": _raw(QWEN25_STYLE),
    "llama3.2-style": _raw(LLAMA32_STYLE),
    "no-dtype-no-rope": _raw({k: v for k, v in LLAMA32_STYLE.items()
                              if k not in ("torch_dtype", "rope_scaling", "rope_theta")}),
}
# Folders transformers reads at once, as before (their values depend on its rules).
VIA_TRANSFORMERS = {
    "yarn": _saved(Qwen2Config, "Qwen2ForCausalLM", rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),
    "linear": _raw({**QWEN25_STYLE, "rope_scaling": {"type": "linear", "factor": 2.0}}),
    "scaling-beside-parameters": _raw({**QWEN25_STYLE, "rope_scaling": {
        "rope_type": "linear", "factor": 2.0}, "rope_parameters": {"rope_type": "default"}}),
    "no-kv-heads": _raw({k: v for k, v in QWEN25_STYLE.items() if k != "num_key_value_heads"}),
    "no-max-len": _raw({k: v for k, v in QWEN25_STYLE.items()
                        if k != "max_position_embeddings"}),
    "two-dtypes": _raw({**QWEN25_STYLE, "dtype": "float16"}),
    "other-model-type": _raw({**QWEN25_STYLE, "model_type": "gemma"}),
}


def _old_way(path: str, **kwargs) -> ModelConfig:
    """The resolution before: transformers' config read at once."""
    return ModelConfig(model=path, hf_config=AutoConfig.from_pretrained(path), **kwargs)


FACTS = ("architectures", "checkpoint_dtype", "max_model_len", "is_moe", "quantization_config",
         "is_quantized", "is_fp8", "has_static_activation_scales")


def _facts(mc: ModelConfig) -> dict:
    return {**{name: getattr(mc, name) for name in FACTS},
            "heads": mc.get_num_attention_heads(), "kv_heads": mc.get_num_kv_heads(),
            "experts": mc.get_num_experts()}


def _assert_same_resolution(path: str, direct: bool, platform_name: str) -> None:
    new, old = ModelConfig(model=path), _old_way(path)
    assert new.hf_config_loaded is not direct, path
    assert _facts(new) == _facts(old)
    for level in range(4):
        resolved = VllmConfig(model_config=ModelConfig(model=path), optimization_level=level)
        expected = VllmConfig(model_config=_old_way(path), optimization_level=level)
        assert resolved.summary_line() == expected.summary_line()
        assert resolved.explain_json() == expected.explain_json()
        assert resolved.model_config.torch_dtype == expected.model_config.torch_dtype
        assert isinstance(resolved.model_config.torch_dtype, torch.dtype)
        assert resolved.model_config.hf_config_loaded is not direct
        # What needs transformers' config reads it then; the cache key is the same.
        assert resolved.compute_hash() == expected.compute_hash(), platform_name
        assert resolved.model_config.hf_config_loaded
        assert resolved.model_config.get_head_size() == expected.model_config.get_head_size()
    for tp in (2, 4):
        errors = []
        for mc in (ModelConfig(model=path), _old_way(path)):
            try:
                VllmConfig(model_config=mc, parallel_config=ParallelConfig(
                    tensor_parallel_size=tp))
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
        assert errors[0] == errors[1], errors


@pytest.mark.parametrize("platform", ["cpu", "cuda"], indirect=True)
@pytest.mark.parametrize("name", [*DIRECT, *VIA_TRANSFORMERS])
def test_same_resolution_as_reading_transformers_config_at_once(name, platform, tmp_path):
    writer = DIRECT.get(name) or VIA_TRANSFORMERS[name]
    writer(tmp_path / name)
    _assert_same_resolution(str(tmp_path / name), name in DIRECT, platform.device_name)


@pytest.mark.parametrize("platform", ["cpu", "cuda"], indirect=True)
def test_demo_model_resolves_from_config_json(platform):
    _assert_same_resolution(demo_model_path(), True, platform.device_name)


def test_hf_config_is_read_on_first_use_and_stays(tmp_path):
    DIRECT["qwen2.5-style"](tmp_path)
    mc = ModelConfig(model=str(tmp_path))
    assert not mc.hf_config_loaded
    first = mc.hf_config
    assert mc.hf_config_loaded and mc.hf_config is first
    first.rms_norm_eps = 1e-3  # tests and hf_overrides change it in place
    assert mc.hf_config.rms_norm_eps == 1e-3
    assert mc.text_config.max_position_embeddings == 32768


def test_remote_code_and_overrides_read_transformers_config_at_once(tmp_path):
    DIRECT["qwen2.5-style"](tmp_path)
    assert read_config_json(str(tmp_path), trust_remote_code=True) is None
    overridden = ModelConfig(model=str(tmp_path), hf_overrides={"max_position_embeddings": 64})
    assert overridden.hf_config_loaded and overridden.max_model_len == 64


def test_unreadable_config_json_is_named_as_before(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="Cannot read the Hugging Face config"):
        ModelConfig(model=str(tmp_path))


def test_torch_dtype_is_set_by_name_or_dtype():
    mc = ModelConfig(model="demo")
    assert mc.torch_dtype is None and mc.resolved_dtype is None
    mc.torch_dtype = "bfloat16"
    assert mc.torch_dtype is torch.bfloat16 and mc.resolved_dtype == "bfloat16"
    mc.torch_dtype = torch.float16
    assert mc.resolved_dtype == "float16"


# ---- what a fresh process imports --------------------------------------------------------

HEAVY = ("torch", "transformers", "tokenizers", "torch._dynamo", "torch._inductor")

RESOLVE = """
import json, sys
if sys.argv[1] == "torch":
    import torch
from vllm.engine.arg_utils import EngineArgs
config = EngineArgs(model="demo", optimization_level=1).create_engine_config()
heavy = [m for m in %r if m in sys.modules and not (sys.argv[1] == "torch" and m == "torch")]
print(json.dumps({"heavy": heavy, "table": config.explain_text()}))
""" % (HEAVY,)

CLI = """
import json, sys
from vllm.entrypoints.cli.main import main
code = main(["config", "--model", "demo", "-O1"])
print(json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def _fresh(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("pre_import", ["none", "torch"])
def test_resolving_in_a_fresh_process_imports_no_heavy_module(pre_import, cpu_platform):
    """Forced to the CPU (detecting a GPU needs torch); with torch already imported, as in
    an engine start, transformers is still not imported."""
    proc = _fresh(RESOLVE, pre_import, env={"VLLM_PLATFORM": "cpu"})
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    expected = VllmConfig(model_config=_old_way(demo_model_path()), optimization_level=1)
    assert result["table"] == expected.explain_text()


def test_vllm_config_prints_the_same_table_without_heavy_imports(cpu_platform):
    proc = _fresh(CLI, env={"VLLM_PLATFORM": "cpu"})
    *table, last = proc.stdout.strip().splitlines()
    result = json.loads(last)
    assert result == {"code": 0, "heavy": []}
    expected = VllmConfig(model_config=_old_way(demo_model_path()), optimization_level=1)
    assert table == [expected.summary_line(), *expected.explain_text().splitlines()]


DETECT = """
import json, sys
from vllm.platforms import torch_gpu_build
build = torch_gpu_build()
from vllm.platforms import current_platform
print(json.dumps({"build": build, "platform": current_platform.device_name,
                  "torch": "torch" in sys.modules}))
"""


def _fake_torch(root: Path, version_py: str | None) -> str:
    """A `torch` package that sees no GPU, with `version_py` as its version.py."""
    package = root / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "class cuda:\n    @staticmethod\n    def is_available():\n        return False\n")
    if version_py is not None:
        (package / "version.py").write_text(version_py)
    return str(root)


@pytest.mark.parametrize("version_py, build", [
    ("from typing import Optional\n__version__ = '2.13.0+cpu'\n"
     "cuda: Optional[str] = None\nhip: Optional[str] = None\n", False),
    ("cuda = '12.8'\nhip = None\n", True),
    ("cuda = None\nhip = '6.4'\n", True),
    ("cuda = None\n", None),  # hip not named: ask torch
    ("cuda = None\nhip = None\nbroken(\n", None),
    (None, None),
])
def test_a_torch_built_for_no_gpu_is_known_without_importing_it(tmp_path, version_py, build):
    """Only a torch built for neither CUDA nor ROCm is answered from its version.py; every
    other case asks torch, as before."""
    path = _fake_torch(tmp_path, version_py)
    proc = _fresh(DETECT, env={"PYTHONPATH": path + os.pathsep + str(REPO_ROOT)})
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"build": build, "platform": "cpu", "torch": build is not False}
