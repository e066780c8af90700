"""NVIDIA CUDA: CUDA graphs, FlashInfer all-reduce fusion."""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from vllm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class CudaPlatform(Platform):
    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    default_max_num_batched_tokens = 8192
    default_max_num_seqs = 256

    def is_available(self) -> bool:
        import torch

        return torch.cuda.is_available() and torch.version.hip is None

    def support_static_graph_mode(self) -> bool:
        return True

    def get_device_capability(self) -> tuple[int, int] | None:
        if not self.is_available():
            return None
        import torch

        return torch.cuda.get_device_capability()

    def supports_allreduce_rms_fusion(self, vllm_config: VllmConfig) -> bool:
        # The fused kernel (FlashInfer / TRT-LLM all-reduce) exists for Hopper and datacenter
        # Blackwell; a simulated platform without a GPU reports it unsupported.
        capability = self.get_device_capability()
        if capability is None:
            return False
        if importlib.util.find_spec("flashinfer") is None:
            return False
        return capability == (9, 0) or capability[0] == 10
