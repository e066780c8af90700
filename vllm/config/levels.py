"""What each optimization level means: the base table, and the shape of a platform's own table.

`OPTIMIZATION_LEVEL_TO_CONFIG[level]` is the base table (upstream's), nested the way the
configs are: the key `"compilation_config"` holds the `CompilationConfig` fields a level sets
and, under `"pass_config"`, the `PassConfig` flags. A value is a constant or a named
predicate: a function of the whole `VllmConfig`, whose docstring's first line says what it
asks (that line is the reason `vllm config` shows).

A platform differs from the base table only through its own table (`Platform.level_table`),
of the same nested shape, whose leaves are `Setting(value, reason)`: the value (a constant or
a predicate) and why this platform wants it, with the measurement where one decided it.

`VllmConfig.__post_init__` applies the base table, then the platform's table, with the same
code, to every leaf the user (or the environment) did not set; then its derived rules. So a
level never overrides an explicit value; a `Setting(..., required=True)` (what the platform
cannot do otherwise, e.g. CUDA graphs on the CPU) turns a different explicit value into an
error instead.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

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
    """O1 + full and piecewise CUDA graphs, no-op elimination and fusion passes; CPU (its own
    level table): linear weights prepacked into column panels, C++ host code (Inductor's C++
    wrapper). The default."""
    O3 = 3
    """O2 + Inductor autotuning and per-size compiles for common decode sizes: tune for speed.
    CPU: those measured no faster there, so its level table turns them off and compiles the
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


# ---- predicates: the conditional defaults ---------------------------------------------------
def enable_norm_fusion(cfg: VllmConfig) -> bool:
    """model is FP8-quantized

    RMSNorm (+ residual add) followed by FP8 quantization is fused into one op; without FP8
    there is no quantization to fuse."""
    return cfg.model_config is not None and cfg.model_config.is_fp8


def enable_act_fusion(cfg: VllmConfig) -> bool:
    """model is FP8-quantized

    SiluAndMul followed by FP8 quantization is fused into one op; without FP8 there is no
    quantization to fuse."""
    return cfg.model_config is not None and cfg.model_config.is_fp8


def enable_attn_fusion(cfg: VllmConfig) -> bool:
    """model is FP8 with static activation scales

    Attention can write FP8 directly only when the scale of the next layer's input is a
    constant of the checkpoint."""
    return cfg.model_config is not None and cfg.model_config.has_static_activation_scales


def enable_allreduce_rms_fusion(cfg: VllmConfig) -> bool:
    """tensor_parallel_size > 1 and the platform has the fused all-reduce kernel

    With one rank there is no all-reduce to fuse. The kernel: on the CPU the shared-memory
    all-reduce of ranks on one host; on CUDA FlashInfer's (Hopper / Blackwell, 2/4/8 ranks)."""
    return (cfg.parallel_config.tensor_parallel_size > 1
            and cfg.platform.supports_allreduce_rms_fusion(cfg))


class Setting(NamedTuple):
    """One leaf of a platform's level table."""

    value: Any
    """A constant, or a predicate of the `VllmConfig` (as in the base table)."""
    reason: str
    """Why this platform sets it: what was measured, or what the platform cannot do."""
    required: bool = False
    """The platform cannot run anything else: an explicit user value that differs is an
    error naming this reason (else an explicit value simply wins, as over the base table)."""


def every_level(row: Mapping[str, Any]) -> dict[OptimizationLevel, dict[str, Any]]:
    """The same row of a platform's table at every level."""
    return {level: dict(row) for level in OptimizationLevel}


def merge_rows(*tables: Mapping[OptimizationLevel, Mapping[str, Any]]
               ) -> dict[OptimizationLevel, dict[str, Any]]:
    """Level tables merged leaf by leaf (later tables win), for building a platform's table
    from a row for every level and rows for some."""
    out: dict[OptimizationLevel, dict[str, Any]] = {}

    def merge(into: dict[str, Any], row: Mapping[str, Any]) -> None:
        for key, value in row.items():
            if isinstance(value, Mapping):
                merge(into.setdefault(key, {}), value)
            else:
                into[key] = value

    for table in tables:
        for level, row in table.items():
            merge(out.setdefault(OptimizationLevel(level), {}), row)
    return out


def describe(predicate: Callable[..., Any]) -> str:
    """What a predicate asks, in words: the first line of its docstring."""
    doc = (predicate.__doc__ or "").strip()
    return doc.splitlines()[0].strip() if doc else getattr(predicate, "__name__", "")


