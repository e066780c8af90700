"""OPT (`OPTForCausalLM`): learned absolute positions with an offset of 2, LayerNorm blocks
(pre-LN, or post-LN where `do_layer_norm_before` is false, as in opt-350m), a plain MLP.

  x = embed_tokens(input_ids)                 [T, word_embed_proj_dim]
  x = project_in(x)  (only when word_embed_proj_dim != hidden_size)
  hidden = x + embed_positions(positions + 2)
  per layer, pre-LN:  h += attn(self_attn_layer_norm(h));  h += fc2(act(fc1(final_layer_norm(h))))
             post-LN: h = self_attn_layer_norm(h + attn(h)); h = final_layer_norm(h + mlp(h))
  hidden = final_layer_norm(hidden)   (decoder-level; only pre-LN without _remove_final_layer_norm)
  hidden = project_out(hidden)        (only when word_embed_proj_dim != hidden_size)
  logits = hidden @ embed_tokens^T    (tied unless tie_word_embeddings=false)

Attention: q/k/v/out_proj (biases when `enable_bias`), scale head_dim**-0.5 (transformers
multiplies q by it; the attention op applies it to q k^T, the same product). LayerNorms
have no weight or bias when `layer_norm_elementwise_affine` is false.
Checkpoint names: `model.decoder.*` (transformers' save_pretrained) or `decoder.*` (the
original facebook/opt-* files on the Hub); `lm_head.weight` is skipped when tied.
"""
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from vllm.attention.layer import Attention, collect_attention_layers
from vllm.compilation.decorators import support_torch_compile
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.llama import LlamaForCausalLM, maybe_prefix

# OPTLearnedPositionalEmbedding looks up position + 2 (rows 0 and 1 are never used).
POSITION_OFFSET = 2


def _layer_norm(config: Any) -> nn.LayerNorm:
    # transformers builds OPT's LayerNorms with torch's default eps (1e-5).
    return nn.LayerNorm(config.hidden_size,
                        elementwise_affine=bool(getattr(config, "layer_norm_elementwise_affine",
                                                        True)))


class OPTAttention(nn.Module):
    def __init__(self, config: Any, cache_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        hidden_size = config.hidden_size
        total_heads = config.num_attention_heads
        if hidden_size % total_heads:
            raise ValueError(f"OPT config: hidden_size={hidden_size} is not divisible by "
                             f"num_attention_heads={total_heads}")
        bias = bool(getattr(config, "enable_bias", True))
        self.head_dim = hidden_size // total_heads
        self.num_heads = divide(total_heads, get_tensor_model_parallel_world_size())
        self.q_size = self.num_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, total_heads, bias=bias,
                                          prefix=maybe_prefix(prefix, "qkv_proj"))
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, bias=bias,
                                          prefix=maybe_prefix(prefix, "out_proj"))
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              cache_config=cache_config, prefix=maybe_prefix(prefix, "attn"))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size] * 3, dim=-1)
        return self.out_proj(self.attn(q, k, v))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any, cache_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        bias = bool(getattr(config, "enable_bias", True))
        self.do_layer_norm_before = bool(config.do_layer_norm_before)
        self.self_attn = OPTAttention(config, cache_config,
                                      prefix=maybe_prefix(prefix, "self_attn"))
        self.self_attn_layer_norm = _layer_norm(config)
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_dim, bias=bias,
                                        prefix=maybe_prefix(prefix, "fc1"))
        self.fc2 = RowParallelLinear(config.ffn_dim, config.hidden_size, bias=bias,
                                     prefix=maybe_prefix(prefix, "fc2"))
        self.activation_fn = get_act_fn(config.activation_function)
        self.final_layer_norm = _layer_norm(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.do_layer_norm_before:
            hidden_states = hidden_states + self.self_attn(
                self.self_attn_layer_norm(hidden_states))
            mlp_in = self.final_layer_norm(hidden_states)
            return hidden_states + self.fc2(self.activation_fn(self.fc1(mlp_in)))
        hidden_states = self.self_attn_layer_norm(hidden_states + self.self_attn(hidden_states))
        mlp_out = self.fc2(self.activation_fn(self.fc1(hidden_states)))
        return self.final_layer_norm(hidden_states + mlp_out)


class OPTDecoder(nn.Module):
    def __init__(self, config: Any, cache_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        embed_dim = config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, embed_dim,
                                                   prefix=maybe_prefix(prefix, "embed_tokens"))
        # Replicated on every rank: small, and no all-reduce per step.
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET,
                                            config.hidden_size)
        if embed_dim != config.hidden_size:
            self.project_in = ReplicatedLinear(embed_dim, config.hidden_size, bias=False,
                                               prefix=maybe_prefix(prefix, "project_in"))
            self.project_out = ReplicatedLinear(config.hidden_size, embed_dim, bias=False,
                                                prefix=maybe_prefix(prefix, "project_out"))
        else:
            self.project_in = None
            self.project_out = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm",
                                                       False):
            self.final_layer_norm = _layer_norm(config)
        else:
            self.final_layer_norm = None
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, cache_config, prefix=maybe_prefix(prefix, f"layers.{i}"))
            for i in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden_states = self.project_in(hidden_states)
        hidden_states = hidden_states + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        return hidden_states


@support_torch_compile
class OPTModel(nn.Module):
    """The decoder stack: forward(input_ids [T], positions [T]) -> hidden
    [T, word_embed_proj_dim]. `positions` are absolute (0-based, < max_position_embeddings)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.decoder = OPTDecoder(vllm_config.model_config.text_config,
                                  vllm_config.cache_config,
                                  prefix=maybe_prefix(prefix, "decoder"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.decoder(input_ids, positions)


class OPTForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, word_embed_proj_dim];
    compute_logits(hidden [N, word_embed_proj_dim]) -> float32 logits [N, vocab]."""

    # (parameter name part, checkpoint name part, shard id)
    stacked_params_mapping: list[tuple[str, str, Any]] = [
        (".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v")]

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.text_config
        self.config = config
        self.vllm_config = vllm_config
        self.model = OPTModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.word_embed_proj_dim,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if self.tied:
            self.lm_head.tie_weights(self.model.decoder.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.attention_layers = collect_attention_layers(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors -> parameters; returns the loaded keys (q/k/v as
        "...qkv_proj.weight:q" etc.). An unknown tensor is a ValueError."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("lm_head."):
                if self.tied:
                    continue  # the embedding is the LM head
            elif name.startswith("decoder."):
                name = "model." + name
            key = self._load_one(name, tensor, params)
            if key is None:
                raise ValueError(f"unexpected tensor {name!r}: {type(self).__name__} has no "
                                 "parameter for it")
            loaded.add(key)
        return loaded

    # One checkpoint tensor: Llama's packed (q/k/v -> qkv_proj) or plain loading; no experts.
    _load_one = LlamaForCausalLM._load_one
    _load_expert_weight = LlamaForCausalLM._load_expert_weight
