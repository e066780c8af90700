"""FP8 KV caches with a checkpoint's k/v scales: every naming the quantizers write reaches the
layer's Attention, an FP8 cache stores K / k_scale and V / v_scale, other caches ignore them."""
from __future__ import annotations

import os

import pytest
import torch

from tests.engine.engine_test_utils import assert_greedy_agrees
from tests.model_executor.hf_checkpoints import make_llama
from vllm.model_executor.models.llama import kv_scale_target

PROMPTS = ["Hello world!", "The quick brown fox jumps over the lazy dog"]


@pytest.mark.parametrize("name,target", [
    ("model.layers.3.self_attn.k_scale", ("model.layers.3.self_attn.attn", "k")),
    ("model.layers.3.self_attn.v_scale", ("model.layers.3.self_attn.attn", "v")),
    ("model.layers.3.self_attn.attn.k_scale", ("model.layers.3.self_attn.attn", "k")),
    ("model.layers.3.self_attn.k_proj.output_scale", ("model.layers.3.self_attn.attn", "k")),
    ("model.layers.3.self_attn.v_proj.output_scale", ("model.layers.3.self_attn.attn", "v")),
    ("model.layers.3.self_attn.k_proj.k_scale", ("model.layers.3.self_attn.attn", "k")),
    ("model.layers.3.self_attn.v_proj.v_scale", ("model.layers.3.self_attn.attn", "v")),
    ("model.layers.3.self_attn.kv_scale", ("model.layers.3.self_attn.attn", "kv")),
    ("model.layers.3.self_attn.k_proj.weight", None),
    ("model.layers.3.self_attn.k_proj.input_scale", None),
    ("model.layers.3.self_attn.q_proj.output_scale", None),
    ("model.layers.3.mlp.down_proj.weight_scale", None),
])
def test_kv_scale_names(name, target):
    assert kv_scale_target(name) == target


def _with_scales(path: str, scales: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors.update(scales)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_scales")
    plain = make_llama(root / "plain")
    scaled = _with_scales(make_llama(root / "scaled"), {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor([2.0]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(0.25),  # the older single scale
    })
    return plain, scaled


def _run(path, cache_dtype):
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, optimization_level=0, max_model_len=128, kv_cache_dtype=cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    layers = llm.llm_engine.executor.worker.model_runner.attention_layers
    scales = {name: (layer.k_scale, layer.v_scale) for name, layer in layers.items()}
    return outs, scales


def _greedy(outs):
    """Each output's tokens and their logprobs."""
    return [(o.outputs[0].token_ids,
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.fixture
def kernel_scales(monkeypatch):
    """The (k_scale, v_scale) of every call of the CPU kernel (skipped without it)."""
    from vllm.attention.backends.cpu_paged_kernel import cpu_paged_attention_available

    if not cpu_paged_attention_available():
        pytest.skip("the CPU paged-attention kernel could not be built")
    seen = []
    real = torch.ops.vllm_cpu_attn.write_and_attend
    monkeypatch.setattr(torch.ops.vllm_cpu_attn, "write_and_attend",
                        lambda *a: seen.append(a[-2:]) or real(*a))
    return seen


def test_checkpoint_scales_reach_the_layers_and_an_fp8_cache_uses_them(checkpoints,
                                                                       kernel_scales):
    plain, scaled = checkpoints
    seen = kernel_scales
    outs, scales = _run(scaled, "fp8")
    assert scales == {"model.layers.0.self_attn.attn": (0.5, 2.0),
                      "model.layers.1.self_attn.attn": (0.25, 0.25)}
    assert {(0.5, 2.0), (0.25, 0.25)} <= set(seen)
    # the same model with the float32 cache: near (FP8 rounding of K / scale, V / scale)
    for ours, ref in zip(outs, _run(plain, "auto")[0]):
        assert_greedy_agrees(ours, ref, 0.1)


def test_other_caches_load_the_scales_and_ignore_them(checkpoints, kernel_scales):
    plain, scaled = checkpoints
    seen = kernel_scales
    outs, scales = _run(scaled, "auto")
    assert scales["model.layers.0.self_attn.attn"] == (0.5, 2.0)
    assert set(seen) == {(1.0, 1.0)}
    assert _greedy(outs) == _greedy(_run(plain, "auto")[0])


def test_a_bad_scale_is_named(tmp_path):
    from vllm import LLM

    path = _with_scales(make_llama(tmp_path / "bad"),
                        {"model.layers.1.self_attn.v_scale": torch.tensor(0.0)})
    with pytest.raises(ValueError, match="v_scale of 'model.layers.1.self_attn.attn' must be a "
                                         "positive finite number, got 0.0"):
        LLM(model=path, optimization_level=0, max_model_len=128, kv_cache_dtype="fp8")
