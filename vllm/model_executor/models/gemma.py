"""Gemma (1): the decoder blocks Gemma 2 and Gemma 3 build on.

What differs from Llama (transformers' Gemma is the reference):
  * the token embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype first;
  * every norm is `GemmaRMSNorm`: x / rms(x) * (1 + weight), the product taken in float32;
  * the gated MLP's activation comes from `hidden_act`, where the legacy "gelu" of the
    released configs means the tanh approximation (transformers rewrites it the same way);
  * the LM head is tied to the embedding (`tie_word_embeddings`, true by default).
Gemma 2 and 3 reuse `GemmaAttention` (own attention scale, optional logits soft-cap and
per-head q/k norms), `GemmaModel` (one compiled stack; the layer class says which layers
slide and which rotary embedding each uses) and `GemmaForCausalLM` (loading, final soft-cap).

The interface is Llama's (see llama.py): forward(input_ids [T], positions [T]) ->
hidden [T, hidden]; compute_logits -> float32 [N, vocab]; load_weights; attention_layers.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from vllm.attention.layer import Attention
from vllm.compilation.decorators import support_torch_compile
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import (
    RotaryEmbedding,
    get_rope,
    rope_config,
    rope_max_position,
)
from vllm.model_executor.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    config_sliding_window,
    head_dim_of,
    maybe_prefix,
    pp_embedding,
)
from vllm.model_executor.models.pipeline import PPMissingLayer, is_last_stage, make_layers

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
_LAYER_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION)


def gemma_hidden_act(config: Any) -> str:
    """Gemma 1's MLP activation: `hidden_act`, where "gelu" (the released configs' legacy
    value) means "gelu_pytorch_tanh", as transformers reads it."""
    act = getattr(config, "hidden_act", None) or "gelu_pytorch_tanh"
    return "gelu_pytorch_tanh" if act == "gelu" else act


def embedding_normalizer(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) rounded to `dtype` (transformers casts the scale to the embedding's
    dtype before multiplying: 55.4256 becomes 55.5 in bfloat16 for hidden_size 3072)."""
    return float(torch.tensor(hidden_size ** 0.5, dtype=torch.float64, device="cpu").to(dtype))


def check_causal(config: Any) -> None:
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True in the model config is not supported "
                         "(embedding-style Gemma); supported: causal attention "
                         "(use_bidirectional_attention false or absent)")


def layer_kinds_from_config(config: Any, pattern: int) -> list[str]:
    """Each layer's attention kind ("full_attention" / "sliding_attention") from
    `config.layer_types`; when absent, every `pattern`-th layer (1-based) is global and the
    others slide, as transformers fills `layer_types` for Gemma 2 (pattern 2) and Gemma 3
    (`sliding_window_pattern`, default 6)."""
    num_layers = config.num_hidden_layers
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        return [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION
                for i in range(num_layers)]
    kinds = list(kinds)
    if len(kinds) != num_layers:
        raise ValueError(f"the model config's layer_types has {len(kinds)} entries for "
                         f"num_hidden_layers={num_layers}")
    for i, kind in enumerate(kinds):
        if kind not in _LAYER_KINDS:
            raise ValueError(f"the model config's layer_types[{i}] is {kind!r}; supported: "
                             + ", ".join(repr(k) for k in _LAYER_KINDS))
    return kinds


