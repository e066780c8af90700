"""When FlashInfer's fused all-reduce (+ residual add + RMSNorm [+ FP8 quant]) can serve the
AllReduce+RMSNorm fusion on CUDA: the capability checks, without importing FlashInfer.

Upstream enables it for tensor parallelism over 2, 4 or 8 GPUs of compute capability 9.0
(Hopper) or 10.x (datacenter Blackwell) with FlashInfer installed, for inputs up to a size
that depends on the capability and the world size (beyond it: the unfused all-reduce).

State here: the checks below are what `CudaPlatform.supports_allreduce_rms_fusion` asks, but
this engine's CUDA all-reduce still goes through torch.distributed's functional collective,
not through `torch.ops.vllm.all_reduce` (the op AllReduceFusionPass matches), so nothing
would be fused on CUDA: `ROUTED` stays False and the level does not claim the fusion there.
Multi-GPU FlashInfer cannot be checked on one GPU; its tests skip without two Hopper or
Blackwell GPUs and FlashInfer.
"""
from __future__ import annotations

import importlib.util
from typing import Any

ROUTED = False
"""Whether CUDA's tensor-parallel all-reduce is emitted as the op the fusion pass matches."""

WORLD_SIZES = (2, 4, 8)

MAX_INPUT_MB: dict[int, dict[int, float]] = {
    90: {2: 64, 4: 2, 8: 0.5},
    100: {2: 64, 4: 32, 8: 1},
}
"""Largest all-reduce input (MiB) fused per capability (major*10 + minor, Blackwell under 100)
and world size; larger inputs take the unfused path."""


def _family(capability: tuple[int, int]) -> int | None:
    if tuple(capability) == (9, 0):
        return 90
    if capability[0] == 10:
        return 100
    return None


def fusion_supported(world_size: int, capability: tuple[int, int] | None,
                     flashinfer_present: bool | None = None) -> tuple[bool, str]:
    """(usable, why) for FlashInfer's fused all-reduce at this world size and capability."""
    if world_size < 2:
        return False, "one rank: no all-reduce"
    if world_size not in WORLD_SIZES:
        return False, f"world size {world_size} (FlashInfer fuses 2, 4 or 8 ranks)"
    if capability is None or _family(capability) is None:
        return False, f"compute capability {capability} (needs 9.0 or 10.x)"
    if flashinfer_present is None:
        flashinfer_present = importlib.util.find_spec("flashinfer") is not None
    if not flashinfer_present:
        return False, "FlashInfer is not installed"
    if not ROUTED:
        return False, "the CUDA all-reduce is not routed through the fusable op yet"
    return True, f"FlashInfer fused all-reduce ({world_size} ranks, sm{_family(capability)})"


def max_tokens(world_size: int, capability: tuple[int, int], hidden_size: int,
               element_size: int) -> int:
    """Most tokens whose all-reduce input fits FlashInfer's limit (0: none)."""
    family = _family(capability)
    if family is None or world_size not in WORLD_SIZES or hidden_size <= 0:
        return 0
    limit = int(MAX_INPUT_MB[family][world_size] * (1 << 20))
    return limit // (hidden_size * element_size)


def flashinfer_comm() -> Any | None:
    """flashinfer.comm when it has the fused all-reduce API (imported only when asked, which
    only CUDA does)."""
    if importlib.util.find_spec("flashinfer") is None:
        return None
    try:
        import flashinfer.comm as comm
    except ImportError:
        return None
    if hasattr(comm, "allreduce_fusion") or hasattr(comm, "trtllm_allreduce_fusion"):
        return comm
    return None
