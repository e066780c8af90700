"""The CPU platform: our whole compile stack runs here, but there are no CUDA graphs."""
from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.config.compilation import CUDAGraphMode
from vllm.config.levels import (
    OptimizationLevel,
    Setting,
    enable_act_fusion,
    enable_attn_fusion,
    enable_norm_fusion,
    every_level,
    merge_rows,
)
from vllm.platforms.interface import Platform, PlatformEnum
from vllm.utils.cpu_info import cpu_has_native_bf16

if TYPE_CHECKING:
    from vllm.config import ModelConfig


# The CPU's level table: where it differs from the base table (vllm/config/levels.py), each
# with its reason. Measured on the dev machines (float32, 2 cores, AVX2; paired rounds of
# decode-shaped forwards of the compiled model at batch 1 / batch 16,
# benchmarks/bench_level_switches.py and bench_fp8_fusions.py; benchmarks/results/cpu_levels.md
# and fp8_fusions.md).

_NO_GRAPHS = {"compilation_config": {
    "cudagraph_mode": Setting(CUDAGraphMode.NONE, "the CPU has no CUDA graphs", required=True),
}}

# O2/O3: tensor-parallel ranks on one host all-reduce through shared memory
# (vllm/distributed/shm_all_reduce.py), whose fused op can also add the residual and normalise
# (and quantise) each reduced row (AllReduceFusionPass). Off by default here: inside compiled
# code the shared-memory all-reduce followed by Inductor's generated add + RMSNorm kernel
# measured faster than the fused op (1.0-1.6x, median 0.85x for the fusion; hidden 896-4096,
# 1-16 tokens; benchmarks/results/allreduce_compiled.md), and TP=2 decode of the 0.5B shape
# at -O2 0.97x / 0.95x with the fusion (batch 1 / 16; allreduce_qwen05b.md). Upstream too
# fuses it only on CUDA (FlashInfer). `fuse_allreduce_rms=True` still turns it on.
_ALLREDUCE_FUSION = {"compilation_config": {"pass_config": {
    "fuse_allreduce_rms": Setting(
        False,
        "CPU: measured slower than the shared-memory all-reduce plus Inductor's fused "
        "add + RMSNorm (0.61-1.00x inside compiled code, 0.95-0.97x end to end; "
        "benchmarks/bench_allreduce.py)"),
}}}

# The FP8 fusions stay on here (the base table's predicates) because they measured at least
# as fast as leaving Inductor to fuse the plain ops: our fused op against the Inductor-fused
# plain ops inside compiled code (1 / 16 / 128 tokens), and the FP8 Llama at -O2 with the
# fusion against without it.
_FP8_FUSIONS_O1 = {"compilation_config": {"pass_config": {
    "fuse_norm_quant": Setting(enable_norm_fusion, "CPU: fused op 1.03-2.46x faster at 16+ "
                               "tokens (per-token at 1 token 0.70x); model decode 1.00x/0.97x "
                               "(within noise)"),
    "fuse_act_quant": Setting(enable_act_fusion, "CPU: fused op 1.22-1.87x faster; model "
                              "decode 0.94x/1.37x"),
}}}
_FP8_FUSIONS_O2 = {"compilation_config": {"pass_config": {
    "fuse_attn_quant": Setting(enable_attn_fusion, "CPU: model decode 1.07x/0.95x (within "
                               "noise)"),
}}}

