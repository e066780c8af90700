"""Rotary position embeddings (neox style) with a precomputed cos/sin cache.

`RotaryEmbedding.forward(positions [T], query [T, nq*hd], key [T, nk*hd]) -> (query, key)`
rotates the first `rotary_dim` channels of every head by the angle of its token's absolute
position. The cache is a float32 buffer `cos_sin_cache [max_position, rotary_dim]` (cos then
sin, each `rotary_dim // 2` wide), indexed with `positions`: no Python branching on values.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from vllm.config.rope import rope_config, rope_max_position  # noqa: F401 (re-exported)
from vllm.logger import init_logger
from vllm.model_executor.custom_op import CustomOp

logger = init_logger(__name__)

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "su")


@CustomOp.register("rotary_embedding")
class RotaryEmbedding(CustomOp):

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool = True) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_size:
            raise ValueError(f"rotary_dim ({rotary_dim}) must be even and at most head_size "
                             f"({head_size})")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = float(base)
        self.is_neox_style = is_neox_style
        # Built on the CPU in float32 even when the model is built on the meta device: the
        # loader moves it to the target device with the weights.
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(), persistent=False)

    def _compute_inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device="cpu")
        return 1.0 / (self.base ** (exponents.to(torch.float32) / self.rotary_dim))

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq()
        t = torch.arange(self.max_position_embeddings, dtype=torch.int64, device="cpu")
        freqs = torch.outer(t.to(torch.float32), inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def _apply(self, fn, recurse: bool = True):  # noqa: D401 - keep the cache in float32
        cache = self.cos_sin_cache
        result = super()._apply(fn, recurse)
        if self.cos_sin_cache.dtype != torch.float32:
            self.cos_sin_cache = cache.to(device=self.cos_sin_cache.device)
        return result

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, heads, head_size]; cos/sin [T, 1, rotary_dim // 2]
        rot = x[..., :self.rotary_dim]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if self.is_neox_style:
            out = torch.cat((o1, o2), dim=-1)
        else:
            out = torch.stack((o1, o2), dim=-1).flatten(-2)
        if self.rotary_dim < self.head_size:
            out = torch.cat((out, x[..., self.rotary_dim:]), dim=-1)
        return out

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor,
                       key: torch.Tensor | None = None):
        cos_sin = self.cos_sin_cache.index_select(0, positions.flatten())
        cos, sin = cos_sin.chunk(2, dim=-1)
        cos = cos.unsqueeze(-2).to(query.dtype)
        sin = sin.unsqueeze(-2).to(query.dtype)
        num_tokens = positions.shape[0]
        q_shape = query.shape
        query = self._rotate(query.view(num_tokens, -1, self.head_size), cos, sin).view(q_shape)
        if key is None:
            return query, None
        k_shape = key.shape
        key = self._rotate(key.view(num_tokens, -1, self.head_size), cos, sin).view(k_shape)
        return query, key

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
                f"max_position_embeddings={self.max_position_embeddings}, base={self.base}, "
                f"is_neox_style={self.is_neox_style}")


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """Positions divided by `scaling_factor` (rope type "linear")."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, scaling_factor: float) -> None:
        self.scaling_factor = float(scaling_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style)

    def _compute_inv_freq(self) -> torch.Tensor:
        return super()._compute_inv_freq() / self.scaling_factor


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1 frequency scaling: long wavelengths are divided by `factor`, short ones are
    kept, and the band between is interpolated smoothly."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, factor: float, low_freq_factor: float,
                 high_freq_factor: float, original_max_position: int) -> None:
        self.factor = float(factor)
        self.low_freq_factor = float(low_freq_factor)
        self.high_freq_factor = float(high_freq_factor)
        self.original_max_position = int(original_max_position)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style)

    def _compute_inv_freq(self) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq()
        old_len = self.original_max_position
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(in_band, smoothed, scaled)


