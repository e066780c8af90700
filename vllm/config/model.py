"""The model: a local Hugging Face folder (config.json + safetensors + tokenizer) or a Hugging
Face Hub repo id (fetched into the Hub cache: vllm/transformers_utils/hub.py), its dtype, its
length limit, and the facts the level presets ask about (quantized? MoE?).

`model` keeps the name the user gave for a Hub model (the repo id, as upstream: it is also the
default served name); `model_path` is the folder read (the snapshot of the resolved commit).
For a local folder both are that folder.

Resolving a config needs only a few values of the model's config.json (architectures, length,
dtype, quantization, head counts), and importing transformers to read it takes ~2 s of CPU
(it imports torch and torch.distributed.tensor). So where reading config.json directly is known
to give the values transformers' config object would hold (`read_config_json`), resolution
reads the file, and `hf_config` (the transformers config) is read on first use: by the
tokenizer, the model loader or the compile-cache key. The resolved values are the same either
way (tests/config/test_lazy_hf_config.py compares them).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm.config.rope import rope_max_position
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


def is_local_model_name(model: str) -> bool:
    """`demo`, or a name that is not a Hub repo id (a folder, or a path that is missing): no
    Hub look-up (and no huggingface_hub import) for these."""
    if model == DEMO_MODEL_NAME or os.path.isdir(os.path.expanduser(model)):
        return True
    from vllm.transformers_utils.hub import is_repo_id

    return not is_repo_id(model)


def resolve_model_path(model: str) -> str:
    """Map `demo` to the built-in model; check a local folder exists and holds a config.json
    (a Hub repo id is resolved by ModelConfig, not here)."""
    if model == DEMO_MODEL_NAME:
        return demo_model_path()
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        raise ValueError(
            f"Model {model!r} is not a local folder. Pass the path of a Hugging Face model "
            "folder (config.json, *.safetensors, tokenizer files), a Hugging Face Hub repo id "
            "(ORG/NAME) or 'demo'.")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"Model folder {model!r} has no config.json; a Hugging Face model "
                         "folder needs config.json, *.safetensors and tokenizer files.")
    return path


@dataclass
class ModelConfig:
    model: str = DEMO_MODEL_NAME
    """A local Hugging Face model folder, a Hugging Face Hub repo id (ORG/NAME), or 'demo' for
    the built-in demo model."""
    tokenizer: str | None = None
    """Tokenizer folder or Hub repo id (default: the model's)."""
    revision: str | None = None
    """Hub models: the branch, tag or commit sha to load (default: the default branch).
    Ignored for a local folder."""
    tokenizer_revision: str | None = None
    """Hub tokenizers: the branch, tag or commit sha (default: `revision`)."""
    download_dir: str | None = None
    """Hub models: the Hugging Face cache folder to download into and read from (default:
    huggingface_hub's, HF_HUB_CACHE or HF_HOME/hub)."""
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
    """A transformers PretrainedConfig given directly (tests); otherwise read from the folder,
    on first use (see the module docstring)."""
    torch_dtype: Any = field(default=None, init=False, repr=False, compare=False)
    """The resolved torch.dtype (set by VllmConfig through the platform, as a torch.dtype or
    its name; torch is imported when it is read). `resolved_dtype` is its name."""

    def __post_init__(self) -> None:
        check_bool_fields(self, "model_config")  # enforce_eager="no" would be truthy
        # A torch.dtype (upstream accepts one) is read as its name: torch.bfloat16 -> bfloat16.
        name = str(self.dtype).removeprefix("torch.")
        self.dtype = _DTYPE_ALIASES.get(name, name)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; choose one of "
                             + ", ".join(_DTYPES))
        if self.tokenizer_revision is None:
            self.tokenizer_revision = self.revision
        if self.__dict__["_hf_config"] is None:
            self._resolve_model_source()
            if not self.hf_overrides:
                self.__dict__["_config_json"] = read_config_json(self.model_path,
                                                                 self.trust_remote_code)
            if self.__dict__.get("_config_json") is None:
                self.hf_config = _load_hf_config(self.model_path, self.trust_remote_code)
        if self.hf_overrides:
            if not isinstance(self.hf_overrides, dict):
                raise ValueError(f"hf_overrides must be a dict, got {self.hf_overrides!r}")
            _apply_overrides(self.hf_config, self.hf_overrides)
        if self.tokenizer is None:
            self.tokenizer = self.model
        self._resolve_tokenizer_source()
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

    # ---- where the files are ---------------------------------------------------------------
    def _resolve_model_source(self) -> None:
        """A local folder (or demo) is checked and `model` becomes its path; a Hub repo id is
        resolved to a cached snapshot (`hub_snapshot`) and `model` stays the repo id."""
        if is_local_model_name(self.model):
            self.model = resolve_model_path(self.model)
            return
        from vllm.transformers_utils.hub import resolve_model

        self.__dict__["_hub"] = resolve_model(self.model, self.revision, self.download_dir,
                                              self.trust_remote_code)

    def _resolve_tokenizer_source(self) -> None:
        snap = self.hub_snapshot
        if (snap is not None and self.tokenizer == snap.repo_id
                and self.tokenizer_revision == snap.revision):
            self.__dict__["_tokenizer_path"] = snap.path
        elif self.tokenizer == self.model and snap is None:
            self.__dict__["_tokenizer_path"] = self.model
        elif isinstance(self.tokenizer, str) and not is_local_model_name(self.tokenizer):
            from vllm.transformers_utils.hub import resolve_tokenizer

            self.__dict__["_tokenizer_path"] = resolve_tokenizer(
                self.tokenizer, self.tokenizer_revision, self.download_dir).path
        else:
            self.__dict__["_tokenizer_path"] = self.tokenizer

    @property
    def hub_snapshot(self) -> Any:
        """The Hub snapshot (`vllm.transformers_utils.hub.HubSnapshot`: repo id, revision,
        commit, folder, weight files) of a Hub model; None for a local folder."""
        return self.__dict__.get("_hub")

    @property
    def model_path(self) -> str:
        """The local folder the config, generation config and weights are read from."""
        snap = self.hub_snapshot
        return snap.path if snap is not None else self.model

    @property
    def tokenizer_path(self) -> str:
        """The local folder (or name, for a tokenizer given directly) the tokenizer is loaded
        from."""
        return self.__dict__.get("_tokenizer_path") or self.tokenizer or self.model_path

    @property
    def model_commit(self) -> str | None:
        """The Hub commit sha the model was resolved to (None for a local folder)."""
        snap = self.hub_snapshot
        return None if snap is None else snap.commit

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
        return self.model_path if self.generation_config in ("auto", "vllm") else \
            self.generation_config

    @property
    def served_model_names(self) -> list[str]:
        """Every name the API accepts for this model; the first is the one it reports."""
        name = self.served_model_name
        return [name] if isinstance(name, str) else list(name or [])

    # ---- facts about the architecture -------------------------------------------------
    @property
    def hf_config_loaded(self) -> bool:
        """Whether the transformers config has been read (or was given)."""
        return self.__dict__.get("_hf_config") is not None

    def _facts(self, text: bool = True) -> Any:
        """Where resolution reads model facts: config.json's values while the transformers
        config is not read yet (and they are known to equal its values), else that config
        (its text config when `text`)."""
        if not self.hf_config_loaded and self.__dict__.get("_config_json") is not None:
            return self.__dict__["_config_json"]
        return self.text_config if text else self.hf_config

    @property
    def text_config(self) -> Any:
        getter = getattr(self.hf_config, "get_text_config", None)
        return getter() if getter else self.hf_config

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self._facts(text=False), "architectures", None) or [])

    @property
    def checkpoint_dtype(self) -> str:
        """The dtype the checkpoint's config.json declares (float32 when it declares none)."""
        cfg = self._facts(text=False)
        value = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        name = str(value).replace("torch.", "") if value is not None else "float32"
        return name if name in _DTYPES else "float32"

    @property
    def resolved_dtype(self) -> str | None:
        """The name of the resolved compute dtype ("float32", "bfloat16", ...), None before
        VllmConfig resolves it; reading it imports no torch."""
        return self.__dict__.get("_dtype_name")

    def derived_max_model_len(self) -> int:
        text = self._facts()
        if isinstance(getattr(text, "max_position_embeddings", None), int):
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
        return int(self._facts().num_attention_heads)

    def get_num_kv_heads(self) -> int:
        text = self._facts()
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
        text = self._facts()
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
        text = self._facts()
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
        for cfg in (self._facts(text=False), self._facts()):
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
            "dtype": f"torch.{self.resolved_dtype}" if self.resolved_dtype else self.dtype,
            "max_model_len": self.max_model_len,
        }
        if self.model_commit is not None:  # a new revision never loads an old one's graphs
            data["hub_commit"] = f"{self.hub_snapshot.repo_id}@{self.model_commit}"
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


