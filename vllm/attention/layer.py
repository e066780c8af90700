"""The Attention layer and the attention custom op, the split point of piecewise compilation.

`Attention.forward(q, k, v)` calls `attention_op`, i.e.
`torch.ops.vllm.unified_attention_with_output` (its name, `ATTENTION_OP_NAME`, is defined once,
in vllm/config/compilation.py), an opaque op to Dynamo: the compiled graph is split around it,
and at run time it reads the batch's attention metadata and the layer (with its KV cache) from
the forward context.
"""
import torch
import torch.nn as nn

from vllm.attention.backends.abstract import check_logits_soft_cap, check_sliding_window
from vllm.compilation.split import register_eager_impl
from vllm.config.compilation import ATTENTION_OP_NAME
from vllm.forward_context import get_forward_context


class Attention(nn.Module):
    """Multi-head / grouped-query attention over this layer's paged KV cache.

    num_heads / num_kv_heads are this rank's head counts; `prefix` is the layer name
    (e.g. "model.layers.0.self_attn.attn"), unique in the model: the key of
    `model.attention_layers`, of the forward context's `attn_layers` and of `bind_kv_cache`.
    `sliding_window`: None (full causal attention) or W, this layer's sliding window: the query
    at position p attends to the keys at positions p - W < j <= p (transformers' semantics).
    The KV cache still keeps every token; the window only limits what attention reads.
    `logits_soft_cap`: None or c > 0: each scaled score s = scale * q.k becomes
    c * tanh(s / c) before the causal/window mask and the softmax (Gemma 2's
    `attn_logit_softcapping`).
    """

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, cache_config=None, quant_config=None,
                 prefix: str = "", attn_backend=None,
                 sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        del quant_config
        if not prefix:
            raise ValueError("Attention needs its layer name as `prefix` "
                             "(e.g. 'model.layers.0.self_attn.attn')")
        self.layer_name = prefix
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        self.scale = float(scale)
        self.sliding_window = check_sliding_window(sliding_window,
                                                   f"sliding_window of {prefix!r}")
        self.logits_soft_cap = check_logits_soft_cap(logits_soft_cap,
                                                     f"logits_soft_cap of {prefix!r}")
        from vllm.config import get_current_vllm_config

        config = get_current_vllm_config()
        if cache_config is None and config is not None:
            cache_config = config.cache_config
        self.block_size = getattr(cache_config, "block_size", None)
        if attn_backend is None:
            from vllm.attention.selector import get_attn_backend

            attn_backend = get_attn_backend(head_size, torch.get_default_dtype(),
                                            block_size=self.block_size,
                                            sliding_window=self.sliding_window,
                                            logits_soft_cap=self.logits_soft_cap)
        else:
            from vllm.attention.selector import missing_features

            missing = missing_features(attn_backend, self.sliding_window, self.logits_soft_cap)
            if missing:
                needs = " or ".join(f"{feature} (layer {prefix!r}, {value})"
                                    for feature, value, _ in missing)
                raise ValueError(f"attention backend {attn_backend.get_name()} does not "
                                 f"support {needs}")
        self.attn_backend = attn_backend
        self.impl = attn_backend.get_impl_cls()(self.num_heads, head_size, self.scale,
                                                self.num_kv_heads,
                                                sliding_window=self.sliding_window,
                                                logits_soft_cap=self.logits_soft_cap)
        # A plain attribute (not a buffer): the engine binds the real cache with
        # bind_kv_cache(); built on the CPU so meta-device construction leaves it usable.
        self.kv_cache = torch.empty(0, device="cpu")
        # An FP8 KV cache holds K / k_scale and V / v_scale (`set_kv_scale`, from the
        # checkpoint); other caches ignore them.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def set_kv_scale(self, which: str, value: torch.Tensor | float) -> None:
        """Set `k_scale`, `v_scale` or both ("kv") from a checkpoint's scale (a scalar, or one
        value per shard: the largest counts)."""
        scale = float(value.float().max()) if isinstance(value, torch.Tensor) else float(value)
        if not (scale > 0.0 and scale != float("inf")):
            raise ValueError(f"{which}_scale of {self.layer_name!r} must be a positive finite "
                             f"number, got {scale}")
        if which in ("k", "kv"):
            self.k_scale = scale
        if which in ("v", "kv"):
            self.v_scale = scale

    def forward(self, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> torch.Tensor:
        """query [T, num_heads*head_size], key/value [T, num_kv_heads*head_size] ->
        [T, num_heads*head_size]."""
        output = torch.empty_like(query)
        attention_op(query, key, value, output, self.layer_name)
        return output

    def get_kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return self.attn_backend.get_kv_cache_shape(num_blocks, block_size, self.num_kv_heads,
                                                    self.head_size)

    def extra_repr(self) -> str:
        return (f"layer_name={self.layer_name!r}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
                f"sliding_window={self.sliding_window}, "
                f"logits_soft_cap={self.logits_soft_cap}, "
                f"backend={self.attn_backend.get_name()}")


def unified_attention_with_output(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  output: torch.Tensor, layer_name: str,
                                  output_scale: torch.Tensor | None = None) -> None:
    """`output_scale` (set by the attention+quant fusion pass): `output` is float8_e4m3fn and
    receives the attention result quantized with this static scale (the backend must report
    `fused_output_quant_supported`)."""
    context = get_forward_context()
    layer = context.attn_layers.get(layer_name)
    if layer is None:
        raise KeyError(f"attention layer {layer_name!r} is not in the forward context's "
                       "attn_layers; pass attn_layers=model.attention_layers to "
                       "set_forward_context()")
    metadata = context.attn_metadata
    if isinstance(metadata, dict):
        metadata = metadata.get(layer_name)
    if metadata is None:  # a dummy / profiling run: no KV cache traffic
        output.zero_()
        return
    if output_scale is None:
        layer.impl.forward(layer, query, key, value, layer.kv_cache, metadata, output)
    else:
        layer.impl.forward(layer, query, key, value, layer.kv_cache, metadata, output,
                           output_scale=output_scale)


def _unified_attention_with_output_fake(query: torch.Tensor, key: torch.Tensor,
                                        value: torch.Tensor, output: torch.Tensor,
                                        layer_name: str,
                                        output_scale: torch.Tensor | None = None) -> None:
    return None


# Registered through a library fragment rather than `torch.library.custom_op`: the op runs
# once per layer per step, and custom_op's Python wrapper (argument and aliasing checks on
# every call) cost ~9 us of the ~10 us a call took on the dev machine, against ~1 us for a
# plain implementation (5-8% of a batch-1 decode step of the demo model).
_NAMESPACE, _OP = ATTENTION_OP_NAME.split("::")
_lib = torch.library.Library(_NAMESPACE, "FRAGMENT")  # noqa: TOR901
_lib.define(_OP + "(Tensor query, Tensor key, Tensor value, Tensor(a!) output, str layer_name, "
                  "Tensor? output_scale=None) -> ()")
_lib.impl(_OP, unified_attention_with_output, "CompositeExplicitAutograd")
torch.library.register_fake(ATTENTION_OP_NAME, _unified_attention_with_output_fake, lib=_lib)
# A splitting piece (the op runs eagerly between the compiled pieces) calls the function
# directly, not through the dispatcher.
register_eager_impl(ATTENTION_OP_NAME, unified_attention_with_output)
# The op as callers and passes use it: torch.ops.vllm.unified_attention_with_output (its
# `.default` overload is the node target in traced graphs).
attention_op = getattr(getattr(torch.ops, _NAMESPACE), _OP)


def collect_attention_layers(model: nn.Module) -> dict[str, Attention]:
    """{layer_name: Attention} for every Attention module in `model` (names must be unique)."""
    layers: dict[str, Attention] = {}
    for module in model.modules():
        if isinstance(module, Attention):
            if module.layer_name in layers and layers[module.layer_name] is not module:
                raise ValueError(f"two attention layers share the name {module.layer_name!r}")
            layers[module.layer_name] = module
    return layers


def bind_kv_cache(model: nn.Module | dict[str, Attention],
                  kv_caches: dict[str, torch.Tensor]) -> None:
    """Give every attention layer its KV cache tensor
    [2, num_blocks, block_size, num_kv_heads, head_size] (block 0 is the dummy block).

    Allocate caches with torch.zeros, not torch.empty: batched reads cover whole blocks and
    mask the unused slots, and a masked weight of 0 times a NaN left in uninitialised memory
    is still NaN."""
    if isinstance(model, dict):
        layers = model
    else:
        layers = getattr(model, "attention_layers", None) or collect_attention_layers(model)
    missing = sorted(set(layers) - set(kv_caches))
    unknown = sorted(set(kv_caches) - set(layers))
    if missing or unknown:
        raise ValueError(f"bind_kv_cache: layers without a cache: {missing}; caches for unknown "
                         f"layers: {unknown}")
    for name, layer in layers.items():
        cache = kv_caches[name]
        if (cache.dim() != 5 or cache.shape[0] != 2 or cache.shape[3] != layer.num_kv_heads
                or cache.shape[4] != layer.head_size):
            raise ValueError(
                f"KV cache of {name!r} has shape {tuple(cache.shape)}; expected [2, num_blocks, "
                f"block_size, {layer.num_kv_heads}, {layer.head_size}]")
        layer.kv_cache = cache
