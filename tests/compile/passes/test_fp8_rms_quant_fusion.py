"""RMSNormQuantFusionPass on small graphs: both forms of RMSNorm and QuantFP8 (custom ops on
and off), static / per-token / per-group scales, the eager (ATen) and Inductor
(decomposed) IR; op counts before and after, numerics against the unfused module."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

from tests.compile.passes.fp8_fusion_utils import (
    FUSED_RMS,
    QUANT_OPS,
    assert_fp8_close,
    compile_with_passes,
)
from vllm.compilation.passes.fusion import matcher_utils as mu
from vllm.compilation.passes.fusion.rms_quant_fusion import RMSNormQuantFusionPass
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8

HIDDEN = 256
SCHEMES = {"static": mu.STATIC, "per-token": mu.PER_TOKEN,
           "group128": mu.QuantScheme(False, 128)}


@functools.lru_cache(maxsize=None)
def fusion_pass(dtype: torch.dtype, decompose: bool) -> RMSNormQuantFusionPass:
    return RMSNormQuantFusionPass(None, dtypes=[dtype], decompose=[decompose])


def build(custom_ops: bool, **kwargs) -> nn.Module:
    config = VllmConfig(compilation_config=CompilationConfig(
        custom_ops=["all" if custom_ops else "none"]))
    with set_current_vllm_config(config):
        return NormQuant(**kwargs)


class NormQuant(nn.Module):
    """x -> RMSNorm -> quant -> matmul -> (+ residual) RMSNorm -> quant -> matmul, as in a
    decoder layer with FP8 linears (the plain norm of layer 0, the fused-add of the others).
    `cast_to`: convert the norm output to another dtype before quantizing (must not fuse)."""

    def __init__(self, scheme: mu.QuantScheme, dtype: torch.dtype, eps: float = 1e-6,
                 cast_to: torch.dtype | None = None) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.norm1 = RMSNorm(HIDDEN, eps=eps, dtype=dtype)
        self.norm2 = RMSNorm(HIDDEN, eps=eps, dtype=dtype)
        for norm in (self.norm1, self.norm2):
            norm.weight.data = (torch.rand(HIDDEN, generator=gen) + 0.5).to(dtype)
        self.quant = QuantFP8(scheme.static, scheme.group_shape)
        self.scheme = scheme
        self.scale = nn.Parameter(torch.tensor([0.02]), requires_grad=False)
        self.w = nn.Parameter((torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.05).to(dtype),
                              requires_grad=False)
        self.cast_to = cast_to

    def _quant_mm(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cast_to is not None:
            y = y.to(self.cast_to)
        q, s = self.quant(y, self.scale if self.scheme.static else None)
        x = q.to(torch.float32)
        if self.scheme.group_size:
            x = (x.unflatten(-1, (-1, self.scheme.group_size)) * s.unsqueeze(-1)).flatten(-2)
        else:
            x = x * s
        return q, x.to(self.w.dtype) @ self.w

    def forward(self, x: torch.Tensor, residual: torch.Tensor):
        q1, h = self._quant_mm(self.norm1(x))
        y2, res = self.norm2(h, residual)
        q2, out = self._quant_mm(y2)
        return q1, q2, out, res


def _inputs(dtype: torch.dtype, tokens: int = 7):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(tokens, HIDDEN, generator=gen).to(dtype) * 2,
            torch.randn(tokens, HIDDEN, generator=gen).to(dtype))


def _check_outputs(got, want) -> None:
    q1, q2, out, res = got
    assert_fp8_close(q1, want[0], max_mismatch=0.01)
    assert_fp8_close(q2, want[1], max_mismatch=0.01)
    torch.testing.assert_close(res, want[3])
    torch.testing.assert_close(out.float(), want[2].float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("decompose", [False, True], ids=["aten", "inductor-ir"])
@pytest.mark.parametrize("custom_ops", [True, False], ids=["custom-ops", "torch-native"])
@pytest.mark.parametrize("scheme", list(SCHEMES), ids=list(SCHEMES))
def test_rms_quant_fused(scheme, custom_ops, decompose):
    dtype = torch.bfloat16
    module = build(custom_ops, scheme=SCHEMES[scheme], dtype=dtype)
    fusion = fusion_pass(dtype, decompose)
    x, residual = _inputs(dtype)
    want = module(x, residual)
    run, cap = compile_with_passes(module, [fusion], decompose)
    got = run(x, residual)

    assert fusion.matched_count == 2  # the plain norm and the fused-add one
    static = SCHEMES[scheme].static
    plain = "vllm.rms_norm_static_fp8_quant.default" if static else \
        "vllm.rms_norm_dynamic_fp8_quant.default"
    added = "vllm.fused_add_rms_norm_static_fp8_quant.default" if static else \
        "vllm.fused_add_rms_norm_dynamic_fp8_quant.default"
    assert cap.after[plain] == 1 and cap.after[added] == 1
    # The quantization is gone in whichever form it had; so is the norm.
    if custom_ops:
        assert sum(cap.before[op] for op in QUANT_OPS) == 2
    else:
        assert cap.fp8_converts_before == 2
    assert sum(cap.after[op] for op in QUANT_OPS) == 0 and cap.fp8_converts_after == 0
    assert cap.after["aten.rsqrt.default"] == 0 and cap.after["aten.pow.Tensor_Scalar"] == 0
    _check_outputs(got, want)
    # Another token count runs the same graph (symbolic shapes).
    x, residual = _inputs(dtype, tokens=3)
    _check_outputs(run(x, residual), module(x, residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_quant_dtypes_and_epsilons(dtype, eps):
    module = build(False, scheme=mu.PER_TOKEN, dtype=dtype, eps=eps)
    fusion = fusion_pass(dtype, False)
    x, residual = _inputs(dtype)
    run, cap = compile_with_passes(module, [fusion], decompose=False)
    got = run(x, residual)
    assert fusion.matched_count == 2
    assert sum(cap.after[op] for op in FUSED_RMS) == 2
    _check_outputs(got, module(x, residual))


def test_unregistered_epsilon_is_not_fused():
    module = build(False, scheme=mu.STATIC, dtype=torch.float32, eps=1e-4)
    fusion = fusion_pass(torch.float32, False)
    run, cap = compile_with_passes(module, [fusion], decompose=False)
    run(*_inputs(torch.float32))
    assert fusion.matched_count == 0
    assert cap.fp8_converts_after == 2


def test_model_epsilon_is_registered():
    from tests.config.model_configs import fp8

    model_config = fp8("static")
    model_config.hf_config.rms_norm_eps = 1e-4
    config = VllmConfig(model_config=model_config, compilation_config=CompilationConfig(
        backend="eager"))
    assert 1e-4 in mu.epsilons_for(config)
    fusion = RMSNormQuantFusionPass(config, dtypes=[torch.float32])
    assert fusion.schemes == [mu.STATIC]  # the model's scheme only
    module = build(False, scheme=mu.STATIC, dtype=torch.float32, eps=1e-4)
    run, _ = compile_with_passes(module, [fusion], decompose=False)
    run(*_inputs(torch.float32))
    assert fusion.matched_count == 2


def test_never_fuses_across_a_dtype_change():
    # The norm runs in float32 and its output is cast to bfloat16 before quantization:
    # fusing would quantize the float32 value (different bits), so nothing may match.
    module = build(False, scheme=mu.STATIC, dtype=torch.float32, cast_to=torch.bfloat16)
    fusion = RMSNormQuantFusionPass(None, dtypes=[torch.float32, torch.bfloat16],
                                    decompose=[False], schemes=[mu.STATIC])
    x, residual = _inputs(torch.float32)
    run, cap = compile_with_passes(module, [fusion], decompose=False)
    got = run(x, residual)
    assert fusion.matched_count == 0
    assert cap.fp8_converts_after == 2
    _check_outputs(got, module(x, residual))


def test_norm_output_read_elsewhere_is_not_fused():
    class Escapes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = RMSNorm(HIDDEN, eps=1e-6, dtype=torch.float32)
            self.quant = QuantFP8(True, mu.STATIC.group_shape)
            self.scale = nn.Parameter(torch.tensor([0.02]), requires_grad=False)

        def forward(self, x):
            y = self.norm(x)
            return self.quant(y, self.scale)[0], y * 2  # y is needed unquantized too

    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(
            custom_ops=["none"]))):
        module = Escapes()
    fusion = fusion_pass(torch.float32, False)
    run, _ = compile_with_passes(module, [fusion], decompose=False)
    run(torch.randn(4, HIDDEN))
    assert fusion.matched_count == 0


def test_registration_is_recorded_in_uuid():
    a = RMSNormQuantFusionPass(None, dtypes=[torch.float32], decompose=[False],
                               schemes=[mu.STATIC])
    b = RMSNormQuantFusionPass(None, dtypes=[torch.float32], decompose=[False],
                               schemes=[mu.PER_TOKEN])
    assert a.uuid() != b.uuid()
    assert a.uuid() == RMSNormQuantFusionPass(None, dtypes=[torch.float32], decompose=[False],
                                              schemes=[mu.STATIC]).uuid()
    # fused-add first (the plain pattern is its sub-pattern), both forms of each op.
    names = a.patterns.registered
    assert names[0].startswith("fused_add_rms")
    assert any("rms[native]+quant[native]" in n for n in names)
    assert any("rms[cpu]+quant[custom]" in n for n in names)


@pytest.mark.parametrize("decompose", [False, True], ids=["aten", "inductor-ir"])
def test_fuses_with_a_torch_whose_register_replacement_has_no_get_decomp_fn(
        monkeypatch, decompose):
    """torch 2.11's register_replacement takes no get_decomp_fn (seen on a CUDA machine's
    torch): registration must not pass it, and the patterns (traced by our trace_fn with its
    own table) still fuse."""
    import torch._inductor.pattern_matcher as pattern_matcher

    real = pattern_matcher.register_replacement

    def without_get_decomp_fn(search_fn, replace_fn, example_inputs, trace_fn, pass_dicts,
                              extra_check=None, scalar_workaround=None,
                              exclusive_arg_names=(), search_fn_pattern=None,
                              skip_duplicates=False):
        return real(search_fn, replace_fn, example_inputs, trace_fn, pass_dicts,
                    extra_check=extra_check, scalar_workaround=scalar_workaround,
                    exclusive_arg_names=exclusive_arg_names,
                    search_fn_pattern=search_fn_pattern, skip_duplicates=skip_duplicates)

    monkeypatch.setattr(pattern_matcher, "register_replacement", without_get_decomp_fn)
    dtype = torch.float16  # a dtype no other test's cached pass was built for
    fusion = RMSNormQuantFusionPass(None, dtypes=[dtype], decompose=[decompose])
    module = build(False, scheme=mu.STATIC, dtype=dtype)
    x, residual = _inputs(dtype)
    run, cap = compile_with_passes(module, [fusion], decompose)
    got = run(x, residual)  # compiles: the pass runs
    assert fusion.matched_count == 2
    assert sum(cap.after[op] for op in FUSED_RMS) == 2
    _check_outputs(got, module(x, residual))