class _HfConfigField:
    """`ModelConfig.hf_config`: the config given, or the folder's, read on first use."""

    def __get__(self, obj: ModelConfig | None, objtype: type | None = None) -> Any:
        if obj is None:
            return None
        if obj.__dict__.get("_hf_config") is None and obj.__dict__.get("_config_json") is not None:
            obj.__dict__["_hf_config"] = _load_hf_config(obj.model_path, obj.trust_remote_code)
        return obj.__dict__.get("_hf_config")

    def __set__(self, obj: ModelConfig, value: Any) -> None:
        obj.__dict__["_hf_config"] = value


class _TorchDtypeField:
    """`ModelConfig.torch_dtype`: kept as a name, so that resolving needs no torch."""

    def __get__(self, obj: ModelConfig | None, objtype: type | None = None) -> Any:
        if obj is None or obj.__dict__.get("_dtype_name") is None:
            return None
        import torch

        return getattr(torch, obj.__dict__["_dtype_name"])

    def __set__(self, obj: ModelConfig, value: Any) -> None:
        obj.__dict__["_dtype_name"] = None if value is None else str(value).replace("torch.", "")


# Installed over the dataclass's fields (which keep their defaults, repr=False and
# compare=False): the generated __init__ assigns through them.
ModelConfig.hf_config = _HfConfigField()  # type: ignore[assignment]
ModelConfig.torch_dtype = _TorchDtypeField()  # type: ignore[assignment]


