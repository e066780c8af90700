"""NVIDIA CUDA: CUDA graphs, FlashInfer all-reduce fusion."""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from vllm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:

    from vllm.config import ModelConfig, VllmConfig


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

    def apply_level_defaults(self, vllm_config: VllmConfig) -> None:
        self._keep_piecewise_graphs_over_attn_fusion(vllm_config)

    @staticmethod
    def _keep_piecewise_graphs_over_attn_fusion(vllm_config: VllmConfig) -> None:
        """The level's Attention+QuantFP8 fusion (-O2, FP8 models with static scales) needs the
        attention op inside one compiled graph: no pieces, so full CUDA graphs only. Unless
        the attention backend runs every batch inside a full graph, that leaves the batches
        it cannot (prompts and mixed batches, or all of them) with no CUDA graph at all, so
        the pieces (piecewise graphs) win: the fusion saves one copy per layer, the graphs
        the launch of every op. An explicit user value is never touched."""
        from vllm.attention.backends.abstract import AttentionCGSupport
        from vllm.attention.selector import default_backend

        path = "compilation_config.pass_config.fuse_attn_quant"
        prov = vllm_config.provenance.get(path)
        mode = vllm_config.compilation_config.cudagraph_mode
        if (not vllm_config.get_path(path) or prov is None or not prov.source.startswith("level")
                or not mode):  # None or NONE: no CUDA graphs to keep
            return
        backend = default_backend()
        support = backend.cudagraph_support
        if support == AttentionCGSupport.ALWAYS:
            return
        what = ("cannot run inside a full CUDA graph" if support == AttentionCGSupport.NEVER
                else f"runs only {support.name.lower().replace('_', ' ')} batches inside full "
                     "CUDA graphs")
        vllm_config.platform_set(
            path, False, f"the {backend.get_name()} attention backend {what}, and the fusion "
            "needs attention inside one compiled graph: piecewise CUDA graphs are kept instead")

    def get_device_capability(self) -> tuple[int, int] | None:
        if not self.is_available():
            return None
        import torch

        return torch.cuda.get_device_capability()

    def supports_allreduce_rms_fusion(self, vllm_config: VllmConfig) -> bool:
        # The fused kernel (FlashInfer / TRT-LLM all-reduce) exists for Hopper and datacenter
        # Blackwell; a simulated platform without a GPU reports it unsupported. Nor is there
        # a pass that would call it yet: the level must not claim the fusion.
        from vllm.compilation.passes.pass_manager import has_pass

        if not has_pass("fuse_allreduce_rms"):
            return False
        capability = self.get_device_capability()
        if capability is None:
            return False
        if importlib.util.find_spec("flashinfer") is None:
            return False
        return capability == (9, 0) or capability[0] == 10
