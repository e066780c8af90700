"""Llama family (Llama 2/3, Mistral-style configs): the decoder blocks other models reuse.

Interface of every `*ForCausalLM` here:
  forward(input_ids [T], positions [T]) -> hidden_states [T, hidden]   (flattened batch)
  compute_logits(hidden_states [N, hidden]) -> logits [N, vocab] float32
  load_weights(iterable of (checkpoint name, tensor)) -> set of loaded parameter keys
  attention_layers: {layer_name: Attention}
Subclasses change parts through hooks: `LlamaAttention._qk_norm`, `LlamaDecoderLayer`'s
`_init_mlp` / `_mlp` / `layer_sliding_window`, and the class attributes `model_cls` /
`layer_cls` / `attention_cls`.

Sliding-window attention follows transformers: Mistral-style configs (Llama, Mistral, Mixtral)
give every layer `config.sliding_window` when it is set; Qwen2/Qwen3 configs only when
`use_sliding_window` is true, and then only the layers `config.layer_types` marks
"sliding_attention" (derived from `max_window_layers` when absent).
"""
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from vllm.attention.backends.abstract import check_sliding_window
from vllm.attention.layer import Attention, collect_attention_layers
from vllm.compilation.decorators import support_torch_compile
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.layers.activation import get_act_and_mul_fn
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import (
    RotaryEmbedding,
    get_rope,
    rope_config,
    rope_max_position,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.pipeline import (
    PPMissingLayer,
    is_first_stage,
    is_last_stage,
    is_pp_missing_parameter,
    make_layers,
    pp_forward,
)

logger = init_logger(__name__)

# Checkpoint tensors that are not parameters (buffers some exporters wrote).
SKIPPED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached",
                           "rotary_emb.sin_cached")
# A checkpoint's FP8 KV-cache scales, under `<layer>.self_attn.`: the suffix -> which scale
# of the layer's Attention (llm-compressor / the fp8 method, compressed-tensors' output
# scales, ModelOpt's, the older single kv_scale for both).
KV_SCALE_SUFFIXES = {"k_scale": "k", "v_scale": "v", "attn.k_scale": "k", "attn.v_scale": "v",
                     "k_proj.output_scale": "k", "v_proj.output_scale": "v",
                     "k_proj.k_scale": "k", "v_proj.v_scale": "v", "kv_scale": "kv",
                     "attn.kv_scale": "kv"}


def kv_scale_target(name: str) -> tuple[str, str] | None:
    """(the Attention layer's name, "k" / "v" / "kv") of a checkpoint's KV-cache scale, or
    None for any other tensor."""
    base, sep, rest = name.rpartition(".self_attn.")
    which = KV_SCALE_SUFFIXES.get(rest) if sep else None
    return (f"{base}.self_attn.attn", which) if which else None


