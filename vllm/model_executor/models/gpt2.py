"""GPT-2 (`GPT2LMHeadModel`): learned absolute positions, pre-LayerNorm blocks, a plain MLP.

  hidden = wte(input_ids) + wpe(positions)
  per block: hidden += c_proj(attn(c_attn(ln_1(hidden))));  hidden += mlp(ln_2(hidden))
  hidden = ln_f(hidden);  logits = hidden @ wte^T   (lm_head tied to wte unless the config
                                                      says tie_word_embeddings=false)

Checkpoint facts this loader handles:
  - the Conv1D layers (`attn.c_attn`, `attn.c_proj`, `mlp.c_fc`, `mlp.c_proj`) store their
    weight as [in, out]; it is transposed to the linears' [out, in] on load. `c_attn` packs
    q, k and v along its output dimension, loaded as the three parts of a QKVParallelLinear.
  - names come with the `transformer.` prefix (transformers' save_pretrained) or without it
    (the original gpt2 / DialoGPT files on the Hub: `h.0.attn.c_attn.weight`).
  - the causal-mask buffers `attn.bias` / `attn.masked_bias` some files hold are skipped.
Config: `activation_function` (gelu_new by default), `layer_norm_epsilon`, `n_inner` (None:
4 * hidden), `scale_attn_weights` (scale 1/sqrt(head_dim), else 1),
`scale_attn_by_inverse_layer_idx` (the scale divided by layer index + 1).
`reorder_and_upcast_attn` is accepted: in transformers it only makes the eager path compute
q k^T in float32 with the scale folded in, which is the same result as ours up to rounding
(our attention backends accumulate the scores in float32). `add_cross_attention` (an
encoder-decoder GPT-2) is refused.
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
    RowParallelLinear,
    default_weight_loader,
    divide,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.llama import maybe_prefix

# Checkpoint layers written by transformers' Conv1D: weight [in, out].
CONV1D_SUFFIXES = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
# Causal-mask buffers older exporters saved next to the weights.
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def check_gpt2_config(config: Any) -> None:
    """ValueError for GPT-2 configs this decoder-only implementation cannot run."""
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPT-2 config has add_cross_attention=True (an encoder-decoder "
                         "model); only add_cross_attention=False is supported")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"GPT-2 config: n_embd={config.hidden_size} is not divisible by "
                         f"n_head={config.num_attention_heads}")


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, cache_config: Any = None,
                 prefix: str = "") -> None:
        super().__init__()
        hidden_size = config.hidden_size
        total_heads = config.num_attention_heads
        self.head_dim = hidden_size // total_heads
        self.num_heads = divide(total_heads, get_tensor_model_parallel_world_size())
        self.q_size = self.num_heads * self.head_dim
        scale = self.head_dim ** -0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.c_attn = QKVParallelLinear(hidden_size, self.head_dim, total_heads, bias=True,
                                        prefix=maybe_prefix(prefix, "c_attn"))
        self.c_proj = RowParallelLinear(hidden_size, hidden_size, bias=True,
                                        prefix=maybe_prefix(prefix, "c_proj"))
        self.attn = Attention(self.num_heads, self.head_dim, scale, cache_config=cache_config,
                              prefix=maybe_prefix(prefix, "attn"))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(hidden_states)
        q, k, v = qkv.split([self.q_size] * 3, dim=-1)
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        hidden_size = config.hidden_size
        inner = getattr(config, "n_inner", None) or 4 * hidden_size
        self.c_fc = ColumnParallelLinear(hidden_size, inner, bias=True,
                                         prefix=maybe_prefix(prefix, "c_fc"))
        self.c_proj = RowParallelLinear(inner, hidden_size, bias=True,
                                        prefix=maybe_prefix(prefix, "c_proj"))
        self.act = get_act_fn(config.activation_function)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(hidden_states)))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int, cache_config: Any = None,
                 prefix: str = "") -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, layer_idx, cache_config,
                                  prefix=maybe_prefix(prefix, "attn"))
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config, prefix=maybe_prefix(prefix, "mlp"))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


@support_torch_compile
class GPT2Model(nn.Module):
    """The decoder stack: forward(input_ids [T], positions [T]) -> hidden [T, hidden] (after
    ln_f). `positions` are the tokens' absolute positions (< n_positions), the index into the
    learned position table `wpe`."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.text_config
        check_gpt2_config(config)
        self.config = config
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                          prefix=maybe_prefix(prefix, "wte"))
        # Replicated on every rank: a few MB at most, and no all-reduce per step.
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(
            GPT2Block(config, i, vllm_config.cache_config, prefix=maybe_prefix(prefix, f"h.{i}"))
            for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> float32 logits [N, vocab]."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.text_config
        self.config = config
        self.vllm_config = vllm_config
        self.transformer = GPT2Model(vllm_config=vllm_config,
                                     prefix=maybe_prefix(prefix, "transformer"))
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if self.tied:
            self.lm_head.tie_weights(self.transformer.wte)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.attention_layers = collect_attention_layers(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors -> parameters; returns the loaded keys (the packed c_attn as
        "name:q", "name:k", "name:v"). An unknown tensor is a ValueError."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(BUFFER_SUFFIXES):
                continue
            if name.startswith("lm_head."):
                if self.tied:
                    continue  # the embedding is the LM head
            elif not name.startswith("transformer."):
                name = "transformer." + name
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected tensor {name!r}: {type(self).__name__} has no "
                                 "parameter for it")
            if name.endswith(CONV1D_SUFFIXES):
                if tensor.dim() != 2:
                    raise ValueError(f"Conv1D weight {name!r} has shape {tuple(tensor.shape)}; "
                                     "expected [in, out]")
                tensor = tensor.t()
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor)
            shards = getattr(param, "shard_ids", None)
            if shards:  # a fused q|k|v tensor fills every part at once
                loaded.update(f"{name}:{shard}" for shard in shards)
            else:
                loaded.add(name)
        return loaded
