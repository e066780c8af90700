"""Fp8LinearMethod: a linear layer with float8_e4m3fn weights and FP8 activations (W8A8).

Weights (checkpoint layout): `weight` [N, K] float8_e4m3fn and its scales, one of
  "tensor":  one float32 scale per checkpoint tensor (per shard of a packed layer: q, k, v);
  "channel": one per output row, [N, 1];
  "block":   one per (bn x bk) block, [ceil(N / bn), ceil(K / bk)] (named weight_scale_inv
             in Hugging Face FP8 checkpoints, weight_scale in compressed-tensors ones).
Activations: static per-tensor (`input_scale`, one per shard; the layer uses their max, the
shards share one input), dynamic per-token, or dynamic per-group (1 x bk, with block weights).

forward: x [..., K] -> reshape to 2-D -> QuantFP8 (q, scales) -> FP8 GEMM -> [..., N].
The GEMM is chosen once, after loading, per device:
  "scaled_mm": torch._scaled_mm on CUDA GPUs with FP8 tensor cores (compute capability >= 8.9)
               and per-tensor or per-channel weight scales;
  "dequant":   everywhere else (the CPU, block scales): the weights are dequantized once to the
               compute dtype and the quantized activations are dequantized per call. On the CPU
               torch._scaled_mm runs but was measured about 35x slower than a bf16 GEMM of the
               same size (2048x5632, 1-16 tokens), so it is not used there. The activation
               quantization still runs, so the numerics are those of an FP8 model.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from vllm.logger import init_logger
from vllm.model_executor.kernels.fp8_ops import FP8_DTYPE
from vllm.model_executor.layers.cpu_linear import dispatch_linear
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    compiled_with_opaque_linears,
    copy_checked,
    prepacking_wanted,
    set_weight_attrs,
)
from vllm.model_executor.layers.quantization.input_quant_fp8 import GroupShape, QuantFP8

logger = init_logger(__name__)

WEIGHT_STRATEGIES = ("tensor", "channel", "block")


def scaled_mm_supported(device: torch.device) -> bool:
    """torch._scaled_mm is worth using: a CUDA GPU with FP8 tensor cores."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def shard_ids_of(layer: nn.Module) -> list | None:
    """The shard ids a packed layer is loaded by (None for a layer loaded in one piece)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(layer, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.output_sizes)))
    return None


def _per_shard_loader(layer: nn.Module):
    """Loads one float32 scale per shard into a [num_shards] parameter (a checkpoint scale
    has shape [] or [1]; a fused checkpoint tensor of a packed layer fills every shard)."""
    ids = shard_ids_of(layer)

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if loaded.numel() != 1:
            raise ValueError(f"expected a per-tensor scale (one element), got shape "
                             f"{tuple(loaded.shape)}")
        value = loaded.reshape(()).to(torch.float32)
        if shard_id is None:
            param.data.fill_(value)
            return
        if ids is None or shard_id not in ids:
            raise ValueError(f"unknown shard id {shard_id!r} for a scale of {type(layer).__name__}")
        param.data[ids.index(shard_id)] = value

    return load


def _block_loader(layer: nn.Module, block_n: int):
    """Loads block scales [ceil(N / bn), ceil(K / bk)]: a shard (or this rank's slice) must
    start on a block boundary."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        loaded = loaded.to(torch.float32)
        tp_size, tp_rank = layer.tp_size, layer.tp_rank
        if shard_id is None:
            if tp_size > 1:
                dim = 1 if getattr(layer, "input_size_per_partition", None) is not None else 0
                size = param.data.shape[dim]
                loaded = loaded.narrow(dim, tp_rank * size, size)
            copy_checked(param.data, loaded)
            return
        offset, size = layer._shard_offset_size(shard_id)
        if offset % block_n:
            raise ValueError(f"shard {shard_id!r} of {layer.prefix or type(layer).__name__} starts "
                             f"at row {offset}, not on a {block_n}-row block boundary")
        blocks = math.ceil(size / block_n)
        if tp_size > 1:
            index = tp_rank
            if shard_id in ("k", "v"):
                index = tp_rank // layer.num_kv_head_replicas
            start = index * size
            if start % block_n:
                raise ValueError(f"tensor-parallel slice of shard {shard_id!r} is not aligned "
                                 f"to {block_n}-row blocks")
            loaded = loaded.narrow(0, start // block_n, blocks)
        copy_checked(param.data.narrow(0, offset // block_n, blocks), loaded)

    return load


class Fp8LinearMethod(LinearMethodBase):
    """See the module docstring. One instance per layer (it holds the layer's QuantFP8)."""

    def __init__(self, weight_strategy: str, act_static: bool,
                 block_size: tuple[int, int] | None = None,
                 act_group_shape: GroupShape | None = None,
                 weight_scale_name: str = "weight_scale") -> None:
        if weight_strategy not in WEIGHT_STRATEGIES:
            raise ValueError(f"FP8 weight strategy {weight_strategy!r} is not supported; "
                             f"supported: {', '.join(WEIGHT_STRATEGIES)}")
        if weight_strategy == "block" and block_size is None:
            raise ValueError("block-wise FP8 weights need a block size")
        if act_group_shape is None:
            if act_static:
                act_group_shape = GroupShape.PER_TENSOR
            elif weight_strategy == "block":
                act_group_shape = GroupShape(1, block_size[1])
            else:
                act_group_shape = GroupShape.PER_TOKEN
        self.weight_strategy = weight_strategy
        self.block_size = tuple(block_size) if block_size else None
        self.act_static = act_static
        self.act_group_shape = act_group_shape
        self.weight_scale_name = weight_scale_name
        self.gemm = "unset"
        self.quant = QuantFP8(act_static, act_group_shape)
        # The dequantized CPU GEMM goes through the CPU linear kernels, as plain weights do
        # (UnquantizedLinearMethod): compiled, the opaque op and (-O2/-O3) a prepacked copy
        self.compiled = compiled_with_opaque_linears()
        self.want_prepack = prepacking_wanted()
        self.cpu_op: Any = None

    # ---- construction and loading ------------------------------------------------------
    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        n, k = sum(output_partition_sizes), input_size_per_partition
        loader = extra_weight_attrs.get("weight_loader")
        ids = shard_ids_of(layer)
        weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)
        shards = len(output_partition_sizes)
        if self.weight_strategy == "tensor":
            scale = nn.Parameter(torch.empty(shards, dtype=torch.float32), requires_grad=False)
            scale.weight_loader = _per_shard_loader(layer)
        elif self.weight_strategy == "channel":
            scale = nn.Parameter(torch.empty(n, 1, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(scale, {"output_dim": 0, "weight_loader": loader})
        else:
            bn, bk = self.block_size
            for size in output_partition_sizes[:-1]:
                if size % bn:
                    raise ValueError(
                        f"{layer.prefix or type(layer).__name__}: output shard of {size} rows is "
                        f"not a multiple of the FP8 weight block size {bn}")
            scale = nn.Parameter(torch.empty(math.ceil(n / bn), math.ceil(k / bk),
                                             dtype=torch.float32), requires_grad=False)
            scale.weight_loader = _block_loader(layer, bn)
        if ids is not None:
            scale.shard_ids = list(ids)
        layer.register_parameter(self.weight_scale_name, scale)
        if self.act_static:
            input_scale = nn.Parameter(torch.empty(shards, dtype=torch.float32),
                                       requires_grad=False)
            input_scale.weight_loader = _per_shard_loader(layer)
            if ids is not None:
                input_scale.shard_ids = list(ids)
            layer.register_parameter("input_scale", input_scale)
        else:
            layer.register_parameter("input_scale", None)
        layer.output_dtype = params_dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        n, k = weight.shape
        dtype = layer.output_dtype
        scale = getattr(layer, self.weight_scale_name).data
        if self.act_static:
            # One activation feeds every shard: use the largest scale (no clipping).
            layer.input_scale = nn.Parameter(layer.input_scale.data.max().reshape(1),
                                             requires_grad=False)
        if self.scaled_mm_fits(n, k, dtype) and scaled_mm_supported(weight.device):
            self.gemm = "scaled_mm"
            row_scale = self._row_scales(layer, scale, n)
            if bool((row_scale == row_scale[0]).all()):
                layer.weight_scale_mm = nn.Parameter(row_scale[:1].clone(), requires_grad=False)
            else:
                layer.weight_scale_mm = nn.Parameter(row_scale.view(1, n), requires_grad=False)
            return
        self.gemm = "dequant"
        if weight.device.type == "cpu":
            # Build (first time on this machine) and load the C++ quant kernels now, in the
            # loading phase, rather than at the first forward.
            from vllm.model_executor.kernels.cpu_loader import load_cpu_fp8_kernels

            load_cpu_fp8_kernels()
        w32 = weight.to(torch.float32)
        if self.weight_strategy == "block":
            bn, bk = self.block_size
            expanded = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            w32 = w32 * expanded
        else:
            w32 = w32 * self._row_scales(layer, scale, n).view(n, 1)
        if self.act_static:
            # Fold the static activation scale into the weight: y = q @ (w * s_x)^T.
            w32 = w32 * layer.input_scale.data
        if weight.device.type == "cpu":  # in huge pages, as loaded weights (utils/hugepages.py)
            from vllm.utils.hugepages import weight_zeros

            dequantized = weight_zeros(w32.shape, dtype).copy_(w32)
        else:
            dequantized = w32.to(dtype)
        layer.weight = nn.Parameter(dequantized, requires_grad=False)
        if (self.compiled and weight.device.type == "cpu"
                and dtype in (torch.float32, torch.bfloat16)):
            from vllm.model_executor.layers.cpu_linear import cpu_linear_op
            from vllm.model_executor.layers.cpu_prepacked_linear import prepack_in_background

            self.cpu_op = cpu_linear_op()
            if self.want_prepack:
                prepack_in_background(layer.weight)

    def scaled_mm_fits(self, n: int, k: int, out_dtype: torch.dtype) -> bool:
        """What torch._scaled_mm takes on CUDA: a scale per tensor or per row of either operand
        (not per block of the weight or per group of the activation), K and N multiples of 16,
        and a bfloat16 output (float32 refuses a bias; float16 refuses row-wise scales).
        Other layers dequantize the weight once and run a plain GEMM."""
        return (self.weight_strategy != "block" and not self.act_group_shape.is_per_group
                and n % 16 == 0 and k % 16 == 0 and out_dtype == torch.bfloat16)

    def _row_scales(self, layer: nn.Module, scale: torch.Tensor, n: int) -> torch.Tensor:
        if self.weight_strategy == "channel":
            return scale.reshape(n).to(torch.float32)
        sizes = list(getattr(layer, "output_partition_sizes", None) or [n])
        if scale.numel() != len(sizes):
            sizes = [n]
            scale = scale.reshape(-1)[:1]
        return torch.repeat_interleave(scale.reshape(-1).to(torch.float32),
                                       torch.tensor(sizes, device=scale.device))

    # ---- forward -------------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        k = x.shape[-1]
        x2d = x.reshape(-1, k)
        q, scale = self.quant(x2d, layer.input_scale)
        if self.gemm == "scaled_mm":
            out = self._scaled_mm(layer, q, scale, bias)
        else:
            out = self._dequant_mm(layer, q, scale, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _dequant_mm(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        dtype = layer.weight.dtype
        if self.act_static:  # the scale is folded into the weight
            return self._linear(q.to(dtype), layer.weight, bias)
        if self.act_group_shape.is_per_group:
            g = self.act_group_shape.col
            x = (q.to(torch.float32).unflatten(-1, (-1, g)) * scale.unsqueeze(-1)).flatten(-2)
            return self._linear(x.to(dtype), layer.weight, bias)
        out = (self._linear(q.to(dtype), layer.weight) * scale).to(dtype)
        return out if bias is None else out + bias

    def _linear(self, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """The dequantized product: compiled on the CPU the opaque CPU linear op, else
        `dispatch_linear` (the CPU kernels in eager mode; `F.linear` elsewhere and in traced
        code). On the CPU a bfloat16 F.linear would be oneDNN's GEMM, which reads the weight
        at about half the bandwidth at one row (layers/linear.py)."""
        if self.cpu_op is not None:
            return self.cpu_op(x, weight, bias)
        return dispatch_linear(x, weight, bias)

    def _scaled_mm(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
        weight_scale = layer.weight_scale_mm
        scale_a = scale.to(torch.float32)
        if weight_scale.dim() == 2 or scale_a.numel() > 1:  # row-wise scaling
            scale_a = scale_a.reshape(-1, 1).expand(q.shape[0], 1).contiguous()
            if weight_scale.dim() == 1:
                weight_scale = weight_scale.view(1, 1).expand(1, layer.weight.shape[0])
            weight_scale = weight_scale.contiguous()
        else:
            scale_a = scale_a.reshape(())
            weight_scale = weight_scale.reshape(())
        return torch._scaled_mm(q, layer.weight.t(), scale_a=scale_a, scale_b=weight_scale,
                                bias=bias, out_dtype=layer.output_dtype)