class YaRNScalingRotaryEmbedding(RotaryEmbedding):
    """YaRN (rope type "yarn"): frequencies whose wavelength fits many times into the
    pre-training context (`original_max_position`) are kept, those that rotate less than once
    in it are divided by `factor`, with a linear ramp between (the band set by `beta_fast` and
    `beta_slow` rotations); cos and sin are multiplied by `attention_factor` (by default
    0.1 * ln(factor) + 1, or the ratio of the two mscale terms where both are given)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, factor: float, original_max_position: int,
                 beta_fast: float = 32.0, beta_slow: float = 1.0,
                 attention_factor: float | None = None, mscale: float | None = None,
                 mscale_all_dim: float | None = None, truncate: bool = True) -> None:
        self.factor = float(factor)
        self.original_max_position = int(original_max_position)
        self.beta_fast = float(beta_fast)
        self.beta_slow = float(beta_slow)
        self.truncate = bool(truncate)
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = (_yarn_mscale(self.factor, float(mscale))
                                    / _yarn_mscale(self.factor, float(mscale_all_dim)))
            else:
                attention_factor = _yarn_mscale(self.factor)
        self.attention_factor = float(attention_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style)

    def _correction_dim(self, rotations: float) -> float:
        """The channel pair index whose frequency turns `rotations` times over the original
        context."""
        return (self.rotary_dim * math.log(self.original_max_position / (rotations * 2 * math.pi))
                / (2 * math.log(self.base)))

    def _compute_inv_freq(self) -> torch.Tensor:
        kept = super()._compute_inv_freq()
        low = self._correction_dim(self.beta_fast)
        high = self._correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.rotary_dim - 1)
        if low == high:
            high += 0.001
        pairs = torch.arange(self.rotary_dim // 2, dtype=torch.float32, device="cpu")
        # 1 below the band (high frequencies: kept), 0 above it (divided by factor).
        keep = 1 - ((pairs - low) / (high - low)).clamp(0, 1)
        return kept / self.factor * (1 - keep) + kept * keep

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        return super()._compute_cos_sin_cache() * self.attention_factor


class LongRoPEScaledRotaryEmbedding(RotaryEmbedding):
    """LongRoPE (rope type "longrope", legacy name "su"; Phi-3-mini-128k, Phi-3.5): every
    channel pair's frequency is divided by its own factor, `short_factor[i]` or
    `long_factor[i]` (lists of `rotary_dim // 2` numbers), and cos and sin are multiplied by
    `attention_factor` (by default sqrt(1 + ln(factor) / ln(original_max_position)) with
    factor = max_position_embeddings / original_max_position when the config gives none;
    1 when factor <= 1). Both factor lists share the same attention factor.

    Which list applies is decided once, when the model is built: the long factors for every
    position when the engine's `max_model_len` exceeds `original_max_position`
    (`use_long_factors`), the short ones otherwise. This is upstream vLLM's choice.

    transformers (5.x) decides per forward call: the long factors for EVERY position of a
    sequence whose length exceeds `original_max_position`, the short ones otherwise (its
    generate() drops the KV cache and recomputes the whole sequence the step it crosses).
    Keys in a paged KV cache are stored rotated and outlive steps (decode, prefix-cache
    hits), so a switch per sequence would mean recomputing them; a switch per position
    (short below `original_max_position`, long from it on) would rotate one sequence's early
    keys and late queries with different frequencies, so attention would no longer depend on
    the distance alone. A fixed choice keeps every sequence consistent. Consequences:
      - max_model_len <= original_max_position: transformers' logits exactly (short);
      - max_model_len > original_max_position (the default for Phi-3-mini-128k: 131072 >
        4096): transformers' logits exactly for sequences longer than
        `original_max_position`; sequences up to it get the long factors where transformers
        uses the short ones (serve with max_model_len <= original_max_position to get those).
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, original_max_position: int,
                 short_factor: list[float], long_factor: list[float], use_long_factors: bool,
                 factor: float | None = None, attention_factor: float | None = None,
                 scaled_max_position: int | None = None) -> None:
        pairs = rotary_dim // 2
        for name, values in (("short_factor", short_factor), ("long_factor", long_factor)):
            if (not isinstance(values, (list, tuple)) or len(values) != pairs
                    or not all(isinstance(v, (int, float)) and v > 0 for v in values)):
                raise ValueError(f"rope_scaling {name} must be a list of {pairs} positive numbers "
                                 f"(rotary_dim {rotary_dim} / 2), got {values!r}")
        if int(original_max_position) <= 1:
            raise ValueError("rope_scaling original_max_position_embeddings must be an int > 1, "
                             f"got {original_max_position!r}")
        self.original_max_position = int(original_max_position)
        self.short_factor = [float(v) for v in short_factor]
        self.long_factor = [float(v) for v in long_factor]
        self.use_long_factors = bool(use_long_factors)
        if factor is None:  # the model's context length over its pre-training length
            factor = (scaled_max_position or max_position_embeddings) / self.original_max_position
        self.factor = float(factor)
        if attention_factor is None:
            attention_factor = 1.0 if self.factor <= 1.0 else math.sqrt(
                1 + math.log(self.factor) / math.log(self.original_max_position))
        self.attention_factor = float(attention_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style)
        if self.use_long_factors:
            logger.info("LongRoPE: the long factors for every position (max_model_len > "
                        "original_max_position_embeddings=%d); transformers uses the short "
                        "ones for sequences of at most %d tokens", self.original_max_position,
                        self.original_max_position)

    def _compute_inv_freq(self) -> torch.Tensor:
        factors = self.long_factor if self.use_long_factors else self.short_factor
        ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device="cpu")
        return 1.0 / (ext * self.base ** (exponents.to(torch.float32) / self.rotary_dim))

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        return super()._compute_cos_sin_cache() * self.attention_factor

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, original_max_position={self.original_max_position}, "
                f"use_long_factors={self.use_long_factors}, "
                f"attention_factor={self.attention_factor:.6f}")


