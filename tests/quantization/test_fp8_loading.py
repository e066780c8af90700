"""FP8 checkpoints load and compute what a dequantized reference computes.

Two references, both transformers' Llama on the dequantized twin of the checkpoint
(`fp8_checkpoints.make_fp8_llama`, float32):
  - with the same FP8 quantization of every linear layer's input (hooks): our model must match
    it closely (the weights and the activation quantization are the same; only the summation
    order of the GEMMs and the attention differs). Not exactly: a float32 difference of an
    ulp or two moves an activation across an FP8 rounding boundary about once in 30,000
    elements (boundaries 1/16 apart relative, inputs 1e-6 apart), and such a flip changes
    that element by up to 1/8 and every later position's logits a little (one at position 9
    of the block-scaled model: 0.14 at most, 0.015 on average, logits up to 5);
  - without it: within FP8 tolerance (activations rounded to 3 mantissa bits).
"""
from __future__ import annotations

import pytest
import torch

from tests.model_executor.paged_runner import PagedRunner
from tests.quantization.fp8_checkpoints import LINEARS, make_fp8_llama
from vllm.config import ModelConfig, VllmConfig
from vllm.model_executor.kernels import fp8_ops as F8
from vllm.model_executor.model_loader import get_model

PROMPT = list(range(3, 40))
CASES = [("fp8", "tensor", "static"), ("fp8", "tensor", "dynamic"), ("fp8", "block", "dynamic"),
         ("compressed-tensors", "tensor", "static"), ("compressed-tensors", "channel", "dynamic"),
         ("compressed-tensors", "block", "group")]


def our_logits(path: str) -> tuple[torch.Tensor, torch.nn.Module]:
    config = VllmConfig(model_config=ModelConfig(model=path, dtype="float32"),
                        optimization_level=0)
    model = get_model(config)
    return PagedRunner(model, config).step([("a", PROMPT)])["a"], model


def reference_logits(ckpt, fake_quant: bool) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt.dequant_path, dtype=torch.float32).eval()
    group = 128 if ckpt.weights == "block" else -1  # block weights: per-group activations
    if fake_quant:
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] not in LINEARS:
                continue
            scale = ckpt.scales[name].get("input_scale")

            def hook(_module, args, scale=scale):
                x = args[0]
                if scale is not None:
                    scale = scale.reshape(1)
                    return (F8.ref_static_quant(x, scale).float() * scale,)
                q, s = F8.ref_dynamic_quant(x, group)
                if group == -1:
                    return (q.float() * s,)
                return ((q.float().unflatten(-1, (-1, group)) * s.unsqueeze(-1)).flatten(-2),)

            module.register_forward_pre_hook(hook)
    with torch.no_grad():
        return model(input_ids=torch.tensor([PROMPT])).logits[0]


@pytest.mark.parametrize("layout,weights,activations", CASES,
                         ids=["-".join(c) for c in CASES])
def test_fp8_checkpoint_matches_dequantized_reference(tmp_path, layout, weights, activations):
    ckpt = make_fp8_llama(tmp_path / "m", layout=layout, weights=weights,
                          activations=activations, dtype="float32")
    ours, model = our_logits(ckpt.path)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant_method.gemm == "dequant"  # the CPU path
    assert model.lm_head.weight.dtype == torch.float32  # lm_head stays unquantized

    same_quant = reference_logits(ckpt, fake_quant=True)
    diff, size = (ours - same_quant).abs(), same_quant.abs().max()
    # a rounding flip or two (module docstring); a wrong scale or layout moves every logit
    assert diff.mean() <= 0.01 * size and diff.max() <= 0.06 * size, (diff.mean(), diff.max())
    assert (ours.argmax(-1) == same_quant.argmax(-1)).float().mean() >= 0.95

    plain = reference_logits(ckpt, fake_quant=False)
    scale = plain.abs().max()
    assert (ours - plain).abs().max() <= 0.35 * scale  # FP8 activations
    assert (ours.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.75


def test_static_scales_per_shard_use_their_max(tmp_path):
    ckpt = make_fp8_llama(tmp_path / "s", layout="fp8", weights="tensor", activations="static",
                          dtype="float32")
    _, model = our_logits(ckpt.path)
    qkv = model.model.layers[1].self_attn.qkv_proj
    prefix = "model.layers.1.self_attn"
    expected = max(float(ckpt.scales[f"{prefix}.{p}"]["input_scale"]) for p in
                   ("q_proj", "k_proj", "v_proj"))
    assert qkv.input_scale.shape == (1,)
    assert qkv.input_scale.item() == pytest.approx(expected)


def test_missing_scale_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = make_fp8_llama(tmp_path / "x", layout="fp8", weights="tensor", activations="static",
                          dtype="float32")
    path = f"{ckpt.path}/model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.self_attn.k_proj.input_scale"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match="missing tensors.*input_scale"):
        our_logits(ckpt.path)


def test_block_scales_need_block_aligned_shards():
    from vllm.model_executor.layers.linear import QKVParallelLinear
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    # One KV head of 32: the k shard (32 rows) does not end on a 128-row block boundary.
    with pytest.raises(ValueError, match="not a multiple of the FP8 weight block size"):
        QKVParallelLinear(128, 32, 4, 1, bias=False,
                          quant_config=Fp8Config("dynamic", weight_block_size=[128, 128]),
                          prefix="model.layers.0.self_attn.qkv_proj")


