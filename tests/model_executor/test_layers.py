"""Layer-level checks: custom-op dispatch, MoE forms, packed weight loaders, RoPE dtype."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.fused_moe import (
    fused_experts_dense,
    fused_experts_grouped,
    select_experts,
)
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.platforms import current_platform

try:
    from tests.fresh_python import run_fresh
except ImportError:  # tests/ itself on sys.path
    from fresh_python import run_fresh


def test_custom_op_dispatch_follows_the_current_config():
    assert RMSNorm(8)._forward_method.__name__ == "forward_native"  # no current config
    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=["none", "+rms_norm"]),
                        optimization_level=0)
    with set_current_vllm_config(config):
        # The platform's kernel: forward_cpu here, forward_cuda on a GPU machine.
        assert RMSNorm(8)._forward_method.__name__ == f"forward_{current_platform.device_type}"
        assert SiluAndMul()._forward_method.__name__ == "forward_native"


def test_a_custom_op_the_model_lacks_is_warned_about(caplog):
    """As upstream: "+op"/"-op" naming no layer of the model is warned about (a misspelt name
    used to do nothing silently); ops the model has are not."""
    import logging

    from vllm.model_executor.custom_op import warn_unused_custom_ops

    model = torch.nn.Sequential(RMSNorm(8), SiluAndMul())
    with caplog.at_level(logging.WARNING, logger="vllm"):
        unused = warn_unused_custom_ops(
            model, ["none", "+rms_norm", "-silu_and_mul", "+bogus_op", "-quant_fp8"])
    assert unused == ["bogus_op", "quant_fp8"]
    text = caplog.text
    assert "'bogus_op' is not present in the model" in text and "'+bogus_op'" in text
    assert "rms_norm" in text.split("knows:")[1]  # the names that would work
    assert "'rms_norm' is not present" not in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_forms_agree(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(norm.forward_cpu(x), norm.forward_native(x), atol=tol, rtol=tol)
    for got, want in zip(norm.forward_cpu(x, residual), norm.forward_native(x, residual)):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    out, new_residual = norm.forward_native(x, residual)
    torch.testing.assert_close(new_residual, (x.float() + residual.float()).to(dtype))


def test_moe_forms_match_a_per_token_reference():
    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k = 9, 16, 12, 4, 2
    x = torch.randn(tokens, hidden)
    w13 = torch.randn(experts, 2 * inter, hidden) * 0.3
    w2 = torch.randn(experts, hidden, inter) * 0.3
    weights, ids = select_experts(torch.randn(tokens, experts), top_k)
    torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))
    expected = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(top_k):
            e = ids[t, j]
            gate, up = (w13[e] @ x[t]).chunk(2)
            expected[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    grouped = fused_experts_grouped(x, w13, w2, weights, ids)
    torch.testing.assert_close(grouped, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_experts_dense(x, w13, w2, weights, ids), expected,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.ops.vllm.fused_moe_experts(x, w13, w2, weights, ids),
                               expected, atol=1e-5, rtol=1e-5)


def test_moe_op_call_does_not_import_dynamo(tmp_path):
    """The MoE op runs eagerly at -O0 and inside compiled pieces loaded without Inductor: a
    `torch.library.custom_op` imported Dynamo (~0.8 s) at its first call."""
    code = ("import sys, torch\n"
            "from vllm.model_executor.layers.fused_moe import select_experts\n"
            "x, w13, w2 = torch.randn(3, 8), torch.randn(4, 12, 8), torch.randn(4, 8, 6)\n"
            "weights, ids = select_experts(torch.randn(3, 4), 2)\n"
            "out = torch.ops.vllm.fused_moe_experts(x, w13, w2, weights, ids)\n"
            "assert out.shape == (3, 8)\n"
            "assert 'torch._dynamo' not in sys.modules\n")
    run_fresh(code, tmp_path)


def test_packed_loaders_accept_split_and_fused_tensors():
    torch.manual_seed(0)
    qkv = QKVParallelLinear(16, head_size=4, total_num_heads=4, total_num_kv_heads=2, bias=True)
    q, k, v = torch.randn(16, 16), torch.randn(8, 16), torch.randn(8, 16)
    for shard, tensor in zip("qkv", (q, k, v)):
        qkv.weight.weight_loader(qkv.weight, tensor, shard)
    torch.testing.assert_close(qkv.weight.data, torch.cat([q, k, v]))
    fused = QKVParallelLinear(16, head_size=4, total_num_heads=4, total_num_kv_heads=2)
    fused.weight.weight_loader(fused.weight, torch.cat([q, k, v]))
    torch.testing.assert_close(fused.weight.data, qkv.weight.data)
    assert qkv.weight.shard_ids == ["q", "k", "v"]
    merged = MergedColumnParallelLinear(16, [6, 6], bias=False)
    gate, up = torch.randn(6, 16), torch.randn(6, 16)
    merged.weight.weight_loader(merged.weight, up, 1)
    merged.weight.weight_loader(merged.weight, gate, 0)
    torch.testing.assert_close(merged.weight.data, torch.cat([gate, up]))
    with pytest.raises(ValueError, match="does not fit"):
        merged.weight.weight_loader(merged.weight, torch.randn(5, 16), 0)


def test_rope_cache_stays_float32_and_rotation_is_norm_preserving():
    rope = get_rope(16, 16, 64, 10000.0, None)
    rope.to(torch.bfloat16)
    assert rope.cos_sin_cache.dtype == torch.float32
    rope.to(torch.float32)
    q, k = torch.randn(5, 3 * 16), torch.randn(5, 16)
    positions = torch.tensor([0, 1, 7, 30, 63])
    q_rot, k_rot = rope(positions, q, k)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape
    torch.testing.assert_close(q_rot[0], q[0])  # position 0: no rotation
    torch.testing.assert_close(q_rot.view(5, 3, 16).norm(dim=-1), q.view(5, 3, 16).norm(dim=-1))
    with pytest.raises(ValueError, match="not supported"):
        get_rope(16, 16, 64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu",
                                  "silu"])
def test_plain_activations_match_transformers(name):
    from transformers.activations import ACT2FN

    from vllm.model_executor.layers.activation import get_act_fn

    x = torch.randn(8, 32) * 3
    torch.testing.assert_close(get_act_fn(name)(x), ACT2FN[name](x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_pytorch_tanh"])
def test_gated_activations_match_transformers(name):
    from transformers.activations import ACT2FN

    from vllm.model_executor.layers.activation import get_act_and_mul_fn

    x = torch.randn(8, 64) * 3
    expected = ACT2FN[name](x[:, :32]) * x[:, 32:]
    op = get_act_and_mul_fn(name)
    torch.testing.assert_close(op.forward_native(x), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(op.forward_cpu(x), expected, atol=1e-6, rtol=1e-6)


def test_unknown_activation_names_the_allowed_ones():
    from vllm.model_executor.layers.activation import get_act_and_mul_fn, get_act_fn

    with pytest.raises(ValueError, match="'softplus'.*supported: relu"):
        get_act_fn("softplus")
    with pytest.raises(ValueError, match="'relu'.*supported: silu"):
        get_act_and_mul_fn("relu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_linears_stay_opaque_in_float32_and_bfloat16(dtype):
    """Compiled levels hand float32 and bfloat16 CPU products to the C++ dispatcher op, never
    to Inductor's own GEMM lowering (in bfloat16 that was oneDNN's bf16 GEMM: ~half the
    bandwidth at one row, no fast kernel on AVX2; the 0.5B shape decoded 1.5x slower at -O2
    than at -O0)."""
    from vllm.model_executor.layers.cpu_linear import small_m_linear_available
    from vllm.model_executor.layers.linear import ReplicatedLinear

    if not small_m_linear_available():
        pytest.skip("the C++ linear dispatcher could not be built")
    config = VllmConfig(optimization_level=1)
    with set_current_vllm_config(config):
        layer = ReplicatedLinear(64, 32, bias=False, params_dtype=dtype)
    layer.weight.data.normal_()
    layer.quant_method.process_weights_after_loading(layer)
    targets: list[str] = []

    def record(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    x = torch.randn(3, 64, dtype=dtype)
    out = torch.compile(layer, backend=record, fullgraph=True)(x)
    out = out[0] if isinstance(out, tuple) else out
    assert any("vllm_cpu_linear.linear" in t for t in targets), targets
    assert not any("aten.linear" in t or t.endswith("linear>") for t in targets
                   if "vllm_cpu_linear" not in t), targets
    want = F.linear(x.float(), layer.weight.float()).to(dtype).float()
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_o2_prepacks_the_weights_the_build_can_pack(dtype):
    """At -O2 a linear layer's weight gets a packed copy after loading: float32 always, bfloat16
    where the build packs bfloat16 panels (AVX2) or oneDNN has bfloat16 kernels (its reorder);
    the product then takes the copy for the rows the policy gives it, with F.linear's
    result."""
    from vllm.model_executor.layers import cpu_linear
    from vllm.model_executor.layers.cpu_prepacked_linear import wait_for_prepacking
    from vllm.model_executor.layers.linear import ReplicatedLinear

    if not cpu_linear.small_m_linear_available():
        pytest.skip("the C++ linear dispatcher could not be built")
    with set_current_vllm_config(VllmConfig(optimization_level=2)):
        layer = ReplicatedLinear(64, 48, bias=False, params_dtype=dtype)
    layer.weight.data.normal_()
    layer.quant_method.process_weights_after_loading(layer)
    wait_for_prepacking()
    lo, hi = (cpu_linear.panel_rows() if dtype == torch.float32
              else cpu_linear.bf16_packed_rows())
    packs = dtype == torch.float32 or cpu_linear.bf16_packed_rows() != (0, 0)
    assert (lo > 0) == packs
    rows = lo if packs else 16
    x = torch.randn(rows, 64, dtype=dtype)
    assert (cpu_linear.linear_route(x, layer.weight) == "packed") == packs
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    want = F.linear(x.float(), layer.weight.float()).to(dtype).float()
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
