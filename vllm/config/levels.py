"""The optimization-level presets: one static table of defaults per level (data).

A preset value is either a constant or a `Cond`, a function of the whole `VllmConfig` with a
one-line description; `VllmConfig.__post_init__` applies the table to unset (`None`) leaves
only. Keys are dotted paths from the `VllmConfig` root.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.config.compilation import CompilationMode, CUDAGraphMode

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig


class OptimizationLevel(enum.IntEnum):
    """Start-up time traded for run-time speed."""

    O0 = 0
    """No compilation, no CUDA graphs, no passes: starts at once."""
    O1 = 1
    """Our compile backend (Inductor per piece) and piecewise CUDA graphs: compile fast."""
    O2 = 2
    """O1 + full and piecewise CUDA graphs, no-op elimination and fusion passes; CPU: linear
    weights prepacked for oneDNN, C++ host code (Inductor's C++ wrapper). The default."""
    O3 = 3
    """O2 + Inductor autotuning and per-size compiles for common decode sizes: tune for speed.
    CPU: those measured no faster there, so its platform turns them off and compiles the
    whole model as one graph instead (vllm/platforms/cpu.py)."""

    @classmethod
    def parse(cls, value: Any) -> OptimizationLevel:
        """Accept the enum, 0..3, "0".."3" or "O0".."O3"; anything else is a clear error."""
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
            return cls(value)
        if isinstance(value, str):
            text = value.strip()
            if text[:1] in ("O", "o") and text[1:].isdigit():
                text = text[1:]
            if text in ("0", "1", "2", "3"):
                return cls(int(text))
        raise ValueError(f"Invalid optimization level {value!r}: use 0, 1, 2 or 3 "
                         "(or O0, O1, O2, O3)")


@dataclass(frozen=True)
class Cond:
    """A preset value computed from the whole config, with what it asks in words."""

    fn: Callable[[VllmConfig], Any]
    description: str

    def __call__(self, config: VllmConfig) -> Any:
        return self.fn(config)


def _is_fp8(cfg: VllmConfig) -> bool:
    return cfg.model_config is not None and cfg.model_config.is_fp8


def _fp8_static(cfg: VllmConfig) -> bool:
    return cfg.model_config is not None and cfg.model_config.has_static_activation_scales


def _tp_allreduce(cfg: VllmConfig) -> bool:
    return (cfg.parallel_config.tensor_parallel_size > 1
            and cfg.platform.supports_allreduce_rms_fusion(cfg))


IS_FP8 = Cond(_is_fp8, "model is FP8-quantized")
FP8_STATIC = Cond(_fp8_static, "model is FP8 with static activation scales")
TP_ALLREDUCE = Cond(_tp_allreduce,
                    "tensor_parallel_size > 1 and the platform has the fused all-reduce kernel")
ON_CPU = Cond(lambda cfg: cfg.platform.is_cpu(), "platform is the CPU")
# CPU, measured on the demo model (float32, 2 cores, decode-shaped forwards of the compiled
# model, paired rounds; benchmarks/bench_level_switches.py, results/cpu_levels.md): linear
# weights reordered for oneDNN once and used through an opaque op (the weights stay graph
# inputs, so the compiled code is cached) run batch-16 decode x1.15-1.20 faster than O1's
# plain weights and batch-1 decode alike (x1.00: 1-4 rows take the small-M kernel anyway).
# The LM head is prepacked too: on the Qwen2.5-0.5B shape its 16-row product takes 14 ms
# instead of 25 ms, batch-16 decode against -O0 x1.26 -> x1.33 (benchmarks/bench_levels.py).
PREPACK_ON_CPU = Cond(lambda cfg: cfg.platform.is_cpu(),
                      "platform is the CPU (prepacked oneDNN linears: decode x1.15-1.20 at "
                      "batch 16, x1.00 at batch 1 vs O1; cacheable)")

# CPU, measured with benchmarks/bench_level_switches.py (paired rounds of decode-shaped
# forwards, results/cpu_levels.md): Inductor's C++ wrapper (the compiled code's host side in
# C++, so the ~100 op calls of a step leave the Python interpreter) runs decode x1.07 / x1.06
# faster at batch 1 / 16 on the demo model at O2 and x1.03 / x1.00 on the memory-bound
# Qwen2.5-0.5B shape, with no longer a cold start there (the pieces of identical layers share
# one build); over O3's whole graph x1.15 / x1.07 (demo), x1.00 / x1.01 (0.5B shape, whose
# whole-graph build it lengthens 19 -> 40 s). Warm starts load the built wrappers without
# Inductor.
CPP_WRAPPER_ON_CPU = Cond(lambda cfg: cfg.platform.is_cpu(),
                          "platform is the CPU (C++ host code: decode x1.07 / x1.06 at batch 1 / "
                          "16 on the demo model, x1.03 / x1.00 on the 0.5B shape, no longer "
                          "cold start)")

# Token counts that get their own static-shape compile at O3: the common decode batch sizes.
O3_COMPILE_SIZES = [1, 2, 4, 8, 16]

_CC = "compilation_config"
_PC = "compilation_config.pass_config"

_O0 = {
    f"{_CC}.mode": CompilationMode.NONE,
    f"{_CC}.cudagraph_mode": CUDAGraphMode.NONE,
    f"{_CC}.use_inductor_graph_partition": False,
    f"{_CC}.freezing": False,
    f"{_CC}.prepack_linear_weights": False,
    f"{_CC}.max_autotune": False,
    f"{_CC}.coordinate_descent_tuning": False,
    f"{_CC}.cpp_wrapper": False,
    f"{_CC}.compile_sizes": [],
    f"{_PC}.eliminate_noops": False,
    f"{_PC}.fuse_norm_quant": False,
    f"{_PC}.fuse_act_quant": False,
    f"{_PC}.fuse_attn_quant": False,
    f"{_PC}.fuse_allreduce_rms": False,
}
_O1 = {
    **_O0,
    f"{_CC}.mode": CompilationMode.VLLM_COMPILE,
    f"{_CC}.cudagraph_mode": CUDAGraphMode.PIECEWISE,
    f"{_PC}.eliminate_noops": True,
    f"{_PC}.fuse_norm_quant": IS_FP8,
    f"{_PC}.fuse_act_quant": IS_FP8,
}
_O2 = {
    **_O1,
    f"{_CC}.cudagraph_mode": CUDAGraphMode.FULL_AND_PIECEWISE,
    # Inductor freezing stays off: on the CPU it measured x0.85 / x1.30 (batch 1 / 16) against
    # O1, and prepacking (below) x1.18 / x0.89 against freezing; unlike freezing, prepacking
    # leaves the weights out of the compiled code, so a warm start loads the code instead of
    # compiling it again. -cc.freezing=true still opts in.
    f"{_CC}.freezing": False,
    f"{_CC}.prepack_linear_weights": PREPACK_ON_CPU,
    f"{_CC}.cpp_wrapper": CPP_WRAPPER_ON_CPU,
    f"{_PC}.fuse_attn_quant": FP8_STATIC,
    f"{_PC}.fuse_allreduce_rms": TP_ALLREDUCE,
}
# CUDA -O3: not measured against -O2 yet. On a lent H200 (torch 2.11) the cold -O3 start of
# a 2-layer test model took over 170 s (max-autotune of every GEMM per compile size, on a
# machine loaded by a parallel test run); -O1/-O2 there matched -O0 token for token. The CPU
# narrows these switches off where they measured no faster (vllm/platforms/cpu.py).
_O3 = {
    **_O2,
    f"{_CC}.max_autotune": True,
    f"{_CC}.coordinate_descent_tuning": True,
    f"{_CC}.compile_sizes": O3_COMPILE_SIZES,
}

OPTIMIZATION_LEVEL_TO_CONFIG: dict[OptimizationLevel, dict[str, Any]] = {
    OptimizationLevel.O0: _O0,
    OptimizationLevel.O1: _O1,
    OptimizationLevel.O2: _O2,
    OptimizationLevel.O3: _O3,
}

LEVEL_CONTROLLED_FIELDS: tuple[str, ...] = tuple(_O0)