# O2: two switches only the CPU has.
_O2 = {"compilation_config": {
    # Linear weights prepacked once (oneDNN's reorder then; column panels for the panel kernel
    # since) and used through an opaque op (the weights stay graph inputs, so the compiled code
    # is cached): batch-16 decode x1.15-1.20 faster than
    # O1's plain weights, batch 1 alike (its few rows take the small-M kernel anyway). The LM head
    # is prepacked too: on the Qwen2.5-0.5B shape its 16-row product takes 14 ms instead of
    # 25 ms, batch-16 decode against -O0 x1.26 -> x1.33 (benchmarks/bench_levels.py).
    "prepack_linear_weights": Setting(
        True, "prepacked oneDNN linears: decode x1.15-1.20 at batch 16, x1.00 at batch 1 vs "
              "O1; cacheable"),
    # Inductor's C++ wrapper (the compiled code's host side in C++, so the ~100 op calls of a
    # step leave the Python interpreter); over O3's whole graph x1.15 / x1.07 (demo),
    # x1.00 / x1.01 (0.5B shape, whose whole-graph build it lengthens 19 -> 40 s). Warm
    # starts load the built wrappers without Inductor. (On CUDA the host code is replayed as
    # CUDA graphs instead.)
    "cpp_wrapper": Setting(
        True, "C++ host code: decode x1.07 / x1.06 at batch 1 / 16 on the demo model, "
              "x1.03 / x1.00 on the 0.5B shape, no longer cold start"),
}}

# O3 against O2: the base table's tuning switches measured no faster here; the whole model is
# compiled as one Inductor graph instead (attention inside, as an opaque op) of one piece per
# stretch between attention layers: without CUDA graphs nothing needs the pieces, and each
# piece boundary costs a Python call through the split module per layer. The price is
# start-up: identical layers no longer share one compiled piece, so a cold compile grows with
# the depth of the model. (Splitting ops the user gives are kept, as any explicit value.)
CPU_O3_WHOLE_GRAPH = ("decode x1.29 / x1.14 over O2's pieces at batch 1 / 16 on the demo model, "
                      "x1.04 / x1.01 on the Qwen2.5-0.5B shape (both with the C++ wrapper; "
                      "without it x1.12 / x1.06 and x1.05 / x1.02)")
_O3 = {"compilation_config": {
    "max_autotune": Setting(
        False, "not faster than O2 on the CPU (x1.01 / x1.00: its CPU GEMM templates need "
               "Inductor-visible frozen weights, and the linears here are prepacked opaque "
               "ops)"),
    "coordinate_descent_tuning": Setting(
        False, "not faster than O2 on the CPU (x1.01 / x1.00: it tunes Triton kernels, which "
               "the CPU does not use)"),
    "compile_sizes": Setting(
        [], "not faster than O2 on the CPU (static compiles for 1, 2, 4, 8, 16 tokens: x1.01 / "
            "x1.00 for 6x the compiles; over the whole graph with the C++ wrapper x1.03 / "
            "x0.98 for a 3.7x longer build)"),
    "splitting_ops": Setting(
        [], f"O3 on the CPU: whole-graph compile ({CPU_O3_WHOLE_GRAPH})"),
}}

_L = OptimizationLevel
CPU_LEVEL_TABLE = merge_rows(
    every_level(_NO_GRAPHS),
    {_L.O1: _FP8_FUSIONS_O1, _L.O2: _FP8_FUSIONS_O1, _L.O3: _FP8_FUSIONS_O1},
    {_L.O2: _FP8_FUSIONS_O2, _L.O3: _FP8_FUSIONS_O2},
    {_L.O2: _ALLREDUCE_FUSION, _L.O3: _ALLREDUCE_FUSION},
    {_L.O2: _O2, _L.O3: _O2},
    {_L.O3: _O3},
)
"""The CPU's level table (vllm/config/levels.py says how it is applied)."""


class CpuPlatform(Platform):
    _enum = PlatformEnum.CPU
    device_name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    default_max_num_batched_tokens = 2048
    default_max_num_seqs = 128
    level_table = CPU_LEVEL_TABLE

    def is_available(self) -> bool:
        return True

    def supports_allreduce_rms_fusion(self, vllm_config) -> bool:
        """The shared-memory all-reduce (with its fused residual add + RMSNorm) runs: ranks of
        one host (not the Ray executor, whose ranks may be on several) and the switch on."""
        from vllm.compilation.passes.registry import has_pass
        from vllm.utils.cpu_kernels import switched_off

        parallel = getattr(vllm_config, "parallel_config", None)
        if parallel is None or parallel.distributed_executor_backend == "ray":
            return False
        return has_pass("fuse_allreduce_rms") and not switched_off("VLLM_CPU_SHM_ALLREDUCE")

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
