"""RoPE facts read from a Hugging Face config, without torch: the config (the default
max_model_len) and the rotary-embedding layers both ask them."""
from __future__ import annotations

from typing import Any


def rope_max_position(hf_config: Any) -> int:
    """How many positions the model's RoPE is meant for: max_position_embeddings, times the
    factor for "linear" scaling, and the pre-training length times the factor for "yarn"
    (as vLLM derives the default max_model_len), never less than max_position_embeddings."""
    limit = int(hf_config.max_position_embeddings)
    _, scaling, _ = rope_config(hf_config)
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    factor = (scaling or {}).get("factor")
    if rope_type == "yarn" and factor:
        original = scaling.get("original_max_position_embeddings") or limit
        return max(limit, int(original * factor))
    if rope_type == "linear" and factor:
        return int(limit * factor)
    return limit


def rope_config(hf_config: Any) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, scaling parameters or None, partial_rotary_factor) from a HF config.

    Reads transformers 5's `rope_parameters` and the older `rope_theta` + `rope_scaling`."""
    params = getattr(hf_config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    theta = float(params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", 10000.0))
    partial = params.pop("partial_rotary_factor", None)
    if partial is None:
        partial = getattr(hf_config, "partial_rotary_factor", None) or 1.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    return theta, (None if rope_type == "default" else params), float(partial)

