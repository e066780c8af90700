"""ActivationQuantFusionPass on small graphs: SiluAndMul (custom op on / off) followed by
QuantFP8 (static, per-token, per-group) -> one fused op; counts and numerics."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

from tests.compile.passes.fp8_fusion_utils import (
    FUSED_ACT,
    QUANT_OPS,
    assert_fp8_close,
    compile_with_passes,
)
from vllm.compilation.passes.fusion import matcher_utils as mu
from vllm.compilation.passes.fusion.act_quant_fusion import ActivationQuantFusionPass
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8

INTER = 256
SCHEMES = {"static": mu.STATIC, "per-token": mu.PER_TOKEN,
           "group128": mu.QuantScheme(False, 128)}


@functools.lru_cache(maxsize=None)
def fusion_pass(dtype: torch.dtype, decompose: bool) -> ActivationQuantFusionPass:
    return ActivationQuantFusionPass(None, dtypes=[dtype], decompose=[decompose])


class Mlp(nn.Module):
    """gate_up -> SiluAndMul -> quant -> down (an FP8 MLP's middle)."""

    def __init__(self, scheme: mu.QuantScheme, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.gate_up = nn.Parameter((torch.randn(2 * INTER, 64, generator=gen) * 0.2).to(dtype),
                                    requires_grad=False)
        self.act = SiluAndMul()
        self.quant = QuantFP8(scheme.static, scheme.group_shape)
        self.scheme = scheme
        self.scale = nn.Parameter(torch.tensor([0.01]), requires_grad=False)

    def forward(self, x: torch.Tensor):
        h = x @ self.gate_up.t()
        q, s = self.quant(self.act(h), self.scale if self.scheme.static else None)
        return q, s


def build(custom_ops: bool, scheme: mu.QuantScheme, dtype: torch.dtype) -> Mlp:
    config = VllmConfig(compilation_config=CompilationConfig(
        custom_ops=["all" if custom_ops else "none"]))
    with set_current_vllm_config(config):
        return Mlp(scheme, dtype)


@pytest.mark.parametrize("decompose", [False, True], ids=["aten", "inductor-ir"])
@pytest.mark.parametrize("custom_ops", [True, False], ids=["custom-ops", "torch-native"])
@pytest.mark.parametrize("scheme", list(SCHEMES), ids=list(SCHEMES))
def test_silu_mul_quant_fused(scheme, custom_ops, decompose):
    dtype = torch.bfloat16
    module = build(custom_ops, SCHEMES[scheme], dtype)
    fusion = fusion_pass(dtype, decompose)
    x = torch.randn(9, 64).to(dtype)
    want = module(x)
    run, cap = compile_with_passes(module, [fusion], decompose)
    got = run(x)
    assert fusion.matched_count == 1
    assert sum(cap.after[op] for op in FUSED_ACT) == 1
    assert sum(cap.after[op] for op in QUANT_OPS) == 0 and cap.fp8_converts_after == 0
    assert cap.after["aten.silu.default"] == 0 and cap.after["aten.sigmoid.default"] == 0
    # silu's exp is computed by another routine: allow rare one-step FP8 differences.
    assert_fp8_close(got[0], want[0], max_mismatch=0.01)
    if not SCHEMES[scheme].static:
        torch.testing.assert_close(got[1], want[1], rtol=1e-2, atol=1e-6)
    x = torch.randn(2, 64).to(dtype)
    assert_fp8_close(run(x)[0], module(x)[0], max_mismatch=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_silu_mul_quant_other_dtypes(dtype):
    module = build(False, mu.STATIC, dtype)
    fusion = fusion_pass(dtype, False)
    x = torch.randn(5, 64).to(dtype)
    run, cap = compile_with_passes(module, [fusion], decompose=False)
    got = run(x)
    assert fusion.matched_count == 1
    assert_fp8_close(got[0], module(x)[0], max_mismatch=0.01)


def test_no_fusion_across_a_dtype_change():
    class Cast(Mlp):
        def forward(self, x):
            h = x @ self.gate_up.t()
            return self.quant(self.act(h).to(torch.float16), self.scale)

    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=["none"]))
    with set_current_vllm_config(config):
        module = Cast(mu.STATIC, torch.float32)
    fusion = ActivationQuantFusionPass(None, dtypes=[torch.float32, torch.float16],
                                       decompose=[False], schemes=[mu.STATIC])
    run, cap = compile_with_passes(module, [fusion], decompose=False)
    x = torch.randn(4, 64)
    got = run(x)
    assert fusion.matched_count == 0 and cap.fp8_converts_after == 1
    assert_fp8_close(got[0], module(x)[0])
