"""Gemma 3 (text only; config `Gemma3TextConfig`, model_type "gemma3_text").

Gemma 2's layer (four norms, query_pre_attn_scalar**-0.5 scale, embedding scale) plus:
  * q_norm / k_norm: a GemmaRMSNorm over each query and key head (weights of size head_dim),
    applied before RoPE;
  * local and global layers: `layer_types` (or every `sliding_window_pattern`-th layer global,
    default 6) picks them; local layers use `sliding_window` and their own RoPE base
    (`rope_local_base_freq`, default 10000, never scaled), global layers `rope_theta`
    (default 1e6) with `rope_scaling` (real 4B+ checkpoints: linear, factor 8). transformers 5
    keeps both in `rope_parameters` keyed by layer type; older configs name them flat;
  * `final_logit_softcapping` when set (usually None). `attn_logit_softcapping` is not
    applied: transformers' Gemma 3 attention never passes it on, and the released configs
    leave it None; a config that sets it gets a warning.
Checkpoints saved from the multimodal model name the text weights `language_model.model.*`
(or `model.language_model.*`): those prefixes are mapped to `model.*`.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope
from vllm.model_executor.models.gemma import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    layer_kinds_from_config,
)
from vllm.model_executor.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM
from vllm.model_executor.models.llama import head_dim_of

logger = init_logger(__name__)

_DEFAULT_THETA = {FULL_ATTENTION: 1_000_000.0, SLIDING_ATTENTION: 10_000.0}

# Multimodal-checkpoint prefixes of the language model's tensors -> ours.
_NAME_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


def gemma3_rope_parameters(config: Any) -> dict[str, tuple[float, dict[str, Any] | None]]:
    """{layer kind: (rope base, scaling parameters or None for plain RoPE)}."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and any(k in params for k in _DEFAULT_THETA):
        per_kind = {kind: dict(params.get(kind) or {}) for kind in _DEFAULT_THETA}
    else:  # the flat names of configs written before transformers 5
        per_kind = {FULL_ATTENTION: dict(getattr(config, "rope_scaling", None) or {}),
                    SLIDING_ATTENTION: {}}
        per_kind[FULL_ATTENTION]["rope_theta"] = getattr(config, "rope_theta", None)
        per_kind[SLIDING_ATTENTION]["rope_theta"] = getattr(config, "rope_local_base_freq",
                                                            None)
    result = {}
    for kind, kind_params in per_kind.items():
        theta = kind_params.pop("rope_theta", None) or _DEFAULT_THETA[kind]
        rope_type = kind_params.get("rope_type") or kind_params.get("type") or "default"
        result[kind] = (float(theta), None if rope_type == "default" else kind_params)
    return result


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    qk_norm = True

    @staticmethod
    def layer_kinds(config: Any) -> list[str]:
        pattern = (getattr(config, "sliding_window_pattern", None)
                   or getattr(config, "_sliding_window_pattern", None) or 6)
        return layer_kinds_from_config(config, pattern=int(pattern))

    @staticmethod
    def rotary_embeddings(config: Any) -> dict[str, RotaryEmbedding]:
        """Two rotary modules: local (sliding) layers and global layers."""
        head_dim = head_dim_of(config)
        max_position = config.max_position_embeddings
        return {kind: get_rope(head_dim, head_dim, max_position, theta, scaling,
                               original_max_position=max_position)
                for kind, (theta, scaling) in gemma3_rope_parameters(config).items()}

    @staticmethod
    def attention_soft_cap(config: Any) -> float | None:
        return None  # see the module docstring


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls = Gemma3DecoderLayer

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        cap = getattr(self.config, "attn_logit_softcapping", None)
        if cap is not None:
            logger.warning("Gemma 3: attn_logit_softcapping=%s in the model config is not "
                           "applied (transformers' Gemma 3 does not apply it either)", cap)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((_our_name(name), tensor) for name, tensor in weights)


def _our_name(name: str) -> str:
    for theirs, ours in _NAME_PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name