def maybe_prefix(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def config_sliding_window(config: Any) -> int | None:
    """`config.sliding_window` checked: a positive int or None (ValueError naming it)."""
    return check_sliding_window(getattr(config, "sliding_window", None),
                                "the model config's sliding_window")


def layer_types_sliding_window(config: Any, layer_idx: int) -> int | None:
    """The window of layer `layer_idx` for configs with per-layer attention types (Qwen2,
    Qwen3), as transformers picks it: none unless `use_sliding_window`; then
    `config.sliding_window` on the layers `layer_types` marks "sliding_attention" (when
    `layer_types` is absent: the layers from `max_window_layers` on)."""
    if not getattr(config, "use_sliding_window", False):
        return None
    window = config_sliding_window(config)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        first_sliding = getattr(config, "max_window_layers", 28)  # transformers' default
        return window if layer_idx >= first_sliding else None
    if len(layer_types) != config.num_hidden_layers:
        raise ValueError(f"the model config's layer_types has {len(layer_types)} entries for "
                         f"num_hidden_layers={config.num_hidden_layers}")
    kind = layer_types[layer_idx]
    if kind == "sliding_attention":
        return window
    if kind == "full_attention":
        return None
    raise ValueError(f"the model config's layer_types[{layer_idx}] is {kind!r}; supported: "
                     "'full_attention', 'sliding_attention'")


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str,
                 bias: bool = False, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, quant_config=quant_config,
            prefix=maybe_prefix(prefix, "gate_up_proj"))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           quant_config=quant_config,
                                           prefix=maybe_prefix(prefix, "down_proj"))
        self.act_fn = get_act_and_mul_fn(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, qkv_bias: bool = False,
                 o_bias: bool = False, cache_config: Any = None, quant_config: Any = None,
                 prefix: str = "", sliding_window: int | None = None) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        hidden_size = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or \
            self.total_num_heads
        self.head_dim = head_dim_of(config)
        self.num_heads = self.total_num_heads // tp_size
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, self.total_num_heads,
                                          self.total_num_kv_heads, bias=qkv_bias,
                                          quant_config=quant_config,
                                          prefix=maybe_prefix(prefix, "qkv_proj"))
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, hidden_size,
                                        bias=o_bias, quant_config=quant_config,
                                        prefix=maybe_prefix(prefix, "o_proj"))
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, self.scaling,
                              num_kv_heads=self.num_kv_heads, cache_config=cache_config,
                              quant_config=quant_config, prefix=maybe_prefix(prefix, "attn"),
                              sliding_window=sliding_window)

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._qk_norm(q, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        """(qkv_proj has bias, o_proj has bias)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @staticmethod
    def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
        """This layer's sliding window: Mistral-style, `config.sliding_window` on every layer
        (transformers' Llama, Mistral and Mixtral)."""
        del layer_idx
        return config_sliding_window(config)

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, cache_config: Any = None,
                 quant_config: Any = None, prefix: str = "",
                 sliding_window: int | None = None) -> None:
        super().__init__()
        qkv_bias, o_bias = self.attention_biases(config)
        self.self_attn = self.attention_cls(config, rotary_emb, qkv_bias=qkv_bias, o_bias=o_bias,
                                            cache_config=cache_config, quant_config=quant_config,
                                            prefix=maybe_prefix(prefix, "self_attn"),
                                            sliding_window=sliding_window)
        self._init_mlp(config, quant_config, prefix)
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)

    def _init_mlp(self, config: Any, quant_config: Any, prefix: str) -> None:
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            bias=bool(getattr(config, "mlp_bias", False)),
                            quant_config=quant_config, prefix=maybe_prefix(prefix, "mlp"))

    def _mlp(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.mlp(hidden_states)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self._mlp(hidden_states), residual


@support_torch_compile
class LlamaModel(nn.Module):
    """The decoder stack: forward(input_ids [T], positions [T]) -> hidden [T, hidden].

    Compiled with `@support_torch_compile` at -O1..-O3 (the token dimension T dynamic, the
    graph split at the attention op); Qwen2, Qwen3 and Mixtral reuse it with their layer
    types, so every architecture here compiles through it."""

    def __init__(self, *, vllm_config: Any, prefix: str = "",
                 layer_type: type[LlamaDecoderLayer] = LlamaDecoderLayer) -> None:
        super().__init__()
        config = vllm_config.model_config.text_config
        cache_config = vllm_config.cache_config
        quant_config = None
        self.config = config
        self.vocab_size = config.vocab_size
        self.embed_tokens = pp_embedding(config, prefix)
        theta, scaling, partial = rope_config(config)
        head_dim = head_dim_of(config)
        # One rotary module (and one cos/sin cache) shared by every layer.
        rotary_emb = get_rope(head_dim, int(head_dim * partial), rope_max_position(config),
                              theta, scaling,
                              original_max_position=config.max_position_embeddings)
        # Pipeline parallelism: this stage's layers [start_layer, end_layer), placeholders
        # for the others (models/pipeline.py).
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda i: layer_type(config, rotary_emb, cache_config=cache_config,
                                 quant_config=quant_config,
                                 prefix=maybe_prefix(prefix, f"layers.{i}"),
                                 sliding_window=layer_type.layer_sliding_window(config, i)))
        self.norm = (RMSNorm(config.hidden_size, eps=getattr(config, "rms_norm_eps", 1e-6))
                     if is_last_stage() else PPMissingLayer())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> Any:
        """A pipeline stage after the first passes the previous stage's `hidden_states` and
        `residual`; a stage before the last returns them (see models/pipeline.py)."""
        if hidden_states is None:
            hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if isinstance(self.norm, PPMissingLayer):
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


