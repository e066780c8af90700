"""AttnQuantFusionPass on a small graph: the attention custom op (paged torch SDPA, real KV
cache) followed by a static FP8 quant -> the attention op writing FP8 itself."""
from __future__ import annotations

import functools
import operator

import pytest
import torch
import torch.nn as nn

from tests.compile.passes.fp8_fusion_utils import QUANT_OPS, assert_fp8_close, compile_with_passes
from vllm.attention.backends.torch_sdpa import TorchSDPAMetadataBuilder
from vllm.attention.layer import Attention, bind_kv_cache
from vllm.compilation.passes.fusion import matcher_utils as mu
from vllm.compilation.passes.fusion.attn_quant_fusion import AttnQuantFusionPass
from vllm.compilation.passes.utility.noop_elimination import NoOpEliminationPass
from vllm.config import CacheConfig, CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 4, 2, 32, 16
ATTN = "model.layers.0.self_attn.attn"


@functools.lru_cache(maxsize=None)
def fusion_pass(dtype: torch.dtype, decompose: bool, supported: bool = True):
    return AttnQuantFusionPass(None, dtypes=[dtype], decompose=[decompose],
                               backend_supported=supported)


class AttnQuant(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.attn = Attention(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, num_kv_heads=KV_HEADS,
                              prefix=ATTN)
        self.quant = QuantFP8(True, mu.STATIC.group_shape)
        self.scale = nn.Parameter(torch.tensor([0.01]), requires_grad=False)
        self.dtype = dtype

    def forward(self, q, k, v):
        out = self.attn(q, k, v)
        q8, _ = self.quant(out.reshape(-1, out.shape[-1]), self.scale)  # as Fp8LinearMethod
        return q8


def build(custom_ops: bool, dtype: torch.dtype) -> tuple[AttnQuant, VllmConfig]:
    config = VllmConfig(compilation_config=CompilationConfig(
        custom_ops=["all" if custom_ops else "none"]), cache_config=CacheConfig(
            block_size=BLOCK))
    with set_current_vllm_config(config):
        module = AttnQuant(dtype)
    cache = torch.zeros(module.attn.get_kv_cache_shape(8, BLOCK), dtype=dtype)
    bind_kv_cache({ATTN: module.attn}, {ATTN: cache})
    return module, config


def run_batch(fn, module, config, dtype, query_lens):
    """One step: request i writes/reads block i+1 (prefill of query_lens[i] tokens)."""
    n = sum(query_lens)
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(n, HEADS * HEAD_SIZE, generator=gen).to(dtype)
    k = torch.randn(n, KV_HEADS * HEAD_SIZE, generator=gen).to(dtype)
    v = torch.randn(n, KV_HEADS * HEAD_SIZE, generator=gen).to(dtype)
    slots = [(i + 1) * BLOCK + j for i, ql in enumerate(query_lens) for j in range(ql)]
    md = TorchSDPAMetadataBuilder().build(list(query_lens), list(query_lens),
                                          [[i + 1] for i in range(len(query_lens))], slots)
    with set_forward_context(md, config, attn_layers={ATTN: module.attn}):
        return fn(q, k, v)


def _attention_nodes(graph):
    from torch._higher_order_ops.auto_functionalize import (
        auto_functionalized,
        auto_functionalized_v2,
    )

    return [n for n in graph.nodes
            if n.op == "call_function" and n.target in (auto_functionalized,
                                                         auto_functionalized_v2)]


@pytest.mark.parametrize("v2", [False, True], ids=["auto_functionalized", "v2"])
@pytest.mark.parametrize("decompose", [False, True], ids=["aten", "inductor-ir"])
@pytest.mark.parametrize("custom_ops", [True, False], ids=["custom-ops", "torch-native"])
def test_attention_writes_fp8(custom_ops, decompose, v2):
    dtype = torch.bfloat16
    module, config = build(custom_ops, dtype)
    fusion = fusion_pass(dtype, decompose)
    want = run_batch(module, module, config, dtype, [3, 5])
    run, cap = compile_with_passes(module, [NoOpEliminationPass(), fusion], decompose,
                                   functionalized_v2=v2)
    got = run_batch(run, module, config, dtype, [3, 5])
    assert fusion.matched_count == 1
    assert sum(cap.after[op] for op in QUANT_OPS) == 0 and cap.fp8_converts_after == 0
    (attn,) = _attention_nodes(cap.graph)
    assert attn.kwargs["output_scale"] is not None
    out = next(u for u in attn.users if u.target is operator.getitem)
    assert out.meta["val"].dtype == torch.float8_e4m3fn
    assert got.dtype == torch.float8_e4m3fn
    assert_fp8_close(got, want)
    # A decode-like step with other sizes uses the same graph.
    assert_fp8_close(run_batch(run, module, config, dtype, [1, 1, 2]),
                     run_batch(module, module, config, dtype, [1, 1, 2]))


def test_unsupported_backend_keeps_the_quant():
    module, config = build(True, torch.float32)
    fusion = fusion_pass(torch.float32, False, supported=False)
    run, cap = compile_with_passes(module, [fusion], decompose=False)
    got = run_batch(run, module, config, torch.float32, [4])
    assert fusion.matched_count == 0
    assert sum(cap.after[op] for op in QUANT_OPS) == 1
    assert_fp8_close(got, run_batch(module, module, config, torch.float32, [4]))


def test_attention_output_read_elsewhere_is_not_fused():
    class Both(AttnQuant):
        def forward(self, q, k, v):
            out = self.attn(q, k, v)
            return self.quant(out, self.scale)[0], out.sum()

    config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK))
    with set_current_vllm_config(config):
        module = Both(torch.float32)
    bind_kv_cache({ATTN: module.attn},
                  {ATTN: torch.zeros(module.attn.get_kv_cache_shape(8, BLOCK))})
    fusion = fusion_pass(torch.float32, False)
    run, _ = compile_with_passes(module, [fusion], decompose=False)
    run_batch(run, module, config, torch.float32, [2])
    assert fusion.matched_count == 0
