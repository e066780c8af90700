"""The FP8 quant ops: C++ CPU kernels bit-exact against the plain-torch reference, fake
(meta) shapes, QuantFP8's two forms, Triton kernels on CUDA."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.kernels import fp8_ops as F8
from vllm.model_executor.kernels.cpu_loader import load_cpu_fp8_kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
ops = torch.ops.vllm


@pytest.fixture(scope="module")
def cpu_kernels():
    if not load_cpu_fp8_kernels():
        pytest.skip("the CPU FP8 kernels could not be built here")


def bits_equal(got: torch.Tensor, want: torch.Tensor, max_mismatch: float = 0.0) -> None:
    assert got.dtype == want.dtype == F8.FP8_DTYPE and got.shape == want.shape
    diff = (got.view(torch.uint8) != want.view(torch.uint8)).float().mean().item()
    assert diff <= max_mismatch, f"{diff:.4%} of the FP8 values differ"


def inputs(dtype, rows=33, hidden=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    return x, residual, weight


def test_cpu_kernels_are_registered_for_the_cpu_key(cpu_kernels):
    for name in ("static_scaled_fp8_quant", "fused_add_rms_norm_dynamic_fp8_quant",
                 "silu_and_mul_static_fp8_quant"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm::{name}", "CPU")


def test_float_to_e4m3_conversion_matches_torch(cpu_kernels):
    values = torch.cat([torch.linspace(-448, 448, 100_001), torch.linspace(-0.03, 0.03, 50_001),
                        torch.randn(50_000) * 20, torch.tensor([0.0, -0.0, 448.0, -448.0,
                                                                2.0 ** -9, 2.0 ** -10])])
    got = ops.static_scaled_fp8_quant(values.view(1, -1), torch.tensor([1.0]))
    bits_equal(got.view(-1), values.clamp(-448, 448).to(F8.FP8_DTYPE))
    # Saturation: values beyond the range clamp to +-448.
    big = ops.static_scaled_fp8_quant(torch.tensor([[1e6, -1e6]]), torch.tensor([1.0]))
    assert big.float().tolist() == [[448.0, -448.0]]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("group", [-1, 64, 128], ids=["per-token", "g64", "g128"])
def test_quant_kernels_are_bit_exact(cpu_kernels, dtype, group):
    x, residual, weight = inputs(dtype)
    scale = torch.tensor([0.02])
    bits_equal(ops.static_scaled_fp8_quant(x, scale), F8.ref_static_quant(x, scale))
    q, s = ops.dynamic_scaled_fp8_quant(x, group)
    rq, rs = F8.ref_dynamic_quant(x, group)
    bits_equal(q, rq)
    torch.testing.assert_close(s, rs, rtol=0, atol=0)

    q, s = ops.rms_norm_dynamic_fp8_quant(x, weight, 1e-6, group)
    rq, rs = F8.ref_dynamic_quant(F8.ref_rms_norm(x, weight, 1e-6), group)
    bits_equal(q, rq, max_mismatch=0.002)  # the sum of squares is added in another order
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=0)

    q, s, res = ops.fused_add_rms_norm_dynamic_fp8_quant(x, residual, weight, 1e-5, group)
    y, rres = F8.ref_rms_norm(x, weight, 1e-5, residual)
    rq, rs = F8.ref_dynamic_quant(y, group)
    bits_equal(q, rq, max_mismatch=0.002)
    torch.testing.assert_close(res, rres, rtol=0, atol=0)

    silu_group = group if group == -1 else group // 2
    q, s = ops.silu_and_mul_dynamic_fp8_quant(x, silu_group)
    rq, rs = F8.ref_dynamic_quant(F8.ref_silu_and_mul(x), silu_group)
    bits_equal(q, rq, max_mismatch=0.002)  # exp: a few ulp from libm


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_static_fused_kernels_are_bit_exact(cpu_kernels, dtype):
    x, residual, weight = inputs(dtype, rows=17, hidden=200)  # a tail that is not 16-aligned
    scale = torch.tensor([0.03])
    bits_equal(ops.rms_norm_static_fp8_quant(x, weight, scale, 1e-6),
               F8.ref_static_quant(F8.ref_rms_norm(x, weight, 1e-6), scale), 0.002)
    q, res = ops.fused_add_rms_norm_static_fp8_quant(x, residual, weight, scale, 1e-6)
    y, rres = F8.ref_rms_norm(x, weight, 1e-6, residual)
    bits_equal(q, F8.ref_static_quant(y, scale), 0.002)
    torch.testing.assert_close(res, rres, rtol=0, atol=0)
    bits_equal(ops.silu_and_mul_static_fp8_quant(x, scale),
               F8.ref_static_quant(F8.ref_silu_and_mul(x), scale), 0.002)


def test_leading_dims_and_empty_batches(cpu_kernels):
    x = torch.randn(2, 3, 128)
    q, s = ops.dynamic_scaled_fp8_quant(x, 64)
    assert q.shape == (2, 3, 128) and s.shape == (2, 3, 2)
    rq, rs = F8.ref_dynamic_quant(x, 64)
    bits_equal(q, rq)
    empty = torch.randn(0, 128)
    q, s, res = ops.fused_add_rms_norm_dynamic_fp8_quant(empty, empty, torch.ones(128), 1e-6,
                                                         -1)
    assert q.shape == (0, 128) and s.shape == (0, 1) and res.shape == (0, 128)


def test_fake_shapes_match_real_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, residual, weight = inputs(torch.bfloat16, rows=5, hidden=256)
    scale = torch.tensor([0.1])
    calls = [(ops.dynamic_scaled_fp8_quant, (x, 128)),
             (ops.fused_add_rms_norm_dynamic_fp8_quant, (x, residual, weight, 1e-6, -1)),
             (ops.fused_add_rms_norm_static_fp8_quant, (x, residual, weight, scale, 1e-6)),
             (ops.silu_and_mul_dynamic_fp8_quant, (x, 64)),
             (ops.silu_and_mul_static_fp8_quant, (x, scale))]
    real = [op(*args) for op, args in calls]
    with FakeTensorMode() as mode:
        fake_args = [tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                           for a in args) for _, args in calls]
        fake = [op(*args) for (op, _), args in zip(calls, fake_args)]
    for r, f in zip(real, fake):
        r, f = (r, f) if isinstance(r, tuple) else ((r,), (f,))
        assert [(t.shape, t.dtype) for t in r] == [(t.shape, t.dtype) for t in f]


def test_quant_fp8_forms_agree():
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import GroupShape, QuantFP8

    x = torch.randn(6, 256).to(torch.bfloat16)
    for static, shape in [(True, GroupShape.PER_TENSOR), (False, GroupShape.PER_TOKEN),
                          (False, GroupShape(1, 128))]:
        results = []
        for custom in ("all", "none"):
            with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(
                    custom_ops=[custom]))):
                quant = QuantFP8(static, shape)
            assert (quant._forward_method == quant.forward_native) == (custom == "none")
            results.append(quant(x, torch.tensor([0.01]) if static else None))
        bits_equal(results[0][0], results[1][0])
        torch.testing.assert_close(results[0][1], results[1][1])
    with pytest.raises(ValueError, match="per-tensor only"):
        QuantFP8(True, GroupShape.PER_TOKEN)
    with pytest.raises(ValueError, match="per-token or per-group"):
        QuantFP8(False, GroupShape.PER_TENSOR)


def test_scaled_mm_on_cpu_agrees_with_the_dequantized_gemm():
    """The CPU path dequantizes; torch._scaled_mm (which runs on this CPU torch, slowly) is an
    independent reference for the same W8A8 product."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 128, generator=gen)
    w = torch.randn(64, 128, generator=gen) * 0.1
    w_scale = w.abs().amax() / 448
    w_q = (w / w_scale).to(F8.FP8_DTYPE)
    q, s = F8.ref_dynamic_quant(x)
    try:
        ref = torch._scaled_mm(q, w_q.t(), scale_a=s, scale_b=w_scale.reshape(1, 1).expand(1, 64)
                               .contiguous(), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run here: {e}")
    ours = (q.float() @ (w_q.float() * w_scale).t()) * s
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hidden", [256, 896])
def test_triton_kernels_match_reference(dtype, hidden):
    """896: a row that is no power of two (the kernels pad it to 1024); per-token scales of
    such rows were left unwritten once."""
    from vllm.model_executor.kernels import triton_fp8

    if not triton_fp8.available():
        pytest.skip("Triton is not installed")
    x, residual, weight = (t.cuda() for t in inputs(dtype, hidden=hidden))
    scale = torch.tensor([0.02], device="cuda")
    bits_equal(ops.static_scaled_fp8_quant(x, scale), F8.ref_static_quant(x, scale), 0.002)
    for group in (-1, 128):
        q, s = ops.dynamic_scaled_fp8_quant(x, group)
        ref_q, ref_s = F8.ref_dynamic_quant(x, group)
        bits_equal(q, ref_q, 0.002)
        torch.testing.assert_close(s, ref_s, rtol=1e-5, atol=0)
        q, s, res = ops.fused_add_rms_norm_dynamic_fp8_quant(x, residual, weight, 1e-6, group)
        y, rres = F8.ref_rms_norm(x, weight, 1e-6, residual)
        ref_q, ref_s = F8.ref_dynamic_quant(y, group)
        bits_equal(q, ref_q, 0.01)
        torch.testing.assert_close(s, ref_s, rtol=2e-2, atol=0)  # one rounding of the amax
        torch.testing.assert_close(res, rres)
    bits_equal(ops.silu_and_mul_static_fp8_quant(x, scale),
               F8.ref_static_quant(F8.ref_silu_and_mul(x), scale), 0.01)
    q, s = ops.silu_and_mul_dynamic_fp8_quant(x, -1)  # rows of hidden / 2 (448: no power of 2)
    ref_q, ref_s = F8.ref_dynamic_quant(F8.ref_silu_and_mul(x), -1)
    bits_equal(q, ref_q, 0.01)
    torch.testing.assert_close(s, ref_s, rtol=2e-2, atol=0)