def _engine_max_model_len(default: int) -> int:
    """The max_model_len of the model being built (`default` outside an engine's build)."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    model_config = getattr(config, "model_config", None)
    return getattr(model_config, "max_model_len", None) or default


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def get_rope(head_size: int, rotary_dim: int, max_position: int, base: float,
             rope_scaling: dict[str, Any] | None = None, is_neox_style: bool = True,
             original_max_position: int | None = None) -> RotaryEmbedding:
    """Build the rotary embedding for `rope_scaling` (None / "default", "linear", "llama3",
    "yarn", "longrope" or its legacy name "su") with a cos/sin cache of `max_position`
    positions. `original_max_position`: the config's max_position_embeddings, for scalings
    that name no pre-training length (and longrope's default factor: it over the pre-training
    length)."""
    if not rope_scaling:
        return RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style)
    rope_type = rope_scaling.get("rope_type") or rope_scaling.get("type") or "default"
    if rope_type == "default":
        return RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style)
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(head_size, rotary_dim, max_position, base,
                                            is_neox_style, rope_scaling["factor"])
    # transformers fills a missing pre-training length with max_position_embeddings.
    original = (rope_scaling.get("original_max_position_embeddings") or original_max_position
                or max_position)
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(
            head_size, rotary_dim, max_position, base, is_neox_style,
            factor=rope_scaling["factor"], low_freq_factor=rope_scaling["low_freq_factor"],
            high_freq_factor=rope_scaling["high_freq_factor"], original_max_position=original)
    if rope_type == "yarn":
        return YaRNScalingRotaryEmbedding(
            head_size, rotary_dim, max_position, base, is_neox_style,
            factor=rope_scaling["factor"], original_max_position=original,
            beta_fast=rope_scaling.get("beta_fast") or 32,
            beta_slow=rope_scaling.get("beta_slow") or 1,
            attention_factor=rope_scaling.get("attention_factor"),
            mscale=rope_scaling.get("mscale"), mscale_all_dim=rope_scaling.get("mscale_all_dim"),
            truncate=rope_scaling.get("truncate", True))
    if rope_type in ("longrope", "su"):
        return LongRoPEScaledRotaryEmbedding(
            head_size, rotary_dim, max_position, base, is_neox_style,
            original_max_position=original, short_factor=rope_scaling.get("short_factor"),
            long_factor=rope_scaling.get("long_factor"),
            use_long_factors=_engine_max_model_len(max_position) > original,
            factor=rope_scaling.get("factor"),
            attention_factor=rope_scaling.get("attention_factor"),
            scaled_max_position=original_max_position)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: "
                     + ", ".join(_SUPPORTED_ROPE_TYPES))