def pp_embedding(config: Any, prefix: str) -> nn.Module:
    """The token embedding, on the first pipeline stage (and on the last when the LM head is
    tied to it); a placeholder elsewhere."""
    if is_first_stage() or (is_last_stage() and getattr(config, "tie_word_embeddings", False)):
        return VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                      prefix=maybe_prefix(prefix, "embed_tokens"))
    return PPMissingLayer()


class LlamaForCausalLM(nn.Module):
    supports_pp = True
    model_cls = LlamaModel
    layer_cls = LlamaDecoderLayer
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}
    # (parameter name part, checkpoint name part, shard id)
    stacked_params_mapping: list[tuple[str, str, Any]] = [
        (".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"), (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1)]

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.text_config
        self.config = config
        self.vllm_config = vllm_config
        self.model = self.model_cls(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                    layer_type=self.layer_cls)
        if is_last_stage():
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                          prefix=maybe_prefix(prefix, "lm_head"))
            if getattr(config, "tie_word_embeddings", False):
                self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.attention_layers = collect_attention_layers(self)
        windows = sorted({layer.sliding_window for layer in self.attention_layers.values()
                          if layer.sliding_window is not None})
        if windows:
            sliding = sum(layer.sliding_window is not None
                          for layer in self.attention_layers.values())
            logger.info("Sliding-window attention: window %s on %d of %d layers",
                        "/".join(map(str, windows)), sliding, len(self.attention_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return pp_forward(self.model, input_ids, positions, self.config.hidden_size,
                          self.vllm_config.model_config.torch_dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Logits; None on a pipeline stage before the last (it has no LM head)."""
        if isinstance(self.lm_head, PPMissingLayer):
            return None
        return self.logits_processor(self.lm_head, hidden_states)

    def _load_expert_weight(self, name: str, tensor: torch.Tensor,
                            params: dict[str, nn.Parameter]) -> str | None:
        """Hook for MoE models: load `name` if it is an expert tensor; return its key."""
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the parameters through their weight loaders.

        Returns loaded keys: a parameter's name, or "name:shard" for each part of a packed
        parameter (compare with the `shard_ids` attribute). Unknown tensors raise ValueError.
        FP8 KV-cache scales (`kv_scale_target`) go to their Attention layer's k_scale /
        v_scale (used by an FP8 KV cache only)."""
        params = dict(self.named_parameters())
        tied = getattr(self.config, "tie_word_embeddings", False)
        pp = self.vllm_config.parallel_config.pipeline_parallel_size > 1
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(SKIPPED_TENSOR_SUFFIXES):
                continue
            if tied and name.startswith("lm_head."):
                continue  # the embedding is the LM head
            target = kv_scale_target(name)
            if target is not None and (target[0] in self.attention_layers or pp):
                if target[0] in self.attention_layers:  # (else another stage's layer)
                    self.attention_layers[target[0]].set_kv_scale(target[1], tensor)
                continue
            if pp and is_pp_missing_parameter(name, self):
                continue  # another pipeline stage's
            key = self._load_one(name, tensor, params)
            if key is None:
                raise ValueError(f"unexpected tensor {name!r}: {type(self).__name__} has no "
                                 "parameter for it")
            loaded.add(key)
        return loaded

    def _load_one(self, name: str, tensor: torch.Tensor,
                  params: dict[str, nn.Parameter]) -> str | None:
        for param_part, ckpt_part, shard_id in self.stacked_params_mapping:
            if ckpt_part not in name:
                continue
            param_name = name.replace(ckpt_part, param_part)
            param = params.get(param_name)
            if param is None:
                continue
            param.weight_loader(param, tensor, shard_id)
            return f"{param_name}:{shard_id}"
        key = self._load_expert_weight(name, tensor, params)
        if key is not None:
            return key
        param = params.get(name)
        if param is None:
            return None
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, tensor)
        return name