# Token counts that get their own static-shape compile at O3: the common decode batch sizes.
O3_COMPILE_SIZES = [1, 2, 4, 8, 16]

# Upstream's pass flags for which this engine has no pass: off at every level (a user may
# still set one; the pass manager then warns that nothing is fused).
_NO_PASS_HERE = ("enable_qk_norm_rope_fusion", "enable_sp", "fuse_gemm_comms",
                 "fuse_act_padding", "fuse_mla_dual_rms_norm", "fuse_rope_kvcache",
                 "fuse_qk_norm_rope_kvcache", "fuse_rope_kvcache_cat_mla")

OPTIMIZATION_LEVEL_00: dict[str, Any] = {
    "compilation_config": {
        "mode": CompilationMode.NONE,
        "cudagraph_mode": CUDAGraphMode.NONE,
        "use_inductor_graph_partition": False,
        "freezing": False,
        "prepack_linear_weights": False,
        "max_autotune": False,
        "coordinate_descent_tuning": False,
        "cpp_wrapper": False,
        "compile_sizes": [],
        "pass_config": {
            "eliminate_noops": False,
            "fuse_norm_quant": False,
            "fuse_act_quant": False,
            "fuse_attn_quant": False,
            "fuse_allreduce_rms": False,
            **dict.fromkeys(_NO_PASS_HERE, False),
        },
    },
}
OPTIMIZATION_LEVEL_01: dict[str, Any] = {
    "compilation_config": {
        **OPTIMIZATION_LEVEL_00["compilation_config"],
        "mode": CompilationMode.VLLM_COMPILE,
        "cudagraph_mode": CUDAGraphMode.PIECEWISE,
        "pass_config": {
            **OPTIMIZATION_LEVEL_00["compilation_config"]["pass_config"],
            "eliminate_noops": True,
            "fuse_norm_quant": enable_norm_fusion,
            "fuse_act_quant": enable_act_fusion,
        },
    },
}
OPTIMIZATION_LEVEL_02: dict[str, Any] = {
    "compilation_config": {
        **OPTIMIZATION_LEVEL_01["compilation_config"],
        "cudagraph_mode": CUDAGraphMode.FULL_AND_PIECEWISE,
        # Inductor freezing stays off: on the CPU it measured x0.85 / x1.30 (batch 1 / 16)
        # against O1, and prepacking x1.18 / x0.89 against freezing; unlike freezing,
        # prepacking leaves the weights out of the compiled code, so a warm start loads the
        # code instead of compiling it again. -cc.freezing=true still opts in.
        # (prepack_linear_weights and cpp_wrapper stay off here: the CPU's own level table
        # turns them on, vllm/platforms/cpu.py.)
        "freezing": False,
        "pass_config": {
            **OPTIMIZATION_LEVEL_01["compilation_config"]["pass_config"],
            "fuse_attn_quant": enable_attn_fusion,
            "fuse_allreduce_rms": enable_allreduce_rms_fusion,
        },
    },
}
# CUDA -O3: not measured against -O2 yet. On a lent H200 (torch 2.11) the cold -O3 start of
# a 2-layer test model took over 170 s (max-autotune of every GEMM per compile size, on a
# machine loaded by a parallel test run); -O1/-O2 there matched -O0 token for token. The CPU's
# level table turns these switches off, as they measured no faster there (vllm/platforms/cpu.py).
OPTIMIZATION_LEVEL_03: dict[str, Any] = {
    "compilation_config": {
        **OPTIMIZATION_LEVEL_02["compilation_config"],
        "max_autotune": True,
        "coordinate_descent_tuning": True,
        "compile_sizes": O3_COMPILE_SIZES,
    },
}

OPTIMIZATION_LEVEL_TO_CONFIG: dict[OptimizationLevel, dict[str, Any]] = {
    OptimizationLevel.O0: OPTIMIZATION_LEVEL_00,
    OptimizationLevel.O1: OPTIMIZATION_LEVEL_01,
    OptimizationLevel.O2: OPTIMIZATION_LEVEL_02,
    OptimizationLevel.O3: OPTIMIZATION_LEVEL_03,
}


def iter_level_defaults(table: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path from the `VllmConfig` root, value) for every leaf of a level's table."""
    for key, value in table.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            yield from iter_level_defaults(value, path)
        else:
            yield path, value


LEVEL_CONTROLLED_FIELDS: tuple[str, ...] = tuple(
    path for path, _ in iter_level_defaults(OPTIMIZATION_LEVEL_00))
"""Every leaf a level sets, as dotted paths (the same at every level)."""
