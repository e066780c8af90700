"""The 2-D reshapes an FP8 linear layer inserts hide the RMSNorm -> quant pattern until
no-op elimination removes them (with the token dimension symbolic)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.compile.passes.fp8_fusion_utils import compile_with_passes
from vllm.compilation.passes.fusion.rms_quant_fusion import RMSNormQuantFusionPass
from vllm.compilation.passes.utility.noop_elimination import NoOpEliminationPass
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.quantization.fp8 import Fp8Config


class NormLinear(nn.Module):
    def __init__(self, activation_scheme: str) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.norm = RMSNorm(128, eps=1e-6)
        self.proj = ReplicatedLinear(128, 64, bias=False,
                                     quant_config=Fp8Config(activation_scheme),
                                     prefix="model.layers.0.mlp.down_proj")
        w = torch.randn(64, 128, generator=gen) * 0.1
        self.proj.weight_scale.data.fill_(float(w.abs().max() / 448))
        self.proj.weight.data = (w / self.proj.weight_scale).to(torch.float8_e4m3fn)
        if activation_scheme == "static":
            self.proj.input_scale.data.fill_(0.02)
        self.proj.quant_method.process_weights_after_loading(self.proj)

    def forward(self, x):
        return self.proj(self.norm(x))


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_noop_elimination_exposes_the_norm_quant_pattern(scheme):
    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(
            custom_ops=["none"]))):
        module = NormLinear(scheme)
    x = torch.randn(6, 128)
    want = module(x)

    fusion = RMSNormQuantFusionPass(None, dtypes=[torch.float32], decompose=[False])
    run, cap = compile_with_passes(module, [fusion], decompose=False)
    run(x)
    assert fusion.matched_count == 0  # x.reshape(-1, 128) sits between norm and quant
    assert cap.before["aten.view.default"] >= 1

    noop = NoOpEliminationPass()
    run, cap = compile_with_passes(module, [noop, fusion], decompose=False)
    got = run(x)
    assert noop.matched_count >= 1 and fusion.matched_count == 1
    assert cap.after["aten.view.default"] == 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    x = torch.randn(1, 128)  # symbolic token count: still correct for one token
    torch.testing.assert_close(run(x), module(x), rtol=1e-4, atol=1e-4)
