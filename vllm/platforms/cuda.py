"""NVIDIA CUDA: CUDA graphs, FlashInfer all-reduce fusion."""
from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.config.levels import OptimizationLevel, Setting, enable_attn_fusion
from vllm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:

    from vllm.config import ModelConfig, VllmConfig


def attn_fusion_keeps_cuda_graphs(cfg: VllmConfig) -> bool:
    """model is FP8 with static activation scales, and the attention backend runs every batch inside full CUDA graphs (or none are captured)

    The Attention+QuantFP8 fusion needs the attention op inside one compiled graph: no pieces,
    so full CUDA graphs only. Unless the attention backend runs every batch inside a full
    graph, that leaves the batches it cannot (prompts and mixed batches, or all of them) with
    no CUDA graph at all, so the pieces (piecewise graphs) win: the fusion saves one copy per
    layer, the graphs the launch of every op."""  # noqa: E501
    if not enable_attn_fusion(cfg):
        return False
    if not cfg.compilation_config.cudagraph_mode:  # NONE: no CUDA graphs to keep
        return True
    from vllm.attention.backends.abstract import AttentionCGSupport
    from vllm.attention.selector import default_backend

    return default_backend().cudagraph_support == AttentionCGSupport.ALWAYS


_ATTN_FUSION_ROW = {"compilation_config": {"pass_config": {"fuse_attn_quant": Setting(
    attn_fusion_keeps_cuda_graphs, "else piecewise CUDA graphs are kept: the attention "
    "backend's CUDA-graph support is that of vllm/attention/selector.py's default")}}}
CUDA_LEVEL_TABLE = {OptimizationLevel.O2: _ATTN_FUSION_ROW, OptimizationLevel.O3: _ATTN_FUSION_ROW}
"""CUDA's level table: where it differs from the base table (vllm/config/levels.py)."""


class CudaPlatform(Platform):
    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    default_max_num_batched_tokens = 8192
    default_max_num_seqs = 256
    level_table = CUDA_LEVEL_TABLE

    def is_available(self) -> bool:
        import torch

        return torch.cuda.is_available() and torch.version.hip is None

    def support_static_graph_mode(self) -> bool:
        return True

    def resolve_auto_dtype(self, model_config: ModelConfig) -> tuple[str, str]:
        """float32 checkpoints run in bfloat16 (float16 on GPUs without it), as vLLM does: the
        GPU's tensor cores and memory traffic both favour 16-bit; other dtypes as stored."""
        name = model_config.checkpoint_dtype
        if name != "float32":
            return name, f"checkpoint dtype {name}"
        import torch

        half = ("bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False)
                else "float16")  # not emulated bf16 (pre-Ampere GPUs)
        return half, (f"checkpoint dtype float32, run in {half} on CUDA; pass --dtype "
                      "float32 to keep float32")

    def get_device_capability(self) -> tuple[int, int] | None:
        if not self.is_available():
            return None
        import torch

        return torch.cuda.get_device_capability()

    def supports_allreduce_rms_fusion(self, vllm_config: VllmConfig) -> bool:
        # The fused kernel (FlashInfer / TRT-LLM all-reduce) exists for Hopper and datacenter
        # Blackwell, 2/4/8 ranks, FlashInfer installed (vllm/distributed/
        # flashinfer_all_reduce.py); a simulated platform without a GPU reports it unsupported.
        from vllm.compilation.passes.pass_manager import has_pass
        from vllm.distributed.flashinfer_all_reduce import fusion_supported

        if not has_pass("fuse_allreduce_rms"):
            return False
        parallel = getattr(vllm_config, "parallel_config", None)
        world = parallel.tensor_parallel_size if parallel is not None else 2
        return fusion_supported(world, self.get_device_capability())[0]
