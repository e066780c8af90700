"""The model: a local Hugging Face folder (config.json + safetensors + tokenizer), its dtype,
its length limit, and the facts the level presets ask about (quantized? MoE?)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.config.utils import check_bool_fields, hash_fields

TOKENIZER_MODES = ("auto", "slow")
# generation_config.json keys -> the SamplingParams fields they default.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                          "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                          "max_new_tokens": "max_tokens"}
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16",
                  "bf16": "bfloat16"}
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
DEMO_MODEL_NAME = "demo"


def demo_model_path() -> str:
    """The built-in demo model folder shipped inside the package."""
    return str(Path(__file__).resolve().parent.parent / "demo_model")


def resolve_model_path(model: str) -> str:
    """Map `demo` to the built-in model; check a local folder exists and holds a config.json."""
    if model == DEMO_MODEL_NAME:
        return demo_model_path()
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        raise ValueError(
            f"Model {model!r} is not a local folder. Pass the path of a Hugging Face model "
            "folder (config.json, *.safetensors, tokenizer files) or 'demo'; downloading from "
            "a model hub is not supported.")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"Model folder {model!r} has no config.json; a Hugging Face model "
                         "folder needs config.json, *.safetensors and tokenizer files.")
    return path


@dataclass
class ModelConfig:
    model: str = DEMO_MODEL_NAME
    """A local Hugging Face model folder, or 'demo' for the built-in demo model."""
    tokenizer: str | None = None
    """Tokenizer folder (default: the model folder)."""
    dtype: str = "auto"
    """Compute dtype: auto (the platform decides from the checkpoint), float32, bfloat16,
    float16."""
    max_model_len: int | None = None
    """Prompt + output tokens per sequence (default: the model's max_position_embeddings)."""
    seed: int = 0
    served_model_name: str | list[str] | None = None
    """Name(s) the API answers to (default: `model`); the first is the one reported."""
    trust_remote_code: bool = False
    enforce_eager: bool = False
    """Deprecated: the same as -O0."""
    max_logprobs: int = 20
    """The most logprobs a request may ask for, per sampled or prompt token (-1: the whole
    vocabulary). As upstream: 20."""
    tokenizer_mode: str = "auto"
    """"auto": the fast (Rust) tokenizer where the folder has one; "slow": the Python one."""
    generation_config: str = "auto"
    """Where default sampling parameters come from: "auto" (the model folder's
    generation_config.json), "vllm" (none: SamplingParams' own defaults) or another folder."""
    override_generation_config: dict[str, Any] | None = None
    """Default sampling parameters set over those of `generation_config` (its key names:
    temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)."""
    hf_overrides: dict[str, Any] | None = None
    """Values set on the Hugging Face config after it is read (a dict value updates a nested
    config such as text_config), as upstream's hf_overrides."""
    hf_config: Any = field(default=None, repr=False, compare=False)
    """A transformers PretrainedConfig given directly (tests); otherwise read from the folder."""
    torch_dtype: Any = field(default=None, init=False, repr=False, compare=False)
    """The resolved torch.dtype (set by VllmConfig through the platform)."""

    def __post_init__(self) -> None:
        check_bool_fields(self, "model_config")  # enforce_eager="no" would be truthy
        self.dtype = _DTYPE_ALIASES.get(str(self.dtype), str(self.dtype))
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; choose one of "
                             + ", ".join(_DTYPES))
        if self.hf_config is None:
            self.model = resolve_model_path(self.model)
            self.hf_config = _load_hf_config(self.model, self.trust_remote_code)
        if self.hf_overrides:
            if not isinstance(self.hf_overrides, dict):
                raise ValueError(f"hf_overrides must be a dict, got {self.hf_overrides!r}")
            _apply_overrides(self.hf_config, self.hf_overrides)
        if self.tokenizer is None:
            self.tokenizer = self.model
        limit = self.derived_max_model_len()
        if self.max_model_len is None:
            self.max_model_len = limit
        elif not isinstance(self.max_model_len, int) or self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be a positive integer, got "
                             f"{self.max_model_len!r}")
        elif self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} is longer than the model's "
                f"max_position_embeddings ({limit})")
        if self.served_model_name is None:
            self.served_model_name = self.model
        names = self.served_model_names
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"served_model_name must be a non-empty name or a non-empty list "
                             f"of names, got {self.served_model_name!r}")
        self._check_tokenizer_and_generation_config()
        if (isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int)
                or self.max_logprobs < -1):
            raise ValueError(f"max_logprobs must be an integer >= -1 (-1: the whole "
                             f"vocabulary), got {self.max_logprobs!r}")

    def _check_tokenizer_and_generation_config(self) -> None:
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(f"tokenizer_mode must be one of {', '.join(TOKENIZER_MODES)}, got "
                             f"{self.tokenizer_mode!r}")
        source = self.generation_config
        if source not in ("auto", "vllm") and not os.path.isfile(
                os.path.join(str(source), "generation_config.json")):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding "
                             f"generation_config.json, got {source!r}")
        overrides = self.override_generation_config
        if overrides is None:
            return
        if not isinstance(overrides, dict):
            raise ValueError(f"override_generation_config must be a dict, got {overrides!r}")
        unknown = sorted(set(overrides) - set(GENERATION_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"override_generation_config: unknown key(s) {unknown}; allowed: "
                             f"{', '.join(GENERATION_CONFIG_KEYS)}")

    def generation_config_folder(self) -> str:
        """The folder whose generation_config.json is read (EOS ids; defaults unless
        generation_config is "vllm")."""
        return self.model if self.generation_config in ("auto", "vllm") else \
            self.generation_config

    @property
    def served_model_names(self) -> list[str]:
        """Every name the API accepts for this model; the first is the one it reports."""
        name = self.served_model_name
        return [name] if isinstance(name, str) else list(name or [])

    # ---- facts about the architecture -------------------------------------------------
    @property
    def text_config(self) -> Any:
        getter = getattr(self.hf_config, "get_text_config", None)
        return getter() if getter else self.hf_config

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])

    @property
    def checkpoint_dtype(self) -> str:
        """The dtype the checkpoint's config.json declares (float32 when it declares none)."""
        cfg = self.hf_config
        value = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        name = str(value).replace("torch.", "") if value is not None else "float32"
        return name if name in _DTYPES else "float32"

    def derived_max_model_len(self) -> int:
        text = self.text_config
        if isinstance(getattr(text, "max_position_embeddings", None), int):
            from vllm.model_executor.layers.rotary_embedding import rope_max_position

            return rope_max_position(text)
        for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
            value = getattr(text, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return 2048

    def get_hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    def get_num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    def get_num_attention_heads(self) -> int:
        return int(self.text_config.num_attention_heads)

    def get_num_kv_heads(self) -> int:
        text = self.text_config
        return int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)

    def get_head_size(self) -> int:
        text = self.text_config
        head_dim = getattr(text, "head_dim", None)
        if head_dim:
            return int(head_dim)
        return self.get_hidden_size() // self.get_num_attention_heads()

    def get_vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    def verify_with_parallel_config(self, tensor_parallel_size: int) -> None:
        """The model's shapes must split over the tensor-parallel ranks (checked before any
        worker starts). Raises ValueError naming the dimension and both numbers."""
        tp = tensor_parallel_size
        if tp == 1:
            return
        heads = self.get_num_attention_heads()
        if heads % tp:
            raise ValueError(f"the number of attention heads ({heads}) must be divisible by "
                             f"tensor_parallel_size ({tp})")
        kv_heads = self.get_num_kv_heads()
        if (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
            raise ValueError(f"the number of KV heads ({kv_heads}) and tensor_parallel_size "
                             f"({tp}) must divide one another (fewer KV heads than ranks are "
                             f"replicated)")
        text = self.text_config
        for key in ("intermediate_size", "moe_intermediate_size"):
            size = getattr(text, key, None)
            if isinstance(size, int) and size % tp:
                raise ValueError(f"the MLP size {key} ({size}) must be divisible by "
                                 f"tensor_parallel_size ({tp})")

    def get_max_logprobs(self) -> int:
        """The most logprobs a request may ask for: max_logprobs, bounded by the vocabulary
        (-1: the whole vocabulary)."""
        vocab = self.get_vocab_size()
        return vocab if self.max_logprobs == -1 else min(self.max_logprobs, vocab)

    def get_num_experts(self) -> int:
        text = self.text_config
        for key in _EXPERT_KEYS:
            value = getattr(text, key, None)
            if isinstance(value, list):
                value = value[0] if value else 0
            if value:
                return int(value)
        return 0

    @property
    def is_moe(self) -> bool:
        return self.get_num_experts() > 0

    @property
    def quantization_config(self) -> dict | None:
        """The checkpoint's quantization config as a dict (None for an unquantized model)."""
        for cfg in (self.hf_config, self.text_config):
            value = getattr(cfg, "quantization_config", None)
            if value is None:
                value = getattr(cfg, "compression_config", None)
            if value is not None:
                return value if isinstance(value, dict) else value.to_dict()
        return None

    @property
    def is_quantized(self) -> bool:
        return self.quantization_config is not None

    @property
    def quant_method(self) -> str | None:
        qc = self.quantization_config
        return None if qc is None else str(qc.get("quant_method", "unknown")).lower()

    @property
    def is_fp8(self) -> bool:
        """FP8 weights (quant_method fp8, or compressed-tensors with 8-bit float weights)."""
        qc = self.quantization_config
        if qc is None:
            return False
        if self.quant_method == "fp8":
            return True
        if self.quant_method == "compressed-tensors":
            for group in (qc.get("config_groups") or {}).values():
                weights = group.get("weights") or {}
                if weights.get("type") == "float" and weights.get("num_bits") == 8:
                    return True
        return False

    @property
    def has_static_activation_scales(self) -> bool:
        """FP8 with per-tensor activation scales stored in the checkpoint (input_scale)."""
        qc = self.quantization_config
        if not self.is_fp8 or qc is None:
            return False
        if self.quant_method == "fp8":
            return qc.get("activation_scheme", "dynamic") == "static"
        for group in (qc.get("config_groups") or {}).values():
            acts = group.get("input_activations") or {}
            if acts and acts.get("dynamic") is False:
                return True
        return False

    def compute_hash(self) -> str:
        data = {
            "architectures": self.architectures,
            "hf_config": (self.hf_config.to_json_string()
                          if hasattr(self.hf_config, "to_json_string") else repr(self.hf_config)),
            "dtype": str(self.torch_dtype or self.dtype),
            "max_model_len": self.max_model_len,
        }
        return hash_fields(_Hashable(data))


@dataclass
class _Hashable:
    data: dict


def _apply_overrides(config: Any, overrides: dict[str, Any]) -> None:
    """Set `overrides` on a Hugging Face config; a dict updates a nested config in place."""
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):
            _apply_overrides(current, value)
        else:
            setattr(config, key, value)


def _load_hf_config(path: str, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"Cannot read the Hugging Face config in {path!r}: {exc}") from exc
