"""The CPU platform: our whole compile stack runs here, but there are no CUDA graphs."""
from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.platforms.interface import Platform, PlatformEnum
from vllm.utils.cpu_info import cpu_has_native_bf16

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig


class CpuPlatform(Platform):
    _enum = PlatformEnum.CPU
    device_name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    default_max_num_batched_tokens = 2048
    default_max_num_seqs = 128

    def is_available(self) -> bool:
        return True

    def resolve_auto_dtype(self, model_config: ModelConfig) -> tuple[str, str]:
        name = model_config.checkpoint_dtype
        if name == "float32":
            return "float32", "checkpoint dtype float32"
        if cpu_has_native_bf16():
            return name, f"checkpoint dtype {name}; this CPU has native bf16"
        # Measured on AVX2 machines without native bf16 (DESIGN.md §3): bf16 halves the bytes
        # of memory-bound batch-1 decode (~2x) but emulated bf16 matmuls run ~8x slower, so
        # prefill and batched decode lose far more than batch-1 decode gains.
        return "float32", (
            f"checkpoint dtype {name}, but this CPU has no native bf16 (emulated bf16 GEMMs are "
            "~8x slower than fp32); pass --dtype bfloat16 for ~2x faster batch-1 decode")

    def apply_level_defaults(self, vllm_config: VllmConfig) -> None:
        cc = vllm_config.compilation_config
        if cc.cudagraph_mode is not None and cc.cudagraph_mode != cc.cudagraph_mode.NONE:
            vllm_config.platform_set("compilation_config.cudagraph_mode", cc.cudagraph_mode.NONE,
                                     "the CPU has no CUDA graphs")
        if cc.pass_config.fuse_allreduce_rms:
            vllm_config.platform_set("compilation_config.pass_config.fuse_allreduce_rms", False,
                                     "the fused all-reduce + RMSNorm kernel needs CUDA")
        self._note_fusion_measurements(vllm_config)
        self._narrow_o3_switches(vllm_config)
        self._whole_graph_at_o3(vllm_config)

    @staticmethod
    def _whole_graph_at_o3(vllm_config: VllmConfig) -> None:
        """O3 on the CPU compiles the model as one Inductor graph (attention inside, as an
        opaque op) instead of one piece per stretch between attention layers: without CUDA
        graphs nothing needs the pieces, and each piece boundary costs a Python call through
        the split module per layer. The price is start-up: identical layers no longer share
        one compiled piece, so a cold compile grows with the depth of the model. Splitting
        ops the user gave are kept."""
        from vllm.config.compilation import CompilationMode

        cc = vllm_config.compilation_config
        if (int(vllm_config.optimization_level) < 3 or cc.mode != CompilationMode.VLLM_COMPILE
                or cc.splitting_ops is not None):
            return
        vllm_config.platform_set("compilation_config.splitting_ops", [],
                                 f"O3 on the CPU: whole-graph compile ({CPU_O3_WHOLE_GRAPH})")

    @staticmethod
    def _narrow_o3_switches(vllm_config: VllmConfig) -> None:
        """Turn off the level-enabled O3 switches that did not measure faster than O2 here
        (CPU_O3_MEASUREMENTS); an explicit user value is never touched."""
        for path, (off, figures) in CPU_O3_MEASUREMENTS.items():
            prov = vllm_config.provenance.get(path)
            value = vllm_config.get_path(path)
            if prov is None or not prov.source.startswith("level") or not value or value == off:
                continue
            vllm_config.platform_set(path, off, f"not faster than O2 on the CPU ({figures})")

    @staticmethod
    def _note_fusion_measurements(vllm_config: VllmConfig) -> None:
        """The FP8 fusions stay on by default here because they measured at least as fast as
        leaving Inductor to fuse the plain ops (benchmarks/results/fp8_fusions.md); the
        figures go into the provenance reason of each level-enabled flag."""
        for name, figures in CPU_FUSION_MEASUREMENTS.items():
            path = f"compilation_config.pass_config.{name}"
            prov = vllm_config.provenance.get(path)
            if prov is not None and prov.source.startswith("level") and vllm_config.get_path(path):
                vllm_config.provenance[path] = type(prov)(prov.source,
                                                          f"{prov.reason}; CPU: {figures}")


# Measured on the dev machines (2 cores, AVX2), benchmarks/bench_fp8_fusions.py: our fused op
# against the Inductor-fused plain ops inside compiled code (1 / 16 / 128 tokens), and the
# FP8 Llama at -O2 with the fusion against without it (batch 1 / batch 16 decode).
CPU_FUSION_MEASUREMENTS = {
    "fuse_norm_quant": "fused op 1.03-2.46x faster at 16+ tokens (per-token at 1 token 0.70x); "
                       "model decode 1.00x/0.97x (within noise)",
    "fuse_act_quant": "fused op 1.22-1.87x faster; model decode 0.94x/1.37x",
    "fuse_attn_quant": "model decode 1.07x/0.95x (within noise)",
}


# O3's whole-graph compile against O2's pieces, same method (benchmarks/results/cpu_levels.md).
CPU_O3_WHOLE_GRAPH = ("decode x1.29 / x1.14 over O2's pieces at batch 1 / 16 on the demo model, "
                      "x1.04 / x1.01 on the Qwen2.5-0.5B shape (both with the C++ wrapper; "
                      "without it x1.12 / x1.06 and x1.05 / x1.02)")


# The O3 switches against O2 on the CPU, measured on the demo model (float32, 2 cores, paired
# rounds of decode-shaped forwards at batch 1 / batch 16; benchmarks/results/cpu_levels.md).
# path -> (the value that turns it off, the figures for the provenance reason).
CPU_O3_MEASUREMENTS = {
    "compilation_config.max_autotune": (
        False, "x1.01 / x1.00: its CPU GEMM templates need Inductor-visible frozen weights, "
               "and the linears here are prepacked opaque ops"),
    "compilation_config.coordinate_descent_tuning": (
        False, "x1.01 / x1.00: it tunes Triton kernels, which the CPU does not use"),
    "compilation_config.compile_sizes": (
        [], "static compiles for 1, 2, 4, 8, 16 tokens: x1.01 / x1.00 for 6x the compiles; "
            "over the whole graph with the C++ wrapper x1.03 / x0.98 for a 3.7x longer build"),
}
