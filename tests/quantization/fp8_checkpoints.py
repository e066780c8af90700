"""FP8 checkpoints of a tiny random-weight Llama for tests and benchmarks.

    ckpt = make_fp8_llama(tmp_path / "fp8", layout="fp8", weights="tensor",
                          activations="static")
    ckpt.path           # the FP8 model folder (config.json with quantization_config,
                        # model.safetensors with float8_e4m3fn weights and scales, tokenizer)
    ckpt.dequant_path   # the same model with every weight dequantized (w_fp8 * scale), unquantized
    ckpt.scales         # {"model.layers.0.self_attn.q_proj": {"weight_scale": ..., ...}}

The model is written by transformers (LlamaForCausalLM, seeded), then every linear layer of
the decoder (q/k/v/o, gate/up/down) is quantized with known scales:
  weights "tensor":  one scale per tensor = amax / 448;
          "channel": one per output row (compressed-tensors only);
          "block":   one per 128x128 block (hidden sizes are then multiples of 128);
  activations "static":  input_scale = calibrated amax of the layer's input / 448 (the HF model
                         run on a few random sequences), "dynamic": per token, "group": per
                         group of 128 columns (with block weights).
Layouts: "fp8" (quant_method fp8: weight_scale, or weight_scale_inv with weight_block_size;
scalars of shape []) and "compressed-tensors" (config_groups; scales of shape [1] / [N, 1]).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.model_executor.hf_checkpoints import TINY, make_tokenizer

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Block-wise checkpoints need every shard on a 128-row boundary.
BLOCK_DIMS = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
              "num_key_value_heads": 4}


@dataclass
class Fp8Checkpoint:
    path: str
    dequant_path: str
    layout: str
    weights: str
    activations: str
    scales: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def _quantize_weight(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor,
                                                               torch.Tensor]:
    """(w_fp8, scale, dequantized float32 weight)."""
    w = w.to(torch.float32)
    if strategy == "tensor":
        scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12).reshape(())
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return q, scale, q.to(torch.float32) * scale
    if strategy == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return q, scale, q.to(torch.float32) * scale
    n, k = w.shape
    assert n % BLOCK == 0 and k % BLOCK == 0, (n, k)
    blocks = w.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    deq = (q.to(torch.float32) * scale[:, None, :, None]).reshape(n, k)
    return q.reshape(n, k), scale, deq


def _calibrate(model: Any, vocab_size: int, seed: int) -> dict[str, float]:
    """amax of each decoder linear's input over a few random sequences."""
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEARS:
            def hook(mod, args, _name=name):
                amax[_name] = max(amax.get(_name, 0.0), float(args[0].abs().max()))
            hooks.append(module.register_forward_pre_hook(hook))
    generator = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(3, vocab_size, (4, 48), generator=generator)
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return amax


def _quant_config(layout: str, weights: str, activations: str) -> dict[str, Any]:
    if layout == "fp8":
        if weights == "channel":
            raise ValueError("the fp8 layout has per-tensor or block weights; use "
                             "compressed-tensors for per-channel")
        config: dict[str, Any] = {"quant_method": "fp8",
                                  "activation_scheme": "static" if activations == "static"
                                  else "dynamic"}
        if weights == "block":
            config["weight_block_size"] = [BLOCK, BLOCK]
        return config
    weight_args = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": weights}
    if weights == "block":
        weight_args["block_structure"] = [BLOCK, BLOCK]
    act_args = {"num_bits": 8, "type": "float", "symmetric": True,
                "dynamic": activations != "static",
                "strategy": {"static": "tensor", "dynamic": "token", "group": "group"}[
                    activations]}
    if activations == "group":
        act_args["group_size"] = BLOCK
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weight_args,
                                          "input_activations": act_args}},
            "ignore": ["lm_head"]}


def make_fp8_llama(path: Any, *, layout: str = "fp8", weights: str = "tensor",
                   activations: str = "static", dtype: str = "bfloat16", seed: int = 0,
                   **overrides: Any) -> Fp8Checkpoint:
    """Write the FP8 folder at `path` and its dequantized twin at `<path>-dequant`."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    if layout not in ("fp8", "compressed-tensors"):
        raise ValueError(f"unknown layout {layout!r}")
    if activations == "group" and weights != "block" and layout == "fp8":
        raise ValueError("per-group activations come with block weights in the fp8 layout")
    path = str(path)
    dequant_path = path.rstrip("/") + "-dequant"
    settings = {**TINY, **(BLOCK_DIMS if weights == "block" else {}), **overrides}
    config = LlamaConfig(**settings)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    amax = _calibrate(model, config.vocab_size, seed) if activations == "static" else {}

    ckpt = Fp8Checkpoint(path, dequant_path, layout, weights, activations)
    quantized: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in LINEARS:
            q, scale, deq = _quantize_weight(tensor, weights)
            scale_name = "weight_scale_inv" if (layout == "fp8" and weights == "block") \
                else "weight_scale"
            if layout == "compressed-tensors" and scale.dim() == 0:
                scale = scale.reshape(1)
            quantized[name] = q
            quantized[f"{module}.{scale_name}"] = scale.contiguous()
            entry = {scale_name: scale}
            if activations == "static":
                input_scale = torch.tensor(max(amax[module], 1e-6) / FP8_MAX)
                if layout == "compressed-tensors":
                    input_scale = input_scale.reshape(1)
                quantized[f"{module}.input_scale"] = input_scale
                entry["input_scale"] = input_scale
            ckpt.scales[module] = entry
            with torch.no_grad():
                tensor.copy_(deq)  # the dequantized twin holds exactly what the FP8 model uses
        else:
            quantized[name] = tensor.to(getattr(torch, dtype)).contiguous()
    if getattr(config, "tie_word_embeddings", False):
        quantized.pop("lm_head.weight", None)

    # The dequantized twin: an ordinary checkpoint.
    model.config.dtype = dtype
    model.to(getattr(torch, dtype)).save_pretrained(dequant_path, safe_serialization=True)
    make_tokenizer(dequant_path, config.vocab_size)

    os.makedirs(path, exist_ok=True)
    save_file(quantized, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dequant_path, "config.json")) as f:
        config_json = json.load(f)
    config_json["quantization_config"] = _quant_config(layout, weights, activations)
    for key in ("dtype", "torch_dtype"):
        if key in config_json:
            config_json[key] = dtype
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2)
    for name in os.listdir(dequant_path):
        if name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(os.path.join(dequant_path, name), os.path.join(path, name))
    return ckpt