def test_bfloat16_model_runs(tmp_path):
    ckpt = make_fp8_llama(tmp_path / "bf", layout="compressed-tensors", weights="channel",
                          activations="static", dtype="bfloat16")
    config = VllmConfig(model_config=ModelConfig(model=ckpt.path, dtype="bfloat16"),
                        optimization_level=0)
    model = get_model(config)
    logits = PagedRunner(model, config).step([("a", PROMPT)])["a"]
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    fp32, _ = our_logits(ckpt.path)
    assert torch.isfinite(logits).all()
    assert (logits.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.7


def test_scaled_mm_only_for_the_layouts_it_takes():
    """torch._scaled_mm (CUDA, FP8 tensor cores) takes per-tensor or per-row scales, K and N
    multiples of 16 and (with a bias or row-wise scales) a bfloat16 output; the rest
    dequantizes. Per-group activation scales ([M, K / g]) once reached it and failed to
    broadcast; float32 models with a bias failed in cuBLAS."""
    from vllm.model_executor.layers.quantization.fp8_linear import Fp8LinearMethod
    from vllm.model_executor.layers.quantization.input_quant_fp8 import GroupShape

    per_token = Fp8LinearMethod("channel", act_static=False)
    assert per_token.scaled_mm_fits(256, 512, torch.bfloat16)
    assert not per_token.scaled_mm_fits(256, 512, torch.float32)
    assert not per_token.scaled_mm_fits(256, 512, torch.float16)
    assert not per_token.scaled_mm_fits(250, 512, torch.bfloat16)
    assert not per_token.scaled_mm_fits(256, 500, torch.bfloat16)
    assert Fp8LinearMethod("tensor", act_static=True).scaled_mm_fits(256, 512, torch.bfloat16)
    grouped = Fp8LinearMethod("channel", act_static=False, act_group_shape=GroupShape(1, 128))
    assert not grouped.scaled_mm_fits(256, 512, torch.bfloat16)
    assert not Fp8LinearMethod("block", act_static=False, block_size=(128, 128)).scaled_mm_fits(
        256, 512, torch.bfloat16)


def test_dequantized_cpu_weights_are_carved_from_a_huge_page_arena(tmp_path, monkeypatch):
    """The CPU path's dequantized linear weights are made after loading: they go to the
    loader's huge-page arena as the loaded weights do (vllm/utils/hugepages.py), one after
    another, instead of torch's allocator (4 KiB pages)."""
    from vllm.utils import hugepages

    monkeypatch.setattr(hugepages, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.delenv("VLLM_CPU_HUGE_PAGES", raising=False)
    ckpt = make_fp8_llama(tmp_path / "h", layout="fp8", weights="tensor", activations="dynamic",
                          dtype="float32")
    _, model = our_logits(ckpt.path)
    attn = model.model.layers[0].self_attn
    qkv, o = attn.qkv_proj.weight, attn.o_proj.weight
    assert qkv.dtype == torch.float32 and attn.qkv_proj.quant_method.gemm == "dequant"
    assert not qkv.untyped_storage().resizable() and not o.untyped_storage().resizable()
    room = hugepages.HugePageArena.room(qkv.shape, qkv.dtype)
    assert o.data_ptr() == qkv.data_ptr() + room


def test_dequantized_cpu_products_take_the_cpu_linear_kernels(tmp_path, monkeypatch):
    """On the CPU the dequantized GEMM is the plain weights' path (not F.linear, which in
    bfloat16 is oneDNN's slow one-row GEMM): eager through `dispatch_linear`; compiled through
    the opaque CPU linear op, with the weight prepacked at -O2 as plain weights are."""
    from vllm.model_executor.layers.cpu_linear import cpu_linear_op, small_m_linear_available
    from vllm.model_executor.layers.cpu_prepacked_linear import wait_for_prepacking
    from vllm.model_executor.layers.quantization import fp8_linear

    ckpt = make_fp8_llama(tmp_path / "k", layout="fp8", weights="tensor", activations="dynamic",
                          dtype="float32")
    calls = []

    def counting(x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return torch.nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(fp8_linear, "dispatch_linear", counting)
    _, model = our_logits(ckpt.path)  # -O0
    assert model.model.layers[0].self_attn.qkv_proj.quant_method.cpu_op is None
    assert len(calls) >= 4 * len(model.model.layers)  # qkv, o, gate_up, down of every layer

    config = VllmConfig(model_config=ModelConfig(model=ckpt.path, dtype="float32"),
                        optimization_level=2)
    compiled = get_model(config)
    method = compiled.model.layers[0].self_attn.qkv_proj.quant_method
    assert method.gemm == "dequant" and method.cpu_op is cpu_linear_op()
    wait_for_prepacking()
    weight = compiled.model.layers[0].self_attn.qkv_proj.weight
    if small_m_linear_available():
        assert torch.ops.vllm_cpu_linear.packed_of(weight) is not None
    x = torch.randn(3, weight.shape[1])
    torch.testing.assert_close(method._linear(x, weight), x @ weight.t(), rtol=1e-4, atol=1e-4)
