"""The attention custom op: registered as a plain library op (no per-call Python wrapper),
with a fake for tracing and the mutation of `output` in its schema."""
from __future__ import annotations

import torch
from torch._library.custom_ops import _maybe_get_opdef

import vllm.attention.layer as layer
from vllm.attention.layer import ATTENTION_OP_NAME


def test_attention_op_has_no_custom_op_wrapper():
    """`torch.library.custom_op` wraps every call in argument and aliasing checks (~9 us,
    called once per layer per step); the op is defined through a library fragment instead."""
    assert _maybe_get_opdef(ATTENTION_OP_NAME) is None
    schema = torch.ops.vllm.unified_attention_with_output.default._schema
    output = next(a for a in schema.arguments if a.name == "output")
    assert output.alias_info is not None and output.alias_info.is_write
    assert [a.name for a in schema.arguments] == ["query", "key", "value", "output",
                                                  "layer_name", "output_scale"]


def test_attention_op_calls_the_layer_from_the_forward_context(monkeypatch):
    calls = []

    class Impl:
        def forward(self, lay, q, k, v, kv_cache, metadata, output, output_scale=None):
            calls.append((lay, metadata, output_scale))
            output.copy_(q + 1)

    class Layer:
        impl = Impl()
        kv_cache = torch.empty(0)

    class Context:
        attn_layers = {"l0": Layer()}
        attn_metadata = {"l0": "meta"}

    monkeypatch.setattr(layer, "get_forward_context", lambda: Context())
    q = torch.randn(3, 4)
    out = torch.empty_like(q)
    torch.ops.vllm.unified_attention_with_output(q, q, q, out, "l0")
    torch.testing.assert_close(out, q + 1)
    assert calls == [(Context.attn_layers["l0"], "meta", None)]
    Context.attn_metadata = {}  # a dummy run: no metadata for the layer -> zeros
    torch.ops.vllm.unified_attention_with_output(q, q, q, out, "l0")
    assert torch.count_nonzero(out) == 0