class GemmaAttention(nn.Module):
    """Grouped-query attention with RoPE; heads split over the tensor-parallel ranks.

    `scaling`: the score scale (Gemma: head_dim**-0.5; Gemma 2/3: query_pre_attn_scalar**-0.5).
    `logits_soft_cap`: None or c, scores become c * tanh(s / c) inside the attention op.
    `qk_norm`: a GemmaRMSNorm over each query and key head before RoPE (Gemma 3)."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, *, scaling: float,
                 logits_soft_cap: float | None = None, qk_norm: bool = False,
                 cache_config: Any = None, quant_config: Any = None, prefix: str = "",
                 sliding_window: int | None = None) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or \
            self.total_num_heads
        self.head_dim = head_dim_of(config)
        self.num_heads = self.total_num_heads // tp_size
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, self.total_num_heads,
                                          self.total_num_kv_heads, bias=bias,
                                          quant_config=quant_config,
                                          prefix=maybe_prefix(prefix, "qkv_proj"))
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, config.hidden_size,
                                        bias=bias, quant_config=quant_config,
                                        prefix=maybe_prefix(prefix, "o_proj"))
        if qk_norm:
            eps = getattr(config, "rms_norm_eps", 1e-6)
            self.q_norm = GemmaRMSNorm(self.head_dim, eps=eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps=eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, scaling,
                              num_kv_heads=self.num_kv_heads, cache_config=cache_config,
                              quant_config=quant_config, prefix=maybe_prefix(prefix, "attn"),
                              sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            num_tokens = q.shape[0]
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
            q = q.view(num_tokens, self.q_size)
            k = k.view(num_tokens, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class GemmaDecoderLayer(nn.Module):
    """Gemma 1: norm -> attention -> residual add -> norm -> MLP (the Llama order).

    Class-level hooks the model reads before building the layers (Gemma 2/3 override them):
    `layer_kinds(config)`, `rotary_embeddings(config)` ({kind: rotary module}),
    `attention_scaling(config)`, `attention_soft_cap(config)`, `hidden_act(config)`,
    and `qk_norm` (per-head q/k norms)."""

    qk_norm = False

    @staticmethod
    def layer_kinds(config: Any) -> list[str]:
        """Gemma 1 has no sliding window: every layer is global."""
        return [FULL_ATTENTION] * config.num_hidden_layers

    @staticmethod
    def rotary_embeddings(config: Any) -> dict[str, RotaryEmbedding]:
        """One rotary module (and one cos/sin cache) for every layer."""
        theta, scaling, partial = rope_config(config)
        head_dim = head_dim_of(config)
        rope = get_rope(head_dim, int(head_dim * partial), rope_max_position(config), theta,
                        scaling, original_max_position=config.max_position_embeddings)
        return {FULL_ATTENTION: rope, SLIDING_ATTENTION: rope}

    @staticmethod
    def attention_scaling(config: Any) -> float:
        return head_dim_of(config) ** -0.5

    @staticmethod
    def attention_soft_cap(config: Any) -> float | None:
        return None

    @staticmethod
    def hidden_act(config: Any) -> str:
        return gemma_hidden_act(config)

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, cache_config: Any = None,
                 quant_config: Any = None, prefix: str = "",
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(
            config, rotary_emb, scaling=self.attention_scaling(config),
            logits_soft_cap=self.attention_soft_cap(config), qk_norm=self.qk_norm,
            cache_config=cache_config, quant_config=quant_config,
            prefix=maybe_prefix(prefix, "self_attn"), sliding_window=sliding_window)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, self.hidden_act(config),
                            quant_config=quant_config, prefix=maybe_prefix(prefix, "mlp"))
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)

    # Llama's order exactly: returns (this layer's output before its residual add, the
    # residual stream); the next layer's first norm (or the final norm) adds them.
    forward = LlamaDecoderLayer.forward
    _mlp = LlamaDecoderLayer._mlp


@support_torch_compile
class GemmaModel(nn.Module):
    """The Gemma decoder stack (Gemma 1, 2 and 3 through `layer_type`):
    forward(input_ids [T], positions [T]) -> hidden [T, hidden].

    Compiled with `@support_torch_compile` at -O1..-O3 like LlamaModel (token dimension
    dynamic, the graph split at each layer's attention op)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "",
                 layer_type: type[GemmaDecoderLayer] = GemmaDecoderLayer) -> None:
        super().__init__()
        config = vllm_config.model_config.text_config
        check_causal(config)
        self.config = config
        self.vocab_size = config.vocab_size
        self.embed_tokens = pp_embedding(config, prefix)
        # The model is built with its dtype as torch's default dtype (see model_loader).
        self.normalizer = embedding_normalizer(config.hidden_size, torch.get_default_dtype())
        kinds = layer_type.layer_kinds(config)
        ropes = layer_type.rotary_embeddings(config)
        window = config_sliding_window(config)
        # Pipeline parallelism as in LlamaModel (models/pipeline.py).
        self.start_layer, self.end_layer, self.layers = make_layers(
            len(kinds),
            lambda i: layer_type(config, ropes[kinds[i]], cache_config=vllm_config.cache_config,
                                 quant_config=None, prefix=maybe_prefix(prefix, f"layers.{i}"),
                                 sliding_window=window if kinds[i] == SLIDING_ATTENTION
                                 else None))
        self.norm = (GemmaRMSNorm(config.hidden_size, eps=getattr(config, "rms_norm_eps", 1e-6))
                     if is_last_stage() else PPMissingLayer())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> Any:
        if hidden_states is None:
            hidden_states = self.embed_tokens(input_ids) * self.normalizer
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if isinstance(self.norm, PPMissingLayer):
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class GemmaForCausalLM(LlamaForCausalLM):
    """Llama's head, loading and packing (q/k/v -> qkv_proj, gate/up -> gate_up_proj) over
    the Gemma stack; `final_logit_softcapping` (Gemma 2, optional in Gemma 3) caps the
    float32 logits as c * tanh(logits / c)."""

    model_cls = GemmaModel
    layer_cls = GemmaDecoderLayer

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.logits_processor = LogitsProcessor(
            self.config.vocab_size, soft_cap=getattr(self.config, "final_logit_softcapping",
                                                     None))
