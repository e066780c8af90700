"""Linear layers written for tensor parallelism (TP=1 needs no process group).

Every parameter carries a `weight_loader(param, loaded_weight[, shard_id])` that copies this
rank's part of a checkpoint tensor into it. Packed layers take a `shard_id`: QKVParallelLinear
loads "q", "k" and "v" into one fused weight; MergedColumnParallelLinear loads the checkpoint's
separate projections (0, 1, ... in `output_sizes` order, e.g. gate then up). Without a shard
id both take a checkpoint's already fused tensor (Phi-3's qkv_proj, gate_up_proj), split it
by the full sizes and load each part as its shard, so each rank still gets its own slices.

Layers return the output tensor (no separate bias tuple). The matmul itself is delegated to
`self.quant_method` (`UnquantizedLinearMethod` unless a quantization config provides another),
so quantized weights can be added without touching the layers.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.cpu_linear import dispatch_linear


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size "
                         f"{denominator}")
    return numerator // denominator


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any] | None) -> None:
    for key, value in (attrs or {}).items():
        if hasattr(param, key) and key != "weight_loader":
            raise ValueError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) with a clear error when the shapes differ."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit the "
                         f"parameter (part) of shape {tuple(dst.shape)}")
    dst.copy_(src)


def mark_shard_ids(layer: nn.Module, shard_ids: list) -> None:
    """Record the parts a packed weight is loaded in (the loader checks all arrived)."""
    for param in (getattr(layer, "weight", None), getattr(layer, "bias", None)):
        if param is not None:
            param.shard_ids = list(shard_ids)


def check_fused_rows(loaded_weight: torch.Tensor, output_dim: int, sizes: list[int]) -> None:
    """A fused checkpoint tensor (e.g. Phi-3's qkv_proj, gate_up_proj) must hold exactly the
    parts' full (unsplit) rows: a longer one is not silently cut."""
    if loaded_weight.dim() <= output_dim or loaded_weight.shape[output_dim] != sum(sizes):
        raise ValueError(f"fused checkpoint tensor of shape {tuple(loaded_weight.shape)} must "
                         f"have {sum(sizes)} rows (parts of {sizes}) along dim {output_dim}")


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a whole (replicated) tensor."""
    copy_checked(param.data, loaded_weight)


class LinearMethodBase:
    """How a linear layer stores its weights and computes x @ W^T (+ b)."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Hook run once after all weights are loaded (repacking, scales)."""


def compiled_with_opaque_linears() -> bool:
    """Whether the model being built is compiled by our backend with its linears left opaque
    to Inductor (every level from -O1, unless Inductor freezing was asked for)."""
    from vllm.config import get_current_vllm_config
    from vllm.config.compilation import CompilationMode

    config = get_current_vllm_config()
    cc = config.compilation_config if config is not None else None
    return cc is not None and cc.mode == CompilationMode.VLLM_COMPILE and not cc.freezing


def prepacking_wanted() -> bool:
    """Whether the model being built prepacks its CPU linear weights (float32; bfloat16 on
    AVX2), the LM head's included (`compilation_config.prepack_linear_weights`: the CPU at
    -O2/-O3)."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    return (compiled_with_opaque_linears()
            and bool(config.compilation_config.prepack_linear_weights))


class UnquantizedLinearMethod(LinearMethodBase):
    """Plain weights. In a compiled model (-O1..-O3) a float32 or bfloat16 CPU product goes
    through the opaque C++ dispatcher op `vllm_cpu_linear::linear` (layers/cpu_linear.py), the
    kernels of `dispatch_linear` (Inductor would lower it to MKL's sgemm, measured slower here;
    in bfloat16 to oneDNN's bfloat16 GEMM, which reads the weight at ~half the bandwidth at one
    row and has no fast kernel at all on AVX2: the 0.5B shape decoded 1.5x slower at -O2 than at
    -O0); with `compilation_config.prepack_linear_weights` (the CPU at -O2/-O3) a float32
    weight (a bfloat16 one on AVX2) is also packed into column panels after loading (in the
    background, finished after ready if need be) and the op computes batched-decode products
    with that copy.
    With Inductor freezing asked for (-cc.freezing=true) the linears stay visible to Inductor,
    which folds and prepacks them itself."""

    def __init__(self) -> None:
        self.compiled = compiled_with_opaque_linears()
        self.want_prepack = prepacking_wanted()
        self.cpu_op: Any = None

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       params_dtype, **extra_weight_attrs):
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                          dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        if (self.compiled and weight.device.type == "cpu"
                and weight.dtype in (torch.float32, torch.bfloat16)):
            from vllm.model_executor.layers.cpu_linear import cpu_linear_op
            from vllm.model_executor.layers.cpu_prepacked_linear import prepack_in_background

            self.cpu_op = cpu_linear_op()
            if self.want_prepack:  # float32, bfloat16 where packed (can_prepack)
                prepack_in_background(weight)  # finished in the background, maybe after ready

    def apply(self, layer, x, bias=None):
        if self.cpu_op is not None:
            return self.cpu_op(x, layer.weight, bias)
        return dispatch_linear(x, layer.weight, bias)


class LinearBase(nn.Module):
    """Common construction: sizes, dtype, TP rank/size and the quant method."""

    def __init__(self, input_size: int, output_size: int, params_dtype: torch.dtype | None = None,
                 quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        if quant_config is None:  # the model's checkpoint decides (None when unquantized)
            from vllm.model_executor.layers.quantization import current_quant_config

            quant_config = current_quant_config()
        method = None if quant_config is None else quant_config.get_quant_method(self, prefix)
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()

    def _make_bias(self, size: int, attrs: dict[str, Any]) -> None:
        bias = nn.Parameter(torch.empty(size, dtype=self.params_dtype), requires_grad=False)
        set_weight_attrs(bias, attrs)
        self.register_parameter("bias", bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={getattr(self, 'bias', None) is not None}, tp_size={self.tp_size}")


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 params_dtype: torch.dtype | None = None, quant_config: Any = None,
                 prefix: str = "") -> None:
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self.quant_method.create_weights(self, input_size, [output_size], self.params_dtype,
                                         weight_loader=self.weight_loader)
        if bias:
            self._make_bias(output_size, {"output_dim": 0, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Y = X W^T with W split by output rows: each rank computes its slice of Y.

    gather_output=True all-gathers the slices; otherwise the output stays split (the usual
    case: a RowParallelLinear follows)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 gather_output: bool = False, params_dtype: torch.dtype | None = None,
                 quant_config: Any = None, output_sizes: list[int] | None = None,
                 prefix: str = "") -> None:
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self.gather_output = gather_output
        self.output_sizes = list(output_sizes or [output_size])
        self.output_size_per_partition = divide(output_size, self.tp_size)
        self.output_partition_sizes = self._partition_sizes()
        self.quant_method.create_weights(self, input_size, self.output_partition_sizes,
                                         self.params_dtype, weight_loader=self.weight_loader)
        if bias:
            self._make_bias(self.output_size_per_partition,
                            {"output_dim": 0, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def _partition_sizes(self) -> list[int]:
        return [divide(size, self.tp_size) for size in self.output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        output_dim = getattr(param, "output_dim", None)
        if output_dim is not None and self.tp_size > 1:
            size = param.data.shape[output_dim]
            loaded_weight = loaded_weight.narrow(output_dim, self.tp_rank * size, size)
        copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        if self.gather_output:
            out = tensor_model_parallel_all_gather(out, dim=-1)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one weight
    (gate_proj and up_proj -> gate_up_proj). Shard ids index `output_sizes`."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True,
                 gather_output: bool = False, params_dtype: torch.dtype | None = None,
                 quant_config: Any = None, prefix: str = "") -> None:
        super().__init__(input_size, sum(output_sizes), bias, gather_output, params_dtype,
                         quant_config, output_sizes=output_sizes, prefix=prefix)
        mark_shard_ids(self, list(range(len(output_sizes))))

    def _shard_offset_size(self, shard_id: int) -> tuple[int, int]:
        sizes = self.output_partition_sizes
        return sum(sizes[:shard_id]), sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: int | None = None) -> None:
        output_dim = getattr(param, "output_dim", 0)
        if loaded_shard_id is None:  # the checkpoint already holds the fused tensor
            check_fused_rows(loaded_weight, output_dim, self.output_sizes)
            offset = 0
            for shard_id, total in enumerate(self.output_sizes):
                self.weight_loader(param, loaded_weight.narrow(output_dim, offset, total),
                                   shard_id)
                offset += total
            return
        if not 0 <= loaded_shard_id < len(self.output_sizes):
            raise ValueError(f"shard id {loaded_shard_id} is out of range for "
                             f"{len(self.output_sizes)} merged projections")
        offset, size = self._shard_offset_size(loaded_shard_id)
        if self.tp_size > 1:
            loaded_weight = loaded_weight.narrow(output_dim, self.tp_rank * size, size)
        copy_checked(param.data.narrow(output_dim, offset, size), loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections in one column-parallel weight [q | k | v].

    Heads are split over ranks; when there are fewer KV heads than ranks each KV head is
    replicated on `num_kv_head_replicas` ranks."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = True,
                 params_dtype: torch.dtype | None = None, quant_config: Any = None,
                 prefix: str = "") -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= self.total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, self.total_num_kv_heads)
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        q_size = self.num_heads * head_size * tp_size
        kv_size = self.num_kv_heads * head_size * tp_size
        super().__init__(hidden_size, q_size + 2 * kv_size, bias, False, params_dtype,
                         quant_config, output_sizes=[q_size, kv_size, kv_size], prefix=prefix)
        mark_shard_ids(self, ["q", "k", "v"])

    def _shard_offset_size(self, shard_id: str) -> tuple[int, int]:
        q = self.num_heads * self.head_size
        kv = self.num_kv_heads * self.head_size
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: str | None = None) -> None:
        output_dim = getattr(param, "output_dim", 0)
        if loaded_shard_id is None:  # a fused qkv tensor in the checkpoint
            q = self.total_num_heads * self.head_size
            kv = self.total_num_kv_heads * self.head_size
            check_fused_rows(loaded_weight, output_dim, [q, kv, kv])
            for shard_id, (start, size) in zip("qkv", ((0, q), (q, kv), (q + kv, kv))):
                self.weight_loader(param, loaded_weight.narrow(output_dim, start, size), shard_id)
            return
        if loaded_shard_id not in ("q", "k", "v"):
            raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', got {loaded_shard_id!r}")
        offset, size = self._shard_offset_size(loaded_shard_id)
        if self.tp_size > 1:
            index = (self.tp_rank if loaded_shard_id == "q"
                     else self.tp_rank // self.num_kv_head_replicas)
            loaded_weight = loaded_weight.narrow(output_dim, index * size, size)
        copy_checked(param.data.narrow(output_dim, offset, size), loaded_weight)


class RowParallelLinear(LinearBase):
    """Y = X W^T with W split by input columns: each rank holds a slice of X (the output of
    a column-parallel layer) and the partial products are summed with an all-reduce. The
    bias is added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 input_is_parallel: bool = True, reduce_results: bool = True,
                 params_dtype: torch.dtype | None = None, quant_config: Any = None,
                 prefix: str = "") -> None:
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.quant_method.create_weights(self, self.input_size_per_partition, [output_size],
                                         self.params_dtype, weight_loader=self.weight_loader)
        if bias:
            self._make_bias(output_size, {"weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        input_dim = getattr(param, "input_dim", None)
        if input_dim is not None and self.tp_size > 1:
            size = param.data.shape[input_dim]
            loaded_weight = loaded_weight.narrow(input_dim, self.tp_rank * size, size)
        copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank]
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        out = self.quant_method.apply(self, x, None)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out