# Model types whose transformers config class keeps these config.json values as they are
# (checked against AutoConfig in tests/config/test_lazy_hf_config.py): the architectures the
# model registry serves. Others are read with transformers at once, as are folders with
# remote code.
_DIRECT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral")
# Values the facts read; transformers fills them with per-model defaults when absent, so
# they must be present (num_key_value_heads: Qwen2's default is 32, not the head count).
_REQUIRED_INT_KEYS = ("max_position_embeddings", "hidden_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "intermediate_size",
                      "vocab_size")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


def _plain_rope_type(params: Any) -> str | None:
    """The RoPE type of a flat parameter dict ("default" when it names none, or when it is
    absent); None for anything else (nested per layer type, not a dict)."""
    if params is None or params == {}:
        return "default"
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        return None
    return params.get("rope_type") or params.get("type") or "default"


def read_config_json(path: str, trust_remote_code: bool = False) -> SimpleNamespace | None:
    """config.json of the folder `path` as attributes, when its values are those the
    transformers config would hold for every fact resolution reads: a model type of
    `_DIRECT_MODEL_TYPES`, the sizes present as integers, the dtype named once, RoPE without
    a scaling that changes the length (default or llama3; transformers reads `rope_scaling`
    before `rope_parameters`, this engine the other way round, so both must agree). None
    otherwise, or when the file cannot be read: then transformers reads it (and names what
    is wrong)."""
    if trust_remote_code:
        return None
    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("model_type") not in _DIRECT_MODEL_TYPES:
        return None
    if "text_config" in raw or "auto_map" in raw:
        return None
    architectures = raw.get("architectures")
    if not (isinstance(architectures, list) and architectures
            and all(isinstance(a, str) for a in architectures)):
        return None
    for key in _REQUIRED_INT_KEYS:
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            return None
    if raw["model_type"] == "mixtral" and not isinstance(raw.get("num_local_experts"), int):
        return None
    dtypes = {raw[k] for k in ("dtype", "torch_dtype") if raw.get(k) is not None}
    if len(dtypes) > 1 or not all(d in _DTYPES[1:] for d in dtypes):
        return None
    rope_types = {_plain_rope_type(raw.get("rope_scaling") or raw.get("rope_parameters")),
                  _plain_rope_type(raw.get("rope_parameters") or raw.get("rope_scaling"))}
    if not rope_types <= {"default", "llama3"}:
        return None
    if "llama3" in rope_types:
        params = raw.get("rope_scaling") or raw.get("rope_parameters")
        if not all(isinstance(params.get(k), (int, float)) for k in _LLAMA3_ROPE_KEYS):
            return None
    for key in ("quantization_config", "compression_config"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            return None
    return SimpleNamespace(**raw)


def _load_hf_config(path: str, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"Cannot read the Hugging Face config in {path!r}: {exc}") from exc
