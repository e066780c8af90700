"""AMD ROCm: like CUDA for levels (HIP graphs), without the FlashInfer all-reduce fusion."""
from __future__ import annotations

from vllm.platforms.cuda import CudaPlatform
from vllm.platforms.interface import PlatformEnum


class RocmPlatform(CudaPlatform):
    _enum = PlatformEnum.ROCM
    device_name = "rocm"
    device_type = "cuda"  # torch exposes HIP devices as "cuda"
    dist_backend = "nccl"  # RCCL behind the NCCL name

    def is_available(self) -> bool:
        import torch

        return torch.cuda.is_available() and torch.version.hip is not None

    def supports_allreduce_rms_fusion(self, vllm_config) -> bool:
        return False
