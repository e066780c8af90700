"""Linear weights prepacked for oneDNN once, used by compiled graphs through an opaque op.

Inductor lowers a float32 `F.linear` on the CPU to MKL's sgemm, which on the dev machines runs
decode-sized products several times slower than oneDNN on a weight reordered into its blocked
layout (16 x 256 -> 768: MKL 113 us, oneDNN on the plain weight 51 us, on the reordered weight
28 us). Inductor freezing does that reorder, but it folds the weights into the compiled code
as mkldnn tensors, which neither Inductor's cache nor ours can save: every start compiles
again. Here the weights stay graph inputs, so the compiled code holds no weight and is
cached like any other:
  - `prepack(weight)` reorders one loaded weight (after loading, once); the copy is kept,
    keyed by the weight's storage, until the parameter is freed;
  - the op `vllm::cpu_prepacked_linear(x, weight, bias)`, opaque to Dynamo and Inductor,
    computes with that copy; products of at most `SMALL_ROWS` rows (batch-1..4 decode) and a
    weight without a current copy (never prepacked, or changed in place since) go to
    `dispatch_linear` (its small-M kernel reads the plain weight faster than oneDNN).
Compiled models call the op for every float32 CPU linear (layers/linear.py), prepacked or not:
without a copy it runs `dispatch_linear`'s eager kernels, which also beat Inductor's MKL
lowering here. `compilation_config.prepack_linear_weights` (the CPU at -O2/-O3) prepacks.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch

from vllm.model_executor.layers.cpu_linear import dispatch_linear

SMALL_ROWS = 4
"""Products with at most this many rows use `dispatch_linear` (the small-M kernel)."""
PACK_BATCH_HINT = 16
"""The row count oneDNN picks the packed layout for (a decode batch)."""


@dataclasses.dataclass(frozen=True)
class _Packed:
    version: int
    shape: tuple[int, ...]
    packed: torch.Tensor


_PACKED: dict[int, _Packed] = {}


def can_prepack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.is_contiguous()
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def prepack(weight: torch.Tensor) -> bool:
    """Reorder `weight` [out, in] for oneDNN and keep the copy for the op; False when the
    weight is not eligible (not float32 on the CPU, not contiguous, no oneDNN)."""
    if not can_prepack(weight):
        return False
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
    key = weight.data_ptr()
    _PACKED[key] = _Packed(weight._version, tuple(weight.shape), packed)
    # The entry lives as long as the parameter: its storage (the key) cannot be reused before.
    weakref.finalize(weight, _PACKED.pop, key, None)
    return True


def num_prepacked() -> int:
    return len(_PACKED)


def _current(weight: torch.Tensor) -> torch.Tensor | None:
    entry = _PACKED.get(weight.data_ptr())
    if entry is None or entry.shape != tuple(weight.shape) or \
            entry.version != weight._version:
        return None
    return entry.packed


@torch.library.custom_op("vllm::cpu_prepacked_linear", mutates_args=())
def cpu_prepacked_linear(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [..., in], weight [out, in] -> [..., out]."""
    in_features = x.shape[-1]
    rows = x.numel() // in_features if in_features else 0
    packed = _current(weight) if rows > SMALL_ROWS else None
    if packed is None or x.dtype != torch.float32:
        return dispatch_linear(x, weight, bias)
    x2 = x.reshape(rows, in_features)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


@cpu_prepacked_linear.register_fake
def _cpu_prepacked_linear_fake(x: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
